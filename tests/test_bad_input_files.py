"""The files a command writes, against a user's files: table-driven like `test_bad_input.py` (exit status 2,
exactly one line on stderr naming the problem, every file of the workspace hashed before and after), plus
real kills (`SIGKILL` at each rename of an `--overwrite` replacement, then the next command's sweep) and
the study's report when no variant could be measured.

The rule under test: a command writes only into what it created, replaces only what it wrote (a directory
file by file), and an `--overwrite` replacement leaves a complete output, old or new, at every instant."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import pytest
from conftest import tree_hashes
from test_bad_input import HEAL, PPL, PROGS, make_checkpoint

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import gqa, refine
from hf_attn.conversion.specs import GQASpec
from hf_attn.conversion.training import heal
from hf_attn.eval import perplexity, study
from hf_attn.tooling import assets, files

G = convert_cli.gqa_main
T, C = "{ws}/tiny", "{ws}/converted"
MEAN = ["--num-kv-heads", "1", "--method", "mean", "--refine-steps", "0"]  # the quickest conversion
# the profiles' settings without their lists of variants (each file below runs every variant it has)
STUDY_HEADER = re.sub(r"(?m)^variants = .*$", "", study.DEFAULT_CONFIG.read_text().split("[[variants]]")[0])
FIRST = '[[variants]]\nname = "first"\nkind = "source"\n\n'  # a good variant that would run first
BAD_VARIANTS = {  # a study config per bad variant, each after FIRST
    "escape": 'name = "../../escape"\nkind = "gqa"\nnum_kv_heads = 1',
    "absolute": 'name = "/tmp/hf-attn-escape"\nkind = "gqa"\nnum_kv_heads = 1',
    "unknown": 'name = "colourful"\nkind = "gqa"\nnum_kv_heads = 1\ncolour = "red"',
    "kv2": 'name = "kv2"\nkind = "gqa"\nnum_kv_heads = 2',
    "budget7": 'name = "b7"\nkind = "mla"\nkv_budget = 7',
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The hashed workspace: a tiny checkpoint and a conversion of it, and the user's files beside and
    inside the outputs the rows name."""
    root = tmp_path_factory.mktemp("bad-files")
    make_checkpoint(root / "tiny")
    gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=root / "tiny", dst=root / "converted")
    novel = assets.austen_file(assets.TRAIN_NOVELS[0])  # (never the evaluation text)
    (root / "text.txt").write_text(novel.read_text(encoding="utf-8")[:20000])
    shutil.copytree(root / "converted", root / "converted_notes")
    (root / "converted_notes" / "NOTES.md").write_text("what I changed after fine-tuning\n")
    shutil.copytree(root / "converted", root / "converted_runs")
    (root / "converted_runs" / "runs").mkdir()
    (root / "converted_runs" / "runs" / "log.txt").write_text("my training run\n")
    for name, file, data in (
        ("res_json", "results.json", b'{"my": 1}\n'),
        ("res_md", "report.md", b"# my report\n"),
        ("res_png", "pareto.png", b"\x89PNG\r\n\x1a\nmy plot"),
        ("res_rows", "rows/source.json", b'{"my": "row"}\n'),
    ):
        (root / name / file).parent.mkdir(parents=True)
        (root / name / file).write_bytes(data)
    (root / "healme.heal").mkdir()
    (root / "healme.heal" / "log.jsonl").write_text('{"my": "own log"}\n')
    (root / "userdir").mkdir()
    (root / "userdir" / "notes.txt").write_text("my notes\n")
    (root / "userfile.txt").write_text("mine\n")
    for name, variant in BAD_VARIANTS.items():
        (root / f"{name}.toml").write_text(STUDY_HEADER + FIRST + "[[variants]]\n" + variant + "\n")
    return root


@pytest.fixture(scope="module")
def special(ws, tmp_path_factory):
    """What no hash reads, outside the hashed workspace: a named pipe, and links to nowhere in it."""
    root = tmp_path_factory.mktemp("special")
    os.mkfifo(root / "pipe")
    (root / "dangling").symlink_to(ws / "nowhere" / "deeper" / "out")
    (root / "dangling.json").symlink_to(ws / "nowhere" / "ppl.json")
    (root / "danglingdir").symlink_to(ws / "nowhere")
    return root


S = study.main
ROWS = [
    # (command main, argv, environment, what the one line must contain)
    # --- the study's report writer replaces only its own files in --results
    (S, ["--results", "{ws}/res_json", "--only", "source"], {}, "results.json"),
    (S, ["--results", "{ws}/res_md", "--only", "source"], {}, "report.md"),
    (S, ["--results", "{ws}/res_png", "--only", "source"], {}, "pareto.png"),
    (S, ["--results", "{ws}/res_rows", "--only", "source"], {}, "rows/source.json"),
    # --- --overwrite checks a checkpoint directory file by file
    (G, ["--model", T, "--output", "{ws}/converted_notes", "--overwrite", *MEAN], {}, "NOTES.md"),
    (G, ["--model", T, "--output", "{ws}/converted_runs", "--overwrite", *MEAN], {}, "runs/log.txt"),
    (heal.main, ["--model", C, "--output", "{ws}/converted_notes", "--overwrite", *HEAL[4:]], {}, "NOTES.md"),
    (refine.main, ["--model", C, "--output", "{ws}/converted_runs", "--overwrite"], {}, "runs/log.txt"),
    # --- heal's state directory: its own log and checkpoints only
    (heal.main, ["--model", C, "--output", "{ws}/healme", *HEAL[4:]], {}, "log.jsonl"),
    (heal.main, ["--model", C, "--output", "{ws}/h2", "--state-dir", "{ws}/userdir", *HEAL[4:]], {}, "notes"),
    # --- study variants: names that leave the study cache, options checked before the first variant runs
    (S, ["--config", "{ws}/escape.toml"], {}, "'../../escape'"),
    (S, ["--config", "{ws}/absolute.toml"], {}, "'/tmp/hf-attn-escape'"),
    (S, ["--config", "{ws}/unknown.toml"], {}, "variant 'colourful'"),
    (S, ["--config", "{ws}/kv2.toml"], {}, "choose --num-kv-heads from 1, 3"),
    (S, ["--config", "{ws}/budget7.toml"], {}, "got 7"),
    # --- never through a dangling link
    (G, ["--model", T, "--output", "{special}/dangling", *MEAN], {}, "dangling link"),
    (G, ["--model", T, "--output", "{special}/danglingdir/out", *MEAN], {}, "dangling link"),
    (perplexity.main, [*PPL, "--output", "{special}/dangling.json"], {}, "dangling link"),
    # --- a trailing slash, a named pipe, a cache that is a file
    (perplexity.main, [*PPL, "--output", "{ws}/newdir/"], {}, "ends with '/'"),
    (perplexity.main, [*PPL, "--output", "{special}/pipe"], {}, "a named pipe"),
    (perplexity.main, [*PPL, "--text", "{special}/pipe"], {}, "a named pipe"),
    (perplexity.main, PPL, {"HF_ATTN_CACHE": "{ws}/userfile.txt"}, "HF_ATTN_CACHE"),
]


def _status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse
        return exit_.code


def _no_study_work(self):
    raise AssertionError("the study started its variants before refusing its input")


@pytest.mark.parametrize(
    "main,argv,env,expected",
    ROWS,
    ids=[f"{PROGS[m].removeprefix('hf-attn ')}:{expected}" for m, _, _, expected in ROWS],
)
def test_a_file_that_is_not_ours_is_one_line_exit_2_and_untouched(
    ws, special, main, argv, env, expected, capsys, monkeypatch
):
    monkeypatch.chdir(ws)  # default outputs (the study's ./results) land in the hashed workspace
    monkeypatch.setattr(study.Study, "run", _no_study_work)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(ws=ws))
    before = tree_hashes(ws)
    capsys.readouterr()
    status = _status(main, [a.format(ws=ws, special=special) for a in argv])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{PROGS[main]}: error: ") and expected in err, err
    assert tree_hashes(ws) == before


# ----------------------------------------------------------------------------------- --overwrite and kills


def _write(final: Path, run: str) -> None:
    with files.atomic_directory(final, overwrite=True, kind="checkpoint") as tmp:
        (tmp / "config.json").write_text(json.dumps({"hf_attn": {"run": run}}))
        (tmp / "model.safetensors").write_bytes(run.encode() * 1000)


def _killed_writer(final: Path, run: str, *, kill_at: int | None) -> int:
    """Fork a process that replaces `final` with `run` and dies of SIGKILL right after its `kill_at`-th
    rename (None: before its first write); return its wait status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        try:
            renames = 0

            def killing(real):
                def rename(*args, **kwargs):
                    nonlocal renames
                    real(*args, **kwargs)
                    renames += 1
                    if renames == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)

                return rename

            os.rename, os.replace = killing(os.rename), killing(os.replace)
            if kill_at is None:
                scratch = files.scratch_directory("hf-attn-test-", dir=final.parent)
                (Path(scratch.name) / "statistics.pt").write_bytes(b"x")
                with files.atomic_directory(final.with_name("other"), kind="checkpoint") as tmp:
                    (tmp / "model.safetensors").write_bytes(b"x")
                    os.kill(os.getpid(), signal.SIGKILL)
            _write(final, run)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def _complete(final: Path) -> str:
    """The run whose complete output is at `final` (its config and its weights agree)."""
    run = json.loads((final / "config.json").read_text())["hf_attn"]["run"]
    assert (final / "model.safetensors").read_bytes() == run.encode() * 1000, "weights of another run"
    return run


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_a_replacement_killed_at_any_rename_leaves_one_complete_output(tmp_path, kill_at):
    final = tmp_path / "out"
    _write(final, "old")
    status = _killed_writer(final, "new", kill_at=kill_at)
    assert os.WIFEXITED(status) or os.WTERMSIG(status) == signal.SIGKILL
    files.sweep_leftovers()  # what the next command of any kind does first
    assert _complete(final) in ("old", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "a leftover was kept"
    _write(final, "next")  # and the next replacement works
    assert _complete(final) == "next" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_next_write_of_the_same_output_settles_a_killed_replacement(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ATTN_CACHE", str(tmp_path / "userfile.txt" / "cache"))  # no registry
    (tmp_path / "userfile.txt").write_text("a file")
    final = tmp_path / "out"
    _write(final, "old")
    assert os.WTERMSIG(_killed_writer(final, "new", kill_at=2)) == signal.SIGKILL
    assert not final.exists()  # between the renames: the output is away
    with files.atomic_directory(final, overwrite=True, kind="checkpoint") as tmp:
        assert _complete(final) == "new"  # put back before anything else happens
        (tmp / "config.json").write_text(json.dumps({"hf_attn": {"run": "third"}}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "userfile.txt"]


def test_leftovers_are_swept_when_the_cache_is_not_writable(tmp_path, monkeypatch):
    (tmp_path / "userfile.txt").write_text("a file")
    monkeypatch.setenv("HF_ATTN_CACHE", str(tmp_path / "userfile.txt" / "cache"))  # cannot be created
    assert os.WTERMSIG(_killed_writer(tmp_path / "out", "x", kill_at=None)) == signal.SIGKILL
    host = socket.gethostname()
    assert sum(host in p.name for p in tmp_path.iterdir()) == 2  # a scratch and a partial output
    files.sweep_leftovers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userfile.txt"]


def test_overwrite_replaces_a_checkpoint_with_the_side_files_it_copied(ws, tmp_path):
    """The files hf-attn wrote are listed with the checkpoint, side files copied from the source included:
    they are replaced, a file the user added is not."""
    src = tmp_path / "src"
    shutil.copytree(ws / "tiny", src)
    (src / "README.md").write_text("the model card\n")
    out = tmp_path / "out"
    for _ in range(2):
        gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=out, write=_overwrite())
    assert (out / "README.md").is_file()
    (out / "runs").mkdir()
    (out / "runs" / "a.txt").write_text("mine")
    with pytest.raises(ValueError, match="runs/a.txt"):
        gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=out, write=_overwrite())
    assert (out / "runs" / "a.txt").read_text() == "mine"


def _overwrite():
    from hf_attn.conversion.specs import WriteSpec

    return WriteSpec(overwrite=True)


# ----------------------------------------------------------------------------------- errors and the cache


def test_a_full_disk_names_the_output(ws, tmp_path, capsys, monkeypatch):
    from hf_attn.conversion.checkpoint.shards import ShardedWriter

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a write to a full disk raises

    monkeypatch.setattr(ShardedWriter, "add", full)
    out = tmp_path / "out"
    capsys.readouterr()
    status = G(["--model", str(ws / "tiny"), "--output", str(out), *MEAN])
    err = capsys.readouterr().err.replace("\r", "\n").strip()
    errors = [line for line in err.splitlines() if "error" in line]  # (after the writer's progress bar)
    assert status == 2 and errors == err.splitlines()[-1:], err
    assert str(out) in err and "No space left on device" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_empty_cache_variable_means_the_default_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ATTN_CACHE", "")
    default = Path.home() / ".cache" / "hf-attn"
    assert files.cache_dir() == default and assets.cache_dir() == default
    files.register(tmp_path / "scratch")
    assert list(tmp_path.iterdir()) == []  # no running/ (nor austen/) in the working directory


# ----------------------------------------------------------------------------------- the study's report


def test_a_study_where_no_variant_succeeds_writes_its_report_and_runs_again(tmp_path, monkeypatch, capsys):
    def failing(variant, **kwargs):
        raise RuntimeError("the conversion ran out of memory")

    monkeypatch.setattr(study, "convert", failing)
    results = tmp_path / "results"
    argv = ["--quick", "--only", "mqa-mean", "--results", str(results), "--fresh"]  # no cached checkpoint
    for _ in range(2):  # the second run replaces what the first wrote
        assert study.main(argv) == 0, capsys.readouterr().err[-3000:]
    assert "mqa-mean FAILED: RuntimeError: the conversion ran out of memory" in capsys.readouterr().out
    assert "FAILED" in (results / "report.md").read_text()
    record = json.loads((results / "results.json").read_text())
    assert record["written_by"] == "hf-attn study" and all("error" in r for r in record["rows"])
    assert (results / "pareto.png").read_bytes().startswith(b"\x89PNG")
