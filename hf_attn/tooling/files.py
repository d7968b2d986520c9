"""File helpers shared by the asset fetcher, the converters and the evaluation: hashing and atomic output."""

from __future__ import annotations

import contextlib
import hashlib
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


def _owner_tag() -> str:
    """What the scratch names of this process carry: `HOST-PID-`."""
    return f"{socket.gethostname()}-{os.getpid()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return True


def sweep_stale(directory: str | os.PathLike, prefix: str, suffix: str = "") -> list[Path]:
    """Remove the directories in `directory` named PREFIX + HOST-PID- ... + SUFFIX that a process of this
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
        if match and path.is_dir() and not _running(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def scratch_directory(prefix: str, dir: str | os.PathLike | None = None) -> tempfile.TemporaryDirectory:
    """`tempfile.TemporaryDirectory` named PREFIX + HOST-PID-..., in `dir` (default: the system's temporary
    directory), after sweeping what killed processes of this host left there under the same prefix."""
    sweep_stale(tempfile.gettempdir() if dir is None else dir, prefix)
    return tempfile.TemporaryDirectory(prefix=prefix + _owner_tag(), dir=dir)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it to `final` only if the block completes.

    A failure or interruption leaves `final` untouched (no half-written output); what a killed writer of this
    host left beside it is removed by the next call (`sweep_stale`). An existing `final` is
    an error unless `overwrite=True`, in which case it is replaced only once the new one is complete.
    """
    final = Path(final).resolve()
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"Output {final} already exists; pass --overwrite (overwrite=True) to replace it."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(final.parent, os.W_OK):
        raise PermissionError(f"Output directory {final.parent} is not writable; choose another --output.")
    sweep_stale(final.parent, f".{final.name}.", ".tmp")  # a killed writer's leftovers
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{_owner_tag()}", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if final.exists():
            if not overwrite:  # somebody else finished first
                raise FileExistsError(
                    f"Output {final} appeared while writing; pass --overwrite to replace it."
                )
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output(
    source: str | os.PathLike, output: str | os.PathLike, *, overwrite: bool, flag: str = "--output"
) -> Path:
    """The one output guard of every command, called before any work: ValueError if `output` is `source`,
    lies inside it or contains it (a command never modifies its source); FileExistsError if `output` exists
    and `overwrite` is False. Returns `output` as an absolute path."""
    src, out = Path(source).expanduser().resolve(), Path(output).expanduser().resolve()
    if out == src or src in out.parents or out in src.parents:
        where = "is" if out == src else "is inside" if src in out.parents else "contains"
        raise ValueError(
            f"{flag} {out} {where} the source checkpoint {src}; choose a {flag} outside it "
            "(commands never modify their source)"
        )
    if out.exists() and not overwrite:
        raise FileExistsError(f"Output {out} already exists; pass --overwrite to replace it")
    return out
