"""The benchmarks, `hf-attn engine-check` and `hf-attn assets` against bad input, as tests/test_bad_input.py
does for the main commands: each row runs a command's `main(argv)` in-process and asserts exit status 2,
exactly one line `<prog>: error: ...` on stderr that names the value, and that nothing in the workspace was
written or changed. Every option is checked before any model is loaded or any measurement starts, so no row
loads a model. `hf-attn assets` is driven offline: its package downloader is pointed at a stand-in that fails
as `apt-get` does without a network (or hands over a damaged package), and the cache must hold nothing
afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tree_hashes
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import (
    attention,
    gpu,
    heal,
    mla_decode,
    mla_kernel,
    mla_kernel_registers,
    scale,
    stream,
)
from benchmarks.engine import bench as engine_bench
from hf_attn.eval import cli as hf_attn_cli
from hf_attn.eval.engine import check as engine_check
from hf_attn.tooling import assets

# 6 query / 3 KV heads of dim 6: head_dim / 2 = 3 RoPE pairs
TINY = dict(vocab_size=64, hidden_size=36, intermediate_size=32, num_hidden_layers=1, num_attention_heads=6,
            num_key_value_heads=3, head_dim=6, max_position_embeddings=256)  # fmt: skip


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace: a tiny checkpoint, broken copies of it, a user's file and directory."""
    root = tmp_path_factory.mktemp("bad-input-bench")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(root / "tiny")
    for name in ("truncated", "gpt2cfg", "badcfg"):
        shutil.copytree(root / "tiny", root / name)
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = json.loads((root / "tiny" / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (root / "gpt2cfg" / "config.json").write_text(json.dumps(config))
    (root / "badcfg" / "config.json").write_text('{"model_type": ')
    (root / "userdir").mkdir()
    (root / "userdir" / "notes.txt").write_text("my notes\n")
    (root / "userfile.txt").write_text("mine\n")
    (root / "usernotes.md").write_text("# mine\n")
    return root


T = "{ws}/tiny"
A, MD, H, K = attention.main, mla_decode.main, heal.main, mla_kernel.main
R, EC, GPU, ST, SC = mla_kernel_registers.main, engine_check.main, gpu.main, stream.main, scale.main
SRC = ["--source", T]
PART = "attention"  # a part of `python -m benchmarks.gpu`
NO_CUDA = [] if torch.cuda.is_available() else [(MD, [*SRC, "--device", "cuda"], "torch sees no CUDA device")]
ROWS = [
    # ------------------------------------------------------------------- benchmarks.attention
    (A, ["--threads", "0"], "--threads must be a finite integer >= 1, got 0"),
    (A, ["--repeats", "0"], "--repeats must be a finite integer >= 1, got 0"),
    (A, ["--batch", "-2"], "--batch must be a finite integer >= 1, got -2"),
    (A, ["--group-sizes", "3", "0"], "--group-sizes must be a finite integer >= 1, got 0"),
    (
        A,
        ["--query-lengths", "2048", "--kv-lengths", "1024"],
        "--query-lengths 2048 exceeds --kv-lengths 1024",
    ),
    (A, ["--dtype", "int8"], "Unknown --dtype 'int8'"),
    (A, ["--head-dim", "wide"], "invalid int value: 'wide'"),
    (A, ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (A, ["--output", "{ws}/userfile.txt"], "not a JSON record hf-attn wrote"),
    (A, ["--output", "{ws}/userfile.txt/x.json"], "is not writable"),
    # ------------------------------------------------------------------- benchmarks.stream
    (ST, ["--model", T, "--num-kv-heads", "0"], "--num-kv-heads must be a finite integer >= 1, got 0"),
    (ST, ["--model", T, "--shard-mb", "0"], "--shard-mb must be a finite integer >= 1, got 0"),
    (ST, ["--model", T, "--output", "{ws}/userfile.txt"], "not a JSON record hf-attn wrote"),
    (ST, ["--shard-mb", "big"], "invalid int value: 'big'"),
    # ------------------------------------------------------------------- benchmarks.scale
    (SC, ["--calibration-tokens", "0"], "--calibration-tokens must be a finite integer >= 1, got 0"),
    (SC, ["--rss-limit-gb", "nan"], "--rss-limit-gb must be a finite number >= 0"),
    (SC, ["--output", "{ws}/usernotes"], "usernotes.md exists without the record"),
    (SC, ["--shapes", "gpt-9"], "invalid choice: 'gpt-9'"),
    # ------------------------------------------------------------------- benchmarks.engine
    (engine_bench.main, ["--layers", "0"], "--layers must be a finite integer >= 1, got 0"),
    (engine_bench.main, ["--cpu-threads", "0"], "--cpu-threads must be a finite integer >= 1, got 0"),
    # ------------------------------------------------------------------- benchmarks.mla_decode
    (MD, [*SRC, "--threads", "0"], "--threads must be a finite integer >= 1, got 0"),
    (MD, [*SRC, "--contexts", "1024", "0"], "--contexts must be a finite integer >= 1, got 0"),
    (MD, [*SRC, "--new-tokens", "0"], "--new-tokens must be a finite integer >= 1, got 0"),
    (MD, [*SRC, "--warmup", "-1"], "--warmup must be a finite integer >= 0, got -1"),
    (MD, [*SRC, "--prefill-threads", "0"], "--prefill-threads must be a finite integer >= 1, got 0"),
    (MD, [*SRC, "--device", "tpu"], "Unknown --device 'tpu'; choose one of auto, cpu, cuda"),
    *NO_CUDA,
    (MD, [*SRC, "--rope-pairs", "4"], "--rope-pairs must be an integer in [0, 3] (head_dim / 2), got 4"),
    (MD, [*SRC, "--kv-lora-rank", "0"], "--kv-lora-rank must be a finite integer >= 1, got 0"),
    (MD, ["--source", "{ws}/truncated"], "truncated"),
    (MD, ["--source", "{ws}/badcfg"], "config.json is not valid JSON"),
    (
        MD,
        ["--source", "{ws}/gpt2cfg", "--random-weights"],
        "--source must be a Llama / Mistral / Qwen2 model",
    ),
    (MD, ["--source", "{ws}/nope"], "is not a checkpoint directory"),
    (MD, [*SRC, "--model", T], "is not a llama_mla checkpoint; convert it with `hf-attn convert mla`"),
    (MD, [*SRC, "--output", "{ws}/userdir"], "not a JSON record hf-attn wrote"),
    (MD, [*SRC, "--contexts", "1k"], "invalid int value: '1k'"),
    # ------------------------------------------------------------------- benchmarks.heal
    (H, ["throughput", "--model", T, "--steps", "2"], "--steps must be a finite integer >= 3, got 2"),
    (H, ["throughput", "--model", T, "--rounds", "0"], "--rounds must be a finite integer >= 1, got 0"),
    (H, ["throughput", "--model", T, "--seq-len", "1"], "--seq-len must be a finite integer >= 2, got 1"),
    (H, ["throughput", "--model", T, "--batch-size", "0"], "--batch-size must be a finite integer >= 1"),
    (H, ["throughput", "--model", "{ws}/truncated"], "truncated"),
    (H, ["throughput", "--model", "{ws}/gpt2cfg"], "do not match config.json"),
    (H, ["throughput", "--model", T, "--results", "{ws}/userfile.txt"], "not a JSON record hf-attn wrote"),
    (H, ["curve", "--model", T, "--minutes", "5", "nan"], "--minutes must be a finite number > 0, got nan"),
    (H, ["curve", "--model", T, "--minutes", "-1"], "--minutes must be a finite number > 0, got -1.0"),
    (H, ["curve", "--model", T, "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (H, ["curve", "--model", T, "--cpu-seconds-per-step", "0"], "--cpu-seconds-per-step must be a finite"),
    (H, ["curve", "--model", T, "--eval-tokens", "100"], "--eval-tokens must be a finite integer >= 1024"),
    (H, ["curve", "--model", T, "--warmup-steps", "-1"], "--warmup-steps must be a finite integer >= 0"),
    (H, ["curve", "--model", T, "--name", "../elsewhere"], "--name '../elsewhere' is not a plain directory"),
    (H, ["curve", "--model", T, "--clock", "moon"], "invalid choice: 'moon'"),
    (H, ["curve", "--model", T, "--trainable", "mlp"], "invalid choice: 'mlp'"),
    (H, ["curve"], "the following arguments are required: --model"),
    (H, ["sprint"], "invalid choice: 'sprint'"),
    # ------------------------------------------------------------------- benchmarks.mla_kernel
    (K, ["--batch", "0"], "--batch must be a finite integer >= 1, got 0"),
    (K, ["--context", "1024", "-8"], "--context must be a finite integer >= 1, got -8"),
    (K, ["--repeats", "0"], "--repeats must be a finite integer >= 1, got 0"),
    (K, ["--warmup", "-1"], "--warmup must be a finite integer >= 0, got -1"),
    (K, ["--rope-pairs", "33"], "--rope-pairs must be in [0, 32]"),
    (K, ["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (K, ["--output", "{ws}/userfile.txt"], "already exists; pass --overwrite"),
    (K, ["--output", "{ws}/userfile.txt", "--overwrite"], "not a directory"),
    (K, ["--output", "{ws}/userdir", "--overwrite"], "holds files this command did not write (notes.txt)"),
    # ------------------------------------------------------------------- benchmarks.mla_kernel_registers
    (R, ["--arch", "60"], "--arch must be a finite integer >= 70, got 60"),
    (R, ["--block-n", "24"], "--block-n must be a power of two >= 16, got 24"),
    (R, ["--block-n", "8"], "--block-n must be a power of two >= 16, got 8"),
    (R, ["--num-warps", "3"], "--num-warps must be a power of two >= 1, got 3"),
    (R, ["--dtype", "fp8"], "invalid choice: 'fp8'"),
    # ------------------------------------------------------------------------ engine-check
    (EC, ["--model", T, "--new-tokens", "1"], "--new-tokens must be a finite integer >= 2, got 1"),
    (EC, ["--model", T, "--json", "{ws}/userfile.txt"], "not a JSON record hf-attn wrote"),
    (EC, ["--model", T], "model_type 'llama', not deepseek_v3"),
    (EC, ["--model", "{ws}/badcfg"], "config.json is not valid JSON"),
    (EC, ["--model", "{ws}/nope"], "has no config.json"),
    (EC, ["--model", T, "--rotary-workaround", "maybe"], "invalid choice: 'maybe'"),
    (EC, [], "the following arguments are required: --model"),
    # ------------------------------------------------------------------- benchmarks.gpu
    (GPU, ["--budget-s", "nan"], "--budget-s must be a finite number of seconds > 0, got nan"),
    (GPU, ["--budget-s", "0"], "--budget-s must be a finite number of seconds > 0"),
    (GPU, ["--limit", f"{PART}=inf"], f"--limit '{PART}=inf': expected PART=SECONDS (finite, > 0)"),
    (GPU, ["--set", "nosuch"], "expected PART.KEY=JSON"),
    (GPU, ["--parts", "nosuch"], "invalid choice: 'nosuch'"),
    (GPU, ["--output", "{ws}/userfile.txt"], "is a file, not a directory"),
    (GPU, ["--output", "{ws}/userdir"], "holds files this command did not write"),
    (GPU, ["--merge", "{ws}/userfile.txt", "--output", "{ws}/new"], "is not a results.json"),
    # ------------------------------------------------------------------------ assets, and through hf-attn
    (assets.main, ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (hf_attn_cli.main, ["bench", "decode", "--model", T, "--new-tokens", "0"], "--new-tokens must be"),
    (hf_attn_cli.main, ["engine-check", "--model", T, "--new-tokens", "1"], "--new-tokens must be"),
]
PROGS = {
    A: "python -m benchmarks.attention",
    MD: "python -m benchmarks.mla_decode",
    H: "python -m benchmarks.heal",
    K: "python -m benchmarks.mla_kernel",
    R: "python -m benchmarks.mla_kernel_registers",
    EC: "hf-attn engine-check",
    GPU: "python -m benchmarks.gpu",
    ST: "python -m benchmarks.stream",
    SC: "python -m benchmarks.scale",
    engine_bench.main: "python -m benchmarks.engine",
    assets.main: "hf-attn assets",
    hf_attn_cli.main: "hf-attn ",
}


def _status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse
        return exit_.code


def _one_line_error(capsys, main, argv) -> str:
    """Run `main(argv)`; assert exit status 2 and one stderr line; return that line."""
    capsys.readouterr()
    status = _status(main, argv)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "main,argv,expected",
    ROWS,
    ids=[f"{PROGS[m].removeprefix('hf-attn ') or 'hf-attn'}:{' '.join(a[-2:])}" for m, a, _ in ROWS],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(ws, main, argv, expected, capsys, monkeypatch):
    monkeypatch.chdir(ws)
    before = tree_hashes(ws)
    err = _one_line_error(capsys, main, [a.format(ws=ws) for a in argv])
    assert err.startswith(PROGS[main]) and ": error: " in err and expected in err, err
    assert tree_hashes(ws) == before


# ----------------------------------------------------------------------------------- hf-attn assets offline

OFFLINE_APT = """#!/bin/sh
echo "E: Failed to fetch http://deb.debian.org/debian/pool/main/r/$2/$2_all.deb  Temporary failure resolving \
'deb.debian.org'" >&2
exit 100
"""
DAMAGED_APT = """#!/bin/sh
[ "$1" = download ] && printf 'not a Debian package' > "$2_1.0_all.deb"
exit 0
"""


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """HF_ATTN_CACHE pointed at a new directory that already holds the model (a link to the real one), so
    `hf-attn assets` goes on to fetch the text."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / assets.SMOLLM2_DIRNAME).symlink_to(assets.smollm2_dir())
    monkeypatch.setenv("HF_ATTN_CACHE", str(cache))
    return cache


def _downloader(tmp_path: Path, monkeypatch, script: str) -> None:
    path = tmp_path / "apt-get"
    path.write_text(script)
    path.chmod(0o755)
    monkeypatch.setattr(assets, "APT_GET", str(path))


def _cache_entries(cache: Path) -> list[str]:
    """What the cache holds besides the model link and the registry of running processes."""
    return sorted(
        str(p.relative_to(cache)) for p in cache.rglob("*") if p.parts[len(cache.parts)] not in ("running",)
    )


def test_assets_without_network_is_one_line_naming_the_package_and_leaves_nothing(
    empty_cache, tmp_path, monkeypatch, capsys
):
    _downloader(tmp_path, monkeypatch, OFFLINE_APT)
    err = _one_line_error(capsys, assets.main, [])
    assert err.startswith("hf-attn assets: error: ") and "r-cran-janeaustenr" in err, err
    assert "deb.debian.org" in err and "check the network" in err and "HF_ATTN_CACHE" in err, err
    assert _cache_entries(empty_cache) == [assets.SMOLLM2_DIRNAME]  # no austen/, no half-written sibling


def test_assets_with_a_damaged_download_is_one_line_and_leaves_nothing(
    empty_cache, tmp_path, monkeypatch, capsys
):
    if shutil.which("dpkg") is None:
        pytest.skip("dpkg is what finds the package damaged")
    _downloader(tmp_path, monkeypatch, DAMAGED_APT)
    err = _one_line_error(capsys, assets.main, [])
    assert "the downloaded r-cran-janeaustenr_1.0_all.deb is damaged" in err and "HF_ATTN_CACHE" in err, err
    assert _cache_entries(empty_cache) == [assets.SMOLLM2_DIRNAME]


def test_assets_without_apt_get_is_one_line(empty_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(assets, "APT_GET", str(tmp_path / "no-such-apt-get"))
    err = _one_line_error(capsys, assets.main, [])
    assert "cannot fetch the Debian package r-cran-janeaustenr" in err and "not found" in err, err
    assert _cache_entries(empty_cache) == [assets.SMOLLM2_DIRNAME]


def test_assets_with_a_damaged_cached_file_is_one_line_and_deletes_nothing(empty_cache, capsys):
    austen = empty_cache / "austen"
    austen.mkdir()
    (austen / "emma.txt").write_text("Emma Woodhouse, handsome, clever, and rich\n")
    (austen / "SHA256SUMS").write_text(f"{'0' * 64}  emma.txt\n")
    before = tree_hashes(empty_cache / "austen")
    err = _one_line_error(capsys, assets.main, [])
    assert "emma.txt is missing or damaged (checksum mismatch)" in err and f"delete {austen}" in err, err
    assert tree_hashes(austen) == before


def test_no_bench_command_builds_a_plain_argparse_parser():
    """Every command's parser is the project's (one-line usage errors); `benchmarks.gpu` keeps its own copy of
    that rule because it runs before `hf_attn` is importable on a bare GPU machine."""
    root = Path(__file__).resolve().parents[1]
    plain = [
        str(path.relative_to(root))
        for folder in ("hf_attn", "conversion", "eval")
        for path in sorted((root / folder).rglob("*.py"))
        if "argparse.ArgumentParser(" in path.read_text(encoding="utf-8")
    ]
    assert plain == [], plain


def test_mla_kernel_output_is_replaced_only_when_this_command_wrote_it(tmp_path):
    """The guard lets `--overwrite` replace a directory `benchmarks.mla_kernel` wrote, nothing else."""
    out = tmp_path / "kernel"
    mla_kernel.write_outputs({"copy_gbps": 1.0, "rows": []}, str(out), overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(mla_kernel.OUTPUT_FILES)
    assert mla_kernel.check_output_dir(str(out), overwrite=True) == out
    (out / "results.json").write_text("{}")  # no longer this command's record
    with pytest.raises(ValueError, match="not a JSON record hf-attn wrote"):
        mla_kernel.check_output_dir(str(out), overwrite=True)
