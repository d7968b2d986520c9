"""The one output guard (`hf_attn.tooling.files.check_output`): an output that is, lies inside or contains its
source is refused, an existing output needs overwrite, and overwrite replaces only what hf-attn wrote
(atomically, leaving nothing behind); the streamed converters go through it too. Scratch and half-written
outputs of killed processes are swept by the next run."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_gqa import file_hashes, make_tiny

from hf_attn.conversion import gqa
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.specs import ExpandSpec, GQASpec, WriteSpec
from hf_attn.tooling.cli import sigterm_exits_cleanly
from hf_attn.tooling.files import atomic_directory, check_output, scratch_directory


def test_check_output_refuses_the_source_its_inside_and_its_parents(tmp_path):
    src = tmp_path / "a" / "src"
    src.mkdir(parents=True)
    for out, where in (
        (src, "is"),
        (src / "x" / "y", "is inside"),
        (tmp_path / "a", "contains"),
        (tmp_path, "contains"),
    ):
        with pytest.raises(
            ValueError, match=f"--output {out.resolve()} {where} the source checkpoint"
        ):  # UserError
            check_output(src, out, overwrite=True)
    sibling = tmp_path / "a" / "src-out"  # a name that starts like the source's is outside it
    assert check_output(src, sibling, overwrite=False) == sibling.resolve()
    sibling.mkdir()
    with pytest.raises(FileExistsError, match=f"Output {sibling.resolve()} already exists; pass --overwrite"):
        check_output(src, sibling, overwrite=False)
    assert check_output(src, sibling, overwrite=True) == sibling.resolve()
    with pytest.raises(ValueError, match="--state-dir .* is inside"):
        check_output(src, src / "state", overwrite=True, flag="--state-dir")


@pytest.mark.parametrize("convert", ["gqa", "expand"])
def test_streamed_converters_never_write_into_their_source(tmp_path, convert):
    src = make_tiny(tmp_path / "src")
    before = file_hashes(src)
    for dst in (src, src / "converted"):
        with pytest.raises(ValueError, match="the source checkpoint"):
            if convert == "gqa":
                gqa.convert_gqa(
                    GQASpec(num_kv_heads=1, method="mean"), src=src, dst=dst, write=WriteSpec(overwrite=True)
                )
            else:
                expand.expand_checkpoint(ExpandSpec(), src=src, dst=dst, write=WriteSpec(overwrite=True))
    assert file_hashes(src) == before and not (src / "converted").exists()


CHILD = """
import sys, tempfile, time
import contextlib
from hf_attn.tooling.cli import sigterm_exits_cleanly
with sigterm_exits_cleanly() if sys.argv[2] == "handled" else contextlib.nullcontext():
    with tempfile.TemporaryDirectory(prefix="scratch-", dir=sys.argv[1]) as scratch:
        print(scratch, flush=True)
        time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["handled", "default"])
def test_sigterm_cleans_up_temporary_directories(tmp_path, mode):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), mode], stdout=subprocess.PIPE, text=True
    )
    scratch = child.stdout.readline().strip()  # the child is inside the `with` block now
    assert scratch and Path(scratch).is_dir()
    child.send_signal(signal.SIGTERM)
    status = child.wait(timeout=60)
    if mode == "handled":  # SystemExit(143): the `with` block's cleanup ran
        assert status == 143 and not Path(scratch).exists()
    else:  # the reference: Python's default SIGTERM action leaves the directory behind
        assert status == -signal.SIGTERM and Path(scratch).exists()


def _sleep() -> None:
    time.sleep(120)


def test_sigterm_handler_is_scoped_and_a_forked_child_takes_the_default_action():
    """A caller's own handler comes back after a command, and a process forked during one (lm-eval's bootstrap
    pool: `Pool.terminate` sends SIGTERM) dies of the signal as without the handler, instead of unwinding
    its parent's stack copy (which hung pool shutdowns)."""
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_exits_cleanly():
        assert signal.getsignal(signal.SIGTERM) is not before
        child = multiprocessing.get_context("fork").Process(target=_sleep)
        child.start()
        time.sleep(0.5)
        child.terminate()  # SIGTERM
        child.join(timeout=60)
    assert signal.getsignal(signal.SIGTERM) is before
    assert child.exitcode == -signal.SIGTERM  # the default action's status; 143 would mean SystemExit


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from hf_attn.tooling.files import atomic_directory, scratch_directory
where = Path(sys.argv[1])
scratch = scratch_directory("hf-attn-test-", dir=where)
(Path(scratch.name) / "statistics.pt").write_bytes(b"x" * 1000)
with atomic_directory(where / "out") as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
"""


def test_what_a_killed_process_left_is_swept_by_the_next_one(tmp_path):
    res = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[0].startswith(".out.") and left[1].startswith("hf-attn-test-"), left
    keep = [  # a running process's (this one's), another host's, and an untagged directory
        f"hf-attn-test-{socket.gethostname()}-{os.getpid()}-mine",
        "hf-attn-test-some-other-host-1-theirs",
        "hf-attn-test-untagged",
        f".out.{socket.gethostname()}-{os.getpid()}-mine.tmp",
    ]
    for name in keep:
        (tmp_path / name).mkdir()
    with scratch_directory("hf-attn-test-", dir=tmp_path) as fresh:
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"y")
        now = sorted(p.name for p in tmp_path.iterdir())
        assert now == sorted([*keep, "out", Path(fresh).name]), now  # both leftovers gone, the rest kept


# ------------------------------------------------------------------------------- what --overwrite may replace


def test_overwrite_replaces_only_what_hf_attn_wrote(tmp_path):
    from hf_attn.tooling.errors import UserError
    from hf_attn.tooling.files import json_record, write_text_atomic

    src = tmp_path / "src"
    src.mkdir()
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"model_type": "llama", "hf_attn": {"history": []}}))
    plain = tmp_path / "plain"  # a checkpoint, but not one hf-attn wrote
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for path, what in ((user, "notes.txt, sub/"), (plain, "config.json")):
        with pytest.raises(UserError, match=f"is a directory holding {what}, not a checkpoint hf-attn wrote"):
            check_output(src, path, overwrite=True)
    assert check_output(src, ours, overwrite=True) == ours.resolve()
    record = write_text_atomic(tmp_path / "r.json", json_record({"x": 1}, "hf-attn perplexity"))
    assert check_output(None, record, overwrite=True, kind="json") == record
    for path in (user / "notes.txt", ours / "config.json", user):
        with pytest.raises(UserError, match="not a JSON record hf-attn wrote"):
            check_output(None, path, overwrite=True, kind="json")
    with pytest.raises(UserError, match="not a directory"):
        check_output(None, user / "notes.txt", overwrite=False, kind="directory")


def test_atomic_replacement_leaves_nothing_and_a_failed_write_keeps_the_old(tmp_path):
    final = tmp_path / "out"
    for text in ("one", "two"):
        with atomic_directory(final, overwrite=True, kind="checkpoint") as tmp:
            (tmp / "config.json").write_text(json.dumps({"hf_attn": {"run": text}}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.*.tmp, no .out.*.old
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(final, overwrite=True) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("disk full")
    assert json.loads((final / "config.json").read_text()) == {"hf_attn": {"run": "two"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (final / "config.json").write_text("{}")  # no longer hf-attn's: the swap refuses it, keeps it
    with pytest.raises(ValueError, match="not a checkpoint hf-attn wrote"):
        with atomic_directory(final, overwrite=True, kind="checkpoint") as tmp:
            (tmp / "config.json").write_text("{}")
    assert (final / "config.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == [
        "out"
    ]
