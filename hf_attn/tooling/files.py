"""File helpers shared by the asset fetcher, the converters and the evaluation: hashing, atomic output, the
output guard (`check_output`: `--overwrite` replaces only what hf-attn wrote) and the sweep of what killed
processes left (`sweep_leftovers`)."""

from __future__ import annotations

import atexit
import codecs
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hf_attn.tooling.errors import UserError

# A checkpoint's weight files: what transformers loads a model from, and what `checkpoint_hash` covers.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Tensor files: the weights and others (training state such as heal's trainer_state.pt, other frameworks'
# weights), which are not hashed but, like the weights, never copied by a converter as a side file.
TENSOR_SUFFIXES = WEIGHT_SUFFIXES + (".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_hash(path: str | os.PathLike) -> str:
    """sha256 over the weight files of a checkpoint directory (names and contents, sorted by name)."""
    directory = Path(path)
    files = sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"No weight files ({', '.join(WEIGHT_SUFFIXES)}) in {directory}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def cache_dir() -> Path:
    """hf-attn's cache directory: `$HF_ATTN_CACHE`, or `~/.cache/hf-attn` when it is unset or empty
    (`assets.cache_dir` creates it). UserError when it names something that is not a directory."""
    value = os.environ.get("HF_ATTN_CACHE", "")
    root = Path(value).expanduser() if value else Path.home() / ".cache" / "hf-attn"
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise UserError(
            f"HF_ATTN_CACHE {root} is {_what_is_there(root)}, not a directory; set HF_ATTN_CACHE to a "
            "directory (unset, it is ~/.cache/hf-attn)"
        )
    return root


def _owner_tag(pid: int | None = None) -> str:
    """What the scratch names of a process carry: `HOST-PID-`."""
    return f"{socket.gethostname()}-{os.getpid() if pid is None else pid}-"


def _running(pid: int) -> bool:
    try:
        with contextlib.suppress(PermissionError):  # another user's process: it exists
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# The leftovers registry. Every scratch directory and half-written output is named with its writer's HOST-PID
# and listed in CACHE/running/HOST-PID (one path a line; where the cache cannot be written, in a directory of
# this user in the system's temporary directory). A clean exit removes both; after SIGKILL they stay, and the
# next project command on this host (any of them: `run_command` calls `sweep_leftovers`) settles what a
# process that no longer runs listed, wherever it was written. Only paths whose name carries the dead
# process's tag are touched, so nothing a user made ever is.
#
# An output NAME is replaced through tagged siblings: .NAME.HOST-PID-XXXX.tmp (being written), renamed .new
# once complete; the old NAME is then moved to .old, the .new renamed NAME, and the .old renamed .tmp and
# removed. A .new or .old is complete: settling puts it back at NAME when NAME is missing (the .new first),
# and removes it otherwise; a .tmp is always removed. So a kill at any instant leaves a complete output.
COMPLETE = (".new", ".old")


def _registries() -> list[Path]:
    """Where leftovers are listed: CACHE/running/, then this user's directory in the temporary directory
    (only while this user owns it: another user's list is never followed)."""
    fallback = Path(tempfile.gettempdir()) / f"hf-attn-running-{os.getuid()}"
    with contextlib.suppress(OSError):  # (none yet: created on first use)
        if fallback.lstat().st_uid != os.getuid() or fallback.is_symlink():
            fallback = None
    try:
        return [cache_dir() / "running", *([fallback] if fallback else [])]
    except ValueError:  # a cache that is not a directory
        return [fallback] if fallback else []


def register(path: str | os.PathLike) -> None:
    """List `path` (a scratch or partial output of this process) in this host's leftovers registry."""
    for directory in _registries():
        with contextlib.suppress(OSError):  # an unwritable cache: the next registry
            private = directory.name != "running"  # this user's, in the temporary directory
            directory.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
            with open(directory / _owner_tag().rstrip("-"), "a") as f:
                f.write(f"{Path(path).resolve()}\n")
            return


def _settle(path: Path, tag: str) -> None:
    """Settle one leftover of the dead process tagged `tag` (see COMPLETE): removed, or put back in place."""
    at = path.name.rfind("." + tag)
    if path.name.startswith(".") and path.name.endswith(COMPLETE) and at > 0:
        final = path.with_name(path.name[1:at])
        if not (final.exists() or final.is_symlink()):
            with contextlib.suppress(OSError):  # (another process settled it first)
                path.rename(final)
            return
    _remove(path)


def _new_first(path: Path) -> bool:
    return path.name.endswith(".old")


def sweep_leftovers() -> list[Path]:
    """Settle what processes of this host that no longer run left (their registry lists it); returns it."""
    host = socket.gethostname()
    settled: list[Path] = []
    for registry in _registries():
        try:
            entries = list(registry.iterdir())
        except OSError:
            continue
        for entry in entries:
            owner, _, pid = entry.name.rpartition("-")
            if owner != host or not pid.isdigit() or _running(int(pid)):
                continue
            tag = _owner_tag(int(pid))
            try:
                paths = [Path(line) for line in entry.read_text().splitlines() if line]
            except OSError:
                continue
            for path in sorted(paths, key=_new_first):
                if tag in path.name and (path.exists() or path.is_symlink()):
                    _settle(path, tag)
                    settled.append(path)
            with contextlib.suppress(OSError):
                entry.unlink()
    return settled


def _forget_own_registry(owner: int = os.getpid()) -> None:
    """At a clean exit: this process's registry entries go (its scratch is cleaned by its own `with`s)."""
    if os.getpid() == owner:
        for registry in _registries():
            with contextlib.suppress(OSError):
                (registry / _owner_tag().rstrip("-")).unlink()


atexit.register(_forget_own_registry)


def sweep_stale(directory: str | os.PathLike, prefix: str) -> list[Path]:
    """Settle (`_settle`) the entries in `directory` named PREFIX + HOST-PID- ... that a process of this host,
    no longer running, left behind (SIGKILL skips every cleanup); keeps the others. Returns those settled."""
    pattern = re.compile(re.escape(prefix) + re.escape(socket.gethostname()) + r"-(\d+)-.*")
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    removed = []
    for path in sorted(entries, key=_new_first):
        match = pattern.fullmatch(path.name)
        if match and not _running(int(match.group(1))):
            _settle(path, f"{socket.gethostname()}-{match.group(1)}-")
            removed.append(path)
    return removed


def scratch_directory(prefix: str, dir: str | os.PathLike | None = None) -> tempfile.TemporaryDirectory:
    """`tempfile.TemporaryDirectory` named PREFIX + HOST-PID-..., in `dir` (default: the system's temporary
    directory), listed in the leftovers registry, after sweeping what killed processes of this host left
    there under the same prefix."""
    sweep_stale(tempfile.gettempdir() if dir is None else dir, prefix)
    scratch = tempfile.TemporaryDirectory(prefix=prefix + _owner_tag(), dir=dir)
    register(scratch.name)
    return scratch


def _partial(final: Path, suffix: str, *, directory: bool) -> Path:
    """A registered sibling of `final`, .NAME.HOST-PID-XXXX`suffix` (a directory or an empty file)."""
    sweep_stale(final.parent, f".{final.name}.")  # what a killed writer of `final` left
    make = tempfile.mkdtemp if directory else tempfile.mkstemp
    made = make(prefix=f".{final.name}.{_owner_tag()}", suffix=suffix, dir=final.parent)
    if not directory:
        os.close(made[0])
        made = made[1]
    register(made)
    return Path(made)


@contextlib.contextmanager
def atomic_directory(
    final: str | os.PathLike, *, overwrite: bool = False, kind: str | None = None
) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it to `final` only if the block completes.

    A failure or interruption leaves `final` untouched; what a killed writer left is settled by the next
    command (`sweep_leftovers`). An existing `final` is an error unless `overwrite=True`; then the complete
    new one replaces it (`_swap`), with `kind` only if it still is one (`check_replaceable`). A "checkpoint"
    lists the files it holds in MANIFEST. An OSError that names no file (a full disk) names `final`.
    """
    final = Path(final).resolve()
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"Output {final} already exists; pass --overwrite (overwrite=True) to replace it."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(final.parent, os.W_OK):
        raise PermissionError(f"Output directory {final.parent} is not writable; choose another --output.")
    tmp = _partial(final, ".tmp", directory=True)
    try:
        yield tmp
        if kind == "checkpoint":
            names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir())
            (tmp / MANIFEST).write_text("".join(f"{n}\n" for n in names if n != MANIFEST))
        tmp.chmod(0o755)
        _swap(tmp, final, overwrite=overwrite, kind=kind)
    except OSError as err:
        _name_the_file(err, final)
        raise
    finally:
        _remove(tmp)
        _remove(_renamed(tmp, ".new"))


def _name_the_file(err: OSError, path: Path) -> None:
    """Make `err` name `path` if it names no file (a write to a full disk names none)."""
    if err.filename is None and err.errno is not None:
        err.filename = str(path)


def _renamed(partial: Path, suffix: str) -> Path:
    """The sibling .NAME.HOST-PID-XXXX`suffix` of a partial .NAME.HOST-PID-XXXX.SUFFIX."""
    return partial.with_name(partial.name.rsplit(".", 1)[0] + suffix)


def _swap(new: Path, final: Path, *, overwrite: bool, kind: str | None) -> None:
    """Put the complete `new` at `final`. An existing `final` (allowed by `overwrite`, and of `kind` if
    given) is replaced by the renames that leave a complete output at every instant (see COMPLETE)."""
    if not (final.exists() or final.is_symlink()):
        new.rename(final)
        return
    if not overwrite:  # somebody else finished first
        raise FileExistsError(f"Output {final} appeared while writing; pass --overwrite to replace it.")
    if kind is not None:
        check_replaceable(final, kind)
    complete = _renamed(new, ".new")
    register(complete)
    new.rename(complete)
    old = _partial(final, ".old", directory=False)
    if final.is_dir() and not final.is_symlink():
        old.unlink()  # a directory is renamed onto a free name
    os.replace(final, old)
    try:
        complete.rename(final)
    except BaseException:
        old.rename(final)  # put the old one back
        raise
    trash = _renamed(old, ".tmp")  # no longer a complete copy: never put back once partly removed
    register(trash)
    os.replace(old, trash)
    _remove(trash)


def write_text_atomic(final: str | os.PathLike, text: str | bytes) -> Path:
    """Write a file (text, or bytes) atomically: a registered temporary sibling, then one rename over
    `final`. An OSError that names no file (a full disk) names `final`."""
    final = Path(final).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(final, ".tmp", directory=False)
    try:
        tmp.write_bytes(text) if isinstance(text, bytes) else tmp.write_text(text)
        tmp.chmod(0o644)
        if final.is_dir():
            raise IsADirectoryError(21, "is a directory; give a file name", str(final))
        os.replace(tmp, final)
    except OSError as err:
        _name_the_file(err, final)
        raise
    finally:
        _remove(tmp)
    return final


def check_text_files(paths, flag: str = "--text") -> list[Path]:
    """UserError naming the file unless each of `paths` is a non-empty UTF-8 text file (no NUL bytes): a
    binary or missing file is refused before any model is loaded. Returns the paths."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise UserError(f"{flag} {path} does not exist; check the path")
        if not path.is_file():
            raise UserError(f"{flag} {path} is {_what_is_there(path)}, not a text file; give a file")
        if path.stat().st_size == 0:
            raise UserError(f"{flag} {path} is empty; give a file that contains text")
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    if (at := chunk.find(b"\0")) >= 0:
                        raise UnicodeDecodeError("utf-8", chunk, at, at + 1, "a NUL byte")
                    decoder.decode(chunk)
                    offset += len(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise UserError(
                f"{flag} {path} is not UTF-8 text (byte {offset + err.start}: {err.reason}); give a plain "
                "text file"
            ) from err
        out.append(path)
    return out


# The output guard. What `--overwrite` may replace: a checkpoint whose config.json carries the conversion
# record, or a JSON record carrying WRITTEN_BY (every JSON a command writes has it: `json_record`).
WRITTEN_BY = "written_by"
OUTPUT_KINDS = ("checkpoint", "json", "directory")
# In a checkpoint directory hf-attn wrote: the files it wrote there (relative paths, one a line). A checkpoint
# written before this list existed: the files every checkpoint may hold (`_CHECKPOINT_FILE`).
MANIFEST = ".hf-attn-files"
_CHECKPOINT_FILE = re.compile(
    r"(config|generation_config|special_tokens_map|added_tokens|hf_attn_study)\.json|tokenizer[^/]*"
    r"|vocab\.[^/]+|merges\.txt|chat_template\.[^/]+|[^/]+\.index\.json|[^/]+\.(safetensors|bin)"
)
_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def json_record(record: dict, prog: str) -> str:
    """The text of a command's JSON output: `record` with WRITTEN_BY = `prog` first. Valid JSON only: a NaN
    or an infinity raises ValueError (a result that is not a number is an error, never written)."""
    return json.dumps({WRITTEN_BY: prog, **record}, indent=2, default=str, allow_nan=False) + "\n"


def write_json(path: str | os.PathLike, data, *, prog: str | None = None) -> Path:
    """`data` as indented JSON at `path`, atomically (`write_text_atomic`). With `prog`, a command's record
    (`json_record`: marked as written by `prog`, so that a later run may replace it, and NaN refused)."""
    text = json.dumps(data, indent=2, default=str) + "\n" if prog is None else json_record(data, prog)
    return write_text_atomic(path, text)


def read_json(path: Path):
    """The JSON value in the file `path`, or None where it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _what_is_there(path: Path) -> str:
    """A short description of what `path` holds, for a refusal."""
    if path.is_symlink():
        return f"a link to {os.readlink(path)}"
    if not path.is_dir():
        mode = path.stat().st_mode
        special = (what for is_kind, what in _SPECIAL_FILES if is_kind(mode))
        return next(special, f"a file of {path.stat().st_size} bytes")
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "an empty directory"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"a directory holding {shown}"


def not_written_here(directory: Path) -> list[str]:
    """The files in the checkpoint `directory` (relative paths) that hf-attn did not write there: those its
    MANIFEST does not list (without one: those `_CHECKPOINT_FILE` does not name)."""
    try:
        listed = set((directory / MANIFEST).read_text().splitlines()) | {MANIFEST}
    except (OSError, UnicodeDecodeError):
        listed = None
    files = (p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*")) if not p.is_dir())
    if listed is None:
        return [name for name in files if not _CHECKPOINT_FILE.fullmatch(name)]
    return [name for name in files if name not in listed]


def check_replaceable(path: Path, kind: str, flag: str = "--output") -> None:
    """UserError unless the existing `path` is an output of `kind` that this project wrote: a "checkpoint"
    directory whose config.json carries config["hf_attn"] and that holds only files hf-attn wrote there
    (`not_written_here`), a "json" file carrying WRITTEN_BY. A "directory" output is added to, never
    replaced: anything but a file is fine."""
    if kind == "directory":
        if path.exists() and not path.is_dir():
            raise UserError(f"{flag} {path} is {_what_is_there(path)}, not a directory; choose a directory")
        return
    if kind == "checkpoint" and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return  # an empty directory: replacing it loses nothing
    if kind == "checkpoint":
        config = read_json(path / "config.json") if path.is_dir() and not path.is_symlink() else None
        ours = isinstance(config, dict) and isinstance(config.get("hf_attn"), dict)
        what = "a checkpoint hf-attn wrote"
    elif kind == "json":
        record = read_json(path) if path.is_file() and not path.is_symlink() else None
        ours = isinstance(record, dict) and str(record.get(WRITTEN_BY, "")).startswith("hf-attn")
        what = "a JSON record hf-attn wrote"
    else:
        raise ValueError(f"Unknown output kind {kind!r}; choose one of {', '.join(OUTPUT_KINDS)}")
    if not ours:
        raise UserError(
            f"{flag} {path} is {_what_is_there(path)}, not {what}; hf-attn replaces only its own outputs: "
            f"choose another {flag}"
        )
    foreign = not_written_here(path) if kind == "checkpoint" else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(
            f"{flag} {path} holds {shown}, which hf-attn did not write; --overwrite replaces only its own "
            f"files: move them out of {path} (or delete them), or choose another {flag}"
        )


def _check_writable(path: Path, flag: str) -> None:
    """UserError unless `path` could be created: its nearest existing ancestor is a writable directory."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path} is not writable: {parent} is a file; choose another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} is not writable ({parent} is not); choose another {flag}")


def check_output(
    source: str | os.PathLike | None,
    output: str | os.PathLike,
    *,
    overwrite: bool,
    flag: str = "--output",
    kind: str | None = "checkpoint",
) -> Path:
    """The one output guard of every command, called before any work (it writes nothing): UserError if
    `output` is `source`, lies inside it or contains it (a command never modifies its source), if it exists
    and `overwrite` is False, if `overwrite` would replace something of another `kind` than the command
    writes or that this project did not write (`check_replaceable`), or if it cannot be created. kind None:
    only the source and existence checks. A dangling link on the way to `output`, and a trailing slash on
    a "json" output, are refused. Returns `output` as an absolute path."""
    given = Path(output).expanduser()
    on_the_way = (*reversed(given.absolute().parents), given.absolute())
    link = next((p for p in on_the_way if p.is_symlink() and not p.exists()), None)
    if link is not None:  # a dangling link (as GNU cp: never create a link's target)
        where = "is" if link == given.absolute() else f"goes through {link},"
        raise UserError(
            f"{flag} {given} {where} a dangling link (to {os.readlink(link)}); hf-attn does not write "
            "through it: remove the link or give the path of its target"
        )
    if kind == "json" and str(output).endswith(("/", os.sep)):
        raise UserError(
            f"{flag} {output} ends with '/', a directory, but the output is a JSON file: give a file name "
            f"such as {output}result.json"
        )
    out = given.resolve()
    if source is not None:
        src = Path(source).expanduser().resolve()
        if out == src or src in out.parents or out in src.parents:
            where = "is" if out == src else "is inside" if src in out.parents else "contains"
            raise UserError(
                f"{flag} {out} {where} the source checkpoint {src}; choose a {flag} outside it "
                "(commands never modify their source)"
            )
    exists = out.exists() or out.is_symlink()
    if kind == "directory":
        check_replaceable(out, kind, flag)
    elif exists and not overwrite:  # (an OSError: one line, exit status 2, as a UserError)
        raise FileExistsError(f"Output {out} already exists; pass --overwrite to replace it")
    elif exists and kind is not None:
        check_replaceable(out, kind, flag)
    if kind is not None:
        _check_writable(out, flag)
    return out
