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
import tempfile
from collections.abc import Iterator
from pathlib import Path

# A checkpoint's weight files: what transformers loads a model from, and what `checkpoint_hash` covers.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Other tensor files (training state such as heal's trainer_state.pt, other frameworks' weights): not hashed,
# but, like the weights, never copied by a converter as a side file (see `TENSOR_SUFFIXES`).
OTHER_TENSOR_SUFFIXES = (".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
TENSOR_SUFFIXES = WEIGHT_SUFFIXES + OTHER_TENSOR_SUFFIXES


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
    """hf-attn's cache directory (`$HF_ATTN_CACHE`, default `~/.cache/hf-attn`; `assets.cache_dir` too)."""
    return Path(os.environ.get("HF_ATTN_CACHE", Path.home() / ".cache" / "hf-attn")).expanduser()


def _owner_tag(pid: int | None = None) -> str:
    """What the scratch names of a process carry: `HOST-PID-`."""
    return f"{socket.gethostname()}-{os.getpid() if pid is None else pid}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ------------------------------------------------------------------------------------- leftovers registry
# Every scratch directory and half-written output is named with its writer's HOST-PID and listed in
# CACHE/running/HOST-PID (one path a line). A clean exit removes both; after SIGKILL they stay, and the next
# project command on this host (any of them: `run_command` calls `sweep_leftovers`) removes what a process
# that no longer runs listed, wherever it was written. Only paths whose name carries the dead process's tag
# are removed, so nothing a user made is ever touched.


def _registry() -> Path:
    return cache_dir() / "running"


def register(path: str | os.PathLike) -> None:
    """List `path` (a scratch or half-written output of this process) in this host's leftovers registry."""
    try:
        directory = _registry()
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / _owner_tag().rstrip("-"), "a") as f:
            f.write(f"{Path(path).resolve()}\n")
    except OSError:  # an unwritable cache: the directory-local sweep (`sweep_stale`) still applies
        pass


def sweep_leftovers() -> list[Path]:
    """Remove what processes of this host that no longer run left (their registry lists it); returns it."""
    host = socket.gethostname()
    removed: list[Path] = []
    try:
        entries = list(_registry().iterdir())
    except OSError:
        return removed
    for entry in entries:
        owner, _, pid = entry.name.rpartition("-")
        if owner != host or not pid.isdigit() or _running(int(pid)):
            continue
        tag = _owner_tag(int(pid))
        try:
            paths = [Path(line) for line in entry.read_text().splitlines() if line]
        except OSError:
            continue
        for path in paths:
            if tag in path.name and (path.exists() or path.is_symlink()):
                _remove(path)
                removed.append(path)
        with contextlib.suppress(OSError):
            entry.unlink()
    return removed


def _forget_own_registry(owner: int = os.getpid()) -> None:
    """At a clean exit: this process's registry entry goes (its scratch is cleaned by its own `with`s)."""
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            (_registry() / _owner_tag().rstrip("-")).unlink()


atexit.register(_forget_own_registry)


def sweep_stale(directory: str | os.PathLike, prefix: str, suffix: str = "") -> list[Path]:
    """Remove the entries in `directory` named PREFIX + HOST-PID- ... + SUFFIX that a process of this
    host, no longer running, left behind (SIGKILL skips every cleanup). Other hosts' and running processes'
    entries, and names without the tag, are kept. Returns what was removed."""
    pattern = re.compile(
        re.escape(prefix) + re.escape(socket.gethostname()) + r"-(\d+)-.*" + re.escape(suffix)
    )
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    removed = []
    for path in entries:
        match = pattern.fullmatch(path.name)
        if match and not _running(int(match.group(1))):
            _remove(path)
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
    sweep_stale(final.parent, f".{final.name}.", suffix)  # a killed writer's leftovers
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

    A failure or interruption leaves `final` untouched (no half-written output); what a killed writer of this
    host left is removed by the next command (`sweep_leftovers`). An existing `final` is an error unless
    `overwrite=True`; then it is replaced only once the new one is complete, by two renames (the old one
    moved aside under a tagged name, then removed), and with `kind` only if it still is one
    (`check_replaceable`).
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
        tmp.chmod(0o755)
        _swap(tmp, final, overwrite=overwrite, kind=kind)
    finally:
        _remove(tmp)


def _swap(new: Path, final: Path, *, overwrite: bool, kind: str | None) -> None:
    """Put `new` at `final`; an existing `final` (allowed by `overwrite`, and of `kind` if given) is moved
    aside to a tagged sibling and removed once `new` is in place."""
    if not (final.exists() or final.is_symlink()):
        new.rename(final)
        return
    if not overwrite:  # somebody else finished first
        raise FileExistsError(f"Output {final} appeared while writing; pass --overwrite to replace it.")
    if kind is not None:
        check_replaceable(final, kind)
    old = _partial(final, ".old", directory=False)
    if final.is_dir() and not final.is_symlink():
        old.unlink()  # a directory is renamed onto a free name
    os.replace(final, old)
    try:
        new.rename(final)
    except BaseException:
        old.rename(final)  # put the old one back
        raise
    _remove(old)


def write_text_atomic(final: str | os.PathLike, text: str, *, overwrite: bool = True) -> Path:
    """Write a file atomically: a registered temporary sibling, then one rename over `final`."""
    final = Path(final).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(final, ".tmp", directory=False)
    try:
        tmp.write_text(text)
        tmp.chmod(0o644)
        if final.is_dir():
            raise IsADirectoryError(21, "is a directory; give a file name", str(final))
        if final.exists() and not overwrite:
            raise FileExistsError(f"Output {final} appeared while writing; pass --overwrite to replace it.")
        os.replace(tmp, final)
    finally:
        _remove(tmp)
    return final


def check_text_files(paths, flag: str = "--text") -> list[Path]:
    """UserError naming the file unless each of `paths` is a non-empty UTF-8 text file (no NUL bytes): a
    binary or missing file is refused before any model is loaded. Returns the paths."""
    from hf_attn.tooling.errors import UserError

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
                    if b"\0" in chunk:
                        at = chunk.index(b"\0")
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


# ------------------------------------------------------------------------------------- the output guard

# What `--overwrite` may replace: a checkpoint whose config.json carries the conversion record, or a JSON
# record carrying WRITTEN_BY (every JSON a command writes has it: `json_record`).
WRITTEN_BY = "written_by"
OUTPUT_KINDS = ("checkpoint", "json", "directory")


def json_record(record: dict, prog: str) -> str:
    """The text of a command's JSON output: `record` with WRITTEN_BY = `prog` first."""
    return json.dumps({WRITTEN_BY: prog, **record}, indent=2, default=str) + "\n"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _what_is_there(path: Path) -> str:
    """A short description of what `path` holds, for a refusal."""
    if path.is_symlink():
        return f"a link to {os.readlink(path)}"
    if not path.is_dir():
        return f"a file of {path.stat().st_size} bytes"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "an empty directory"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"a directory holding {shown}"


def check_replaceable(path: Path, kind: str, flag: str = "--output") -> None:
    """UserError unless the existing `path` is an output of `kind` that this project wrote: a "checkpoint"
    directory whose config.json carries config["hf_attn"], a "json" file carrying WRITTEN_BY. A "directory"
    output is added to, never replaced: anything but a file is fine."""
    from hf_attn.tooling.errors import UserError

    if kind == "directory":
        if path.exists() and not path.is_dir():
            raise UserError(f"{flag} {path} is {_what_is_there(path)}, not a directory; choose a directory")
        return
    if kind == "checkpoint" and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return  # an empty directory: replacing it loses nothing
    if kind == "checkpoint":
        config = _read_json(path / "config.json") if path.is_dir() and not path.is_symlink() else None
        ours = isinstance(config, dict) and isinstance(config.get("hf_attn"), dict)
        what = "a checkpoint hf-attn wrote"
    elif kind == "json":
        record = _read_json(path) if path.is_file() and not path.is_symlink() else None
        ours = isinstance(record, dict) and str(record.get(WRITTEN_BY, "")).startswith("hf-attn")
        what = "a JSON record hf-attn wrote"
    else:
        raise ValueError(f"Unknown output kind {kind!r}; choose one of {', '.join(OUTPUT_KINDS)}")
    if not ours:
        raise UserError(
            f"{flag} {path} is {_what_is_there(path)}, not {what}; hf-attn replaces only its own outputs: "
            f"choose another {flag}"
        )


def _check_writable(path: Path, flag: str) -> None:
    """UserError unless `path` could be created: its nearest existing ancestor is a writable directory."""
    from hf_attn.tooling.errors import UserError

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
    only the source and existence checks. Returns `output` as an absolute path."""
    from hf_attn.tooling.errors import UserError

    out = Path(output).expanduser().resolve()
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
