"""Every command against bad input, table-driven: each row runs a command's `main(argv)` in-process on tiny
random checkpoints and asserts exit status 2, exactly one line `hf-attn <command>: error: ...` on stderr that
names the problem, and that nothing in the workspace was written or changed (every file hashed before and
after; the commands' default outputs land in the workspace too: it is the working directory). A few
subprocess cases cover what only a real process shows: Ctrl-C (exit status 130, cleanup done), a bug (exit
status 1 with its traceback), and a killed process's leftovers swept by the next command of any kind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tree_hashes
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import perplexity as bench_perplexity
from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import export, gqa, refine
from hf_attn.conversion.specs import GQASpec
from hf_attn.conversion.training import heal
from hf_attn.eval import cli as hf_attn_cli
from hf_attn.eval import harness, perplexity, study
from hf_attn.eval.bench import decode as bench_decode
from hf_attn.tooling import assets
from hf_attn.tooling.cli import run_command

REPO = Path(__file__).resolve().parents[1]
# 6 query / 3 KV heads of dim 6, hidden 36: `--num-kv-heads 2` divides nothing.
TINY = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=36,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer files (so every command can read text with it)."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(path)
    for f in assets.smollm2_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace every row runs in: checkpoints good and broken, a user's files, texts."""
    root = tmp_path_factory.mktemp("bad-input")
    tiny = make_checkpoint(root / "tiny")
    make_checkpoint(root / "other", seed=1)  # same shapes, other weights
    gqa.convert_gqa(
        GQASpec(num_kv_heads=1, method="mean"), src=tiny, dst=root / "converted"
    )  # carries the conversion record
    for name in ("gpt2cfg", "truncated", "badcfg"):
        shutil.copytree(tiny, root / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (root / "gpt2cfg" / "config.json").write_text(json.dumps(config))
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "badcfg" / "config.json").write_text('{"model_type": ')
    (root / "emptydir").mkdir()
    (root / "userdir" / "sub").mkdir(parents=True)
    (root / "userdir" / "notes.txt").write_text("my notes\n")
    (root / "userdir" / "sub" / "data.csv").write_text("a,b\n")
    (root / "userfile.txt").write_text("mine\n")
    (root / "binary.txt").write_bytes(b"text\x00\x01\x02" + bytes(range(256)) * 8)
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    (root / "empty.txt").write_text("")
    (root / "notes.toml").write_text("[default\nnot toml")
    good = study.DEFAULT_CONFIG.read_text()
    (root / "negative.toml").write_text(good.replace("eval_tokens = 8192", "eval_tokens = -1", 1))
    (root / "nan.toml").write_text(good.replace("heal_minutes = 1.0", "heal_minutes = nan", 1))
    (root / "nokind.toml").write_text(good + '\n[[variants]]\nname = "x"\n')
    return root


# (command main, argv with {ws} for the workspace, what the one line must contain)
G, E, M = convert_cli.gqa_main, convert_cli.expand_main, convert_cli.mla_main
T, C, O = "{ws}/tiny", "{ws}/converted", "{ws}/out"
GQA = ["--model", T, "--output", O, "--num-kv-heads", "1"]
MLA = ["--model", T, "--output", O]
HEAL = [
    "--model",
    C,
    "--output",
    O,
    "--train-text",
    "{ws}/text.txt",
    "--eval-tokens",
    "0",
    "--max-steps",
    "1",
]
REF = ["--model", C, "--output", O, "--no-progress"]
PPL = ["--model", T, "--context-length", "128", "--max-tokens", "256", "--no-progress"]
HAR = ["--model", T, "--limit", "2"]
BP = ["--model", T, "--context-length", "64", "--windows", "1", "--repeats", "1"]
BD = ["--model", T, "--prompt-tokens", "16", "--batch-sizes", "1", "--new-tokens", "2"]
ROWS = [
    # --------------------------------------------------------------------- convert gqa
    (G, ["--model", "{ws}/nope", "--output", O, "--num-kv-heads", "1"], "not a checkpoint directory"),
    (G, ["--model", "{ws}/emptydir", "--output", O, "--num-kv-heads", "1"], "config.json not found"),
    (G, ["--model", "{ws}/badcfg", "--output", O, "--num-kv-heads", "1"], "config.json is not valid JSON"),
    (G, ["--model", "{ws}/truncated", "--output", O, "--num-kv-heads", "1"], "truncated"),
    (G, ["--model", "{ws}/gpt2cfg", "--output", O, "--num-kv-heads", "1"], "model_type 'gpt2'"),
    (G, ["--model", T, "--output", O, "--num-kv-heads", "0"], "--num-kv-heads must be a positive integer"),
    (G, ["--model", T, "--output", O, "--num-kv-heads", "2"], "choose --num-kv-heads from 1, 3"),
    (G, ["--model", T, "--output", O, "--num-kv-heads", "5"], "use `hf-attn convert expand"),
    (G, ["--model", T, "--output", O, "--num-kv-heads", "two"], "invalid int value: 'two'"),
    (G, ["--model", T, "--output", O], "required: --num-kv-heads"),
    (G, ["--model", T, "--output", T, "--num-kv-heads", "1"], "is the source checkpoint"),
    (G, ["--model", T, "--output", T + "/sub", "--num-kv-heads", "1"], "is inside the source checkpoint"),
    (G, ["--model", T, "--output", "{ws}", "--num-kv-heads", "1"], "contains the source checkpoint"),
    (G, ["--model", T, "--output", "{ws}/userdir", "--num-kv-heads", "1", "--overwrite"], "notes.txt, sub/"),
    (G, ["--model", T, "--output", "{ws}/userfile.txt", "--num-kv-heads", "1", "--overwrite"], "a file of"),
    (G, ["--model", T, "--output", C, "--num-kv-heads", "1"], "already exists; pass --overwrite"),
    (G, ["--model", T, "--output", "{ws}/userfile.txt/x", "--num-kv-heads", "1"], "is not writable"),
    (G, [*GQA, "--method", "calibrated", "--calibration-tokens", "0"], "--calibration-tokens must be"),
    (G, [*GQA, "--method", "calibrated", "--calibration-window", "-4"], "--calibration-window must be"),
    (G, [*GQA, "--method", "svd"], "invalid choice: 'svd'"),
    (G, [*GQA, "--calibration-text", "{ws}/binary.txt"], "is not UTF-8 text"),
    (G, [*GQA, "--calibration-text", "{ws}/latin1.txt"], "is not UTF-8 text"),
    (G, [*GQA, "--calibration-text", "{ws}/none.txt"], "does not exist"),
    (G, [*GQA, "--calibration-text", "{ws}/empty.txt"], "is empty"),
    (G, [*GQA, "--calibration-text", "{ws}/userdir"], "not a text file"),
    (G, [*GQA, "--save-dtype", "int8"], "Unknown --save-dtype 'int8'"),
    (G, [*GQA, "--refine-steps", "-1"], "--refine-steps must be"),
    (G, [*GQA, "--refine-steps", "2", "--refine-tokens", "0"], "--refine-tokens must be"),
    (G, [*GQA, "--device", "tpu"], "invalid choice: 'tpu'"),
    # --------------------------------------------------------------------- convert expand
    (E, ["--model", T, "--output", O, "--num-kv-heads", "2"], "use `hf-attn convert gqa --num-kv-heads 2`"),
    (E, ["--model", T, "--output", O, "--num-kv-heads", "4"], "choose one of 3, 6"),
    (E, ["--model", T, "--output", O, "--num-kv-heads", "-6"], "--num-kv-heads must be a positive integer"),
    (E, ["--model", T, "--output", "{ws}/userdir", "--overwrite"], "not a checkpoint hf-attn wrote"),
    (E, ["--model", "{ws}/gpt2cfg", "--output", O], "model_type 'gpt2'"),
    (E, ["--model", "{ws}/truncated", "--output", O], "truncated"),
    (E, ["--model", C, "--output", C + "/../converted", "--overwrite"], "is the source checkpoint"),
    # --------------------------------------------------------------------- convert mla
    (M, [*MLA, "--kv-budget", "inf"], "--kv-budget must be a fraction in (0, 1]"),
    (M, [*MLA, "--kv-budget", "nan"], "--kv-budget must be a fraction in (0, 1]"),
    (M, [*MLA, "--kv-budget=-inf"], "--kv-budget must be a fraction in (0, 1]"),
    (M, [*MLA, "--kv-budget", "0"], "--kv-budget must be a fraction in (0, 1]"),
    (M, [*MLA, "--kv-budget", "2"], "--kv-budget must be a fraction in (0, 1]"),
    (M, [*MLA, "--kv-budget", "1e-9"], "raise --kv-budget to at least 0.1944"),
    (M, [*MLA, "--kv-budget", "half"], "invalid float value: 'half'"),
    (M, [*MLA, "--kv-lora-rank", "0"], "--kv-lora-rank must be in [1, "),
    (M, [*MLA, "--kv-lora-rank", "99", "--rope-pairs", "3"], "--kv-lora-rank must be in [1, 18]"),
    (M, [*MLA, "--kv-lora-rank", "4", "--kv-budget", "0.5"], "not allowed with argument"),
    (M, [*MLA, "--rope-pairs", "-1"], "rope-pairs must be an integer in [0, head_dim / 2 = 3]"),
    (M, [*MLA, "--rope-pairs", "99"], "99"),
    (M, [*MLA, "--calibration-tokens", "10"], "one query in 32 of a window: give at least 33"),
    (M, [*MLA, "--calibration-text", "{ws}/binary.txt"], "is not UTF-8 text"),
    (M, [*MLA[:2], "--output", "{ws}/userdir", "--overwrite"], "not a checkpoint hf-attn wrote"),
    (M, ["--model", "{ws}/gpt2cfg", "--output", O], "model_type 'gpt2'"),
    (M, [*MLA, "--engine-dims", "576"], "--engine-dims sets d_c and r of --layout deepseek"),  # specs
    (M, [*MLA, "--layout", "deepseek", "--allocation", "greedy"], "use --allocation uniform"),
    (M, [*MLA, "--rope-selection", "high", "--allocation", "greedy"], "use both `attention`"),
    (M, [*MLA, "--layout", "deepseek", "--rope-selection", "2norm"], "--rope-selection 2norm picks pairs"),
    (M, [*MLA, "--refine-steps", "-2"], "--refine-steps must be a finite integer >= 0"),
    # --------------------------------------------------------------------- export
    (export.main, ["--to", "deepseek_v3", "--model", T, "--output", O], "convert first"),
    (
        export.main,
        ["--to", "deepseek_v3", "--model", "{ws}/nope", "--output", O],
        "not a checkpoint directory",
    ),
    (export.main, ["--to", "deepseek_v3", "--model", "{ws}/badcfg", "--output", O], "is not valid JSON"),
    (export.main, ["--to", "gguf", "--model", T, "--output", O], "invalid choice: 'gguf'"),
    # --------------------------------------------------------------------- heal
    (heal.main, [*HEAL, "--lr", "nan"], "--lr must be positive"),
    (heal.main, [*HEAL, "--lr", "inf"], "--lr must be positive"),
    (heal.main, [*HEAL, "--seq-len", "0"], "--seq-len must be positive"),
    (heal.main, [*HEAL, "--max-minutes", "-1"], "--max-minutes must be positive"),
    (heal.main, [*HEAL[:4], "--train-text", "{ws}/binary.txt"], "is not UTF-8 text"),
    (heal.main, [*HEAL[:4], "--train-text", "{ws}/none.txt"], "does not exist"),
    (heal.main, [*HEAL, "--eval-text", "{ws}/latin1.txt"], "is not UTF-8 text"),
    (heal.main, ["--model", C, "--output", "{ws}/userdir", "--overwrite", *HEAL[4:]], "notes.txt, sub/"),
    (heal.main, ["--model", C, "--output", C, *HEAL[4:]], "is the source checkpoint"),
    (heal.main, ["--model", "{ws}/gpt2cfg", "--output", O, *HEAL[4:]], "do not match config.json"),
    (heal.main, ["--model", "{ws}/truncated", "--output", O, *HEAL[4:]], "truncated"),
    (heal.main, [*HEAL, "--trainable", "mlp"], "invalid choice: 'mlp'"),
    # --------------------------------------------------------------------- refine
    (refine.main, [*REF, "--steps", "0"], "--steps must be a finite integer >= 1"),
    (refine.main, [*REF, "--steps", "-1"], "--steps must be"),
    (refine.main, [*REF, "--lr", "nan"], "--lr must be a finite number > 0"),
    (refine.main, [*REF, "--relative-lr", "inf"], "--relative-lr must be a finite number > 0"),
    (refine.main, [*REF, "--relative-lr", "0"], "--relative-lr must be"),
    (refine.main, [*REF, "--calibration-tokens", "0"], "--calibration-tokens must be"),
    (refine.main, [*REF, "--calibration-text", "{ws}/binary.txt"], "is not UTF-8 text"),
    (refine.main, [*REF, "--source", "{ws}/other"], "is not the model"),
    (refine.main, ["--model", T, "--output", O], "records no gqa/mla conversion; pass --source"),
    (
        refine.main,
        ["--model", C, "--output", "{ws}/userdir", "--overwrite"],
        "not a checkpoint hf-attn wrote",
    ),
    (refine.main, ["--model", C, "--output", C], "is the source checkpoint"),
    (refine.main, ["--model", C, "--output", T, "--overwrite"], "not a checkpoint hf-attn wrote"),
    (refine.main, ["--model", "{ws}/gpt2cfg", "--output", O, "--source", T], "do not match config.json"),
    (refine.main, [*REF, "--device", "tpu"], "invalid choice: 'tpu'"),
    # --------------------------------------------------------------------- perplexity
    (perplexity.main, [*PPL, "--model", "{ws}/gpt2cfg"], "weights missing from the checkpoint"),
    (perplexity.main, [*PPL, "--model", "{ws}/truncated"], "truncated"),
    (perplexity.main, [*PPL, "--model", "{ws}/badcfg"], "config.json is not valid JSON"),
    (perplexity.main, [*PPL, "--model", "{ws}/nope"], "not a checkpoint directory"),
    (perplexity.main, [*PPL, "--model", "{ws}/emptydir"], "has no config.json"),
    (perplexity.main, [*PPL, "--text", "{ws}/binary.txt"], "is not UTF-8 text"),
    (perplexity.main, [*PPL, "--text", "{ws}/latin1.txt"], "is not UTF-8 text"),
    (perplexity.main, [*PPL, "--text", "{ws}/empty.txt"], "is empty"),
    (perplexity.main, [*PPL, "--text", "{ws}/none.txt"], "does not exist"),
    (perplexity.main, [*PPL, "--text", "{ws}/userdir"], "not a text file"),
    (perplexity.main, [*PPL, "--context-length", "0"], "--context-length must be"),
    (perplexity.main, [*PPL, "--context-length", "1"], "--context-length must be"),
    (perplexity.main, [*PPL, "--context-length", "1e3"], "invalid int value: '1e3'"),
    (perplexity.main, [*PPL, "--context-length", "4096"], "maximum positions (512)"),
    (perplexity.main, [*PPL, "--stride", "0"], "--stride must be"),
    (perplexity.main, [*PPL, "--stride", "999"], "--stride 999 exceeds --context-length 128"),
    (perplexity.main, [*PPL, "--max-tokens", "1"], "--max-tokens must be"),
    (perplexity.main, [*PPL, "--batch-size", "0"], "--batch-size must be"),
    (perplexity.main, [*PPL, "--output", "{ws}/userdir"], "not a JSON record hf-attn wrote"),
    (perplexity.main, [*PPL, "--output", "{ws}/userfile.txt"], "not a JSON record hf-attn wrote"),
    (perplexity.main, [*PPL, "--output", "{ws}/tiny/config.json"], "not a JSON record hf-attn wrote"),
    (perplexity.main, [*PPL, "--load-dtype", "int8"], "invalid choice: 'int8'"),
    (perplexity.main, [*PPL, "--attn-implementation", "magic"], "Unknown attention implementation 'magic'"),
    # --------------------------------------------------------------------- harness
    (harness.main, [*HAR, "--batch-size", "0"], "--batch-size must be"),
    (harness.main, [*HAR, "--limit", "nan"], "--limit must be"),
    (harness.main, [*HAR, "--limit", "-1"], "--limit must be"),
    (harness.main, [*HAR, "--limit", "2.5"], "--limit must be a whole number"),
    (harness.main, [*HAR, "--num-fewshot", "-1"], "--num-fewshot must be"),
    (harness.main, [*HAR, "--output", "{ws}/userdir"], "not a JSON record hf-attn wrote"),
    (harness.main, [*HAR, "--model", "{ws}/gpt2cfg"], "weights missing from the checkpoint"),
    (harness.main, [*HAR, "--model", "{ws}/truncated"], "truncated"),
    (harness.main, [*HAR, "--tasks", "{ws}/none.yaml"], "does not exist"),
    (harness.main, [*HAR, "--include-path", "{ws}/none"], "does not exist"),
    # --------------------------------------------------------------------- study
    (study.main, ["--config", "{ws}/none.toml"], "No such file or directory"),
    (study.main, ["--config", "{ws}/notes.toml"], "is not a TOML file"),
    (study.main, ["--config", "{ws}/negative.toml"], "eval_tokens in [default]"),
    (study.main, ["--config", "{ws}/nan.toml"], "heal_minutes in [default]"),
    (study.main, ["--config", "{ws}/nokind.toml"], "lacks a name or a kind"),
    (study.main, ["--results", "{ws}/userfile.txt"], "not a directory"),
    (study.main, ["--only", "nosuch"], "no such variants"),
    (study.main, ["--profile", "huge"], "invalid choice: 'huge'"),
    # ------------------------------------------------ benchmarks.perplexity / hf-attn bench decode
    (bench_perplexity.main, [*BP, "--windows", "0"], "--windows must be"),
    (bench_perplexity.main, [*BP, "--repeats", "0"], "--repeats must be"),
    (bench_perplexity.main, [*BP, "--context-length", "1"], "--context-length must be"),
    (bench_perplexity.main, [*BP, "--threads", "0"], "--threads must be"),
    (bench_perplexity.main, [*BP, "--output", "{ws}/userdir"], "not a JSON record hf-attn wrote"),
    (bench_perplexity.main, [*BP, "--model", "{ws}/gpt2cfg"], "weights missing from the checkpoint"),
    (bench_perplexity.main, [*BP, "--attn-implementation", "magic"], "Unknown attention implementation"),
    (bench_decode.main, [*BD, "--new-tokens", "0"], "--new-tokens must be"),
    (bench_decode.main, [*BD, "--prompt-tokens", "0"], "--prompt-tokens must be"),
    (bench_decode.main, [*BD, "--batch-sizes", "0"], "--batch-sizes must be"),
    (bench_decode.main, [*BD, "--prefill-chunk", "0"], "--prefill-chunk must be"),
    (bench_decode.main, [*BD, "--prompt-tokens", "100000"], "exceed the model's 512 positions"),
    (bench_decode.main, [*BD, "--output", "{ws}/userdir"], "not a JSON record hf-attn wrote"),
    (bench_decode.main, [*BD, "--model", "{ws}/truncated"], "truncated"),
    (bench_decode.main, [*BD, "--attn-implementation", "magic"], "Unknown attention implementation"),
    # --------------------------------------------------------------------- hf-attn itself
    (hf_attn_cli.main, ["frobnicate"], "unknown command 'frobnicate'"),
    (hf_attn_cli.main, ["convert", "pca"], "unknown command 'convert pca'"),
]
PROGS = {
    G: "hf-attn convert gqa",
    E: "hf-attn convert expand",
    M: "hf-attn convert mla",
    export.main: "hf-attn export",
    heal.main: "hf-attn heal",
    refine.main: "hf-attn refine",
    perplexity.main: "hf-attn perplexity",
    harness.main: "hf-attn harness",
    study.main: "hf-attn study",
    bench_perplexity.main: "python -m benchmarks.perplexity",
    bench_decode.main: "hf-attn bench decode",
    hf_attn_cli.main: "hf-attn",
}


def _status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse
        return exit_.code


@pytest.fixture(scope="module")
def ws_text(ws):
    (ws / "text.txt").write_text(assets.austen_file(assets.EVAL_NOVEL).read_text(encoding="utf-8")[:20000])
    return ws


@pytest.mark.parametrize(
    "main,argv,expected",
    ROWS,
    ids=[f"{PROGS[m].removeprefix('hf-attn ') or 'hf-attn'}:{' '.join(a[-2:])}" for m, a, _ in ROWS],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(ws_text, main, argv, expected, capsys, monkeypatch):
    ws = ws_text
    monkeypatch.chdir(ws)  # default outputs (study's ./results) land in the hashed workspace
    before = tree_hashes(ws)
    capsys.readouterr()
    status = _status(main, [a.format(ws=ws) for a in argv])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{PROGS[main]}: error: ") and expected in err, err
    assert tree_hashes(ws) == before


# ----------------------------------------------------------------------------------- what the guard allows


def test_overwrite_replaces_a_project_output_atomically_and_leaves_nothing(ws, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_cli.expand_main(["--model", str(ws / "tiny"), "--output", str(out)]) == 0
    assert (
        convert_cli.expand_main(
            ["--model", str(ws / "tiny"), "--output", str(out), "--overwrite", "--num-kv-heads", "3"]
        )
        == 0
    )
    assert convert_cli.expand_main(["--model", str(ws / "tiny"), "--output", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.*.tmp, no .out.*.old
    (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose
    assert (
        convert_cli.expand_main(
            ["--model", str(ws / "tiny"), "--output", str(tmp_path / "empty"), "--overwrite"]
        )
        == 0
    )


def test_a_json_record_is_replaced_only_if_hf_attn_wrote_it(ws_text, tmp_path, capsys):
    record = tmp_path / "ppl.json"
    argv = [*[a.format(ws=ws_text) for a in PPL], "--output", str(record)]
    assert perplexity.main(argv) == 0
    first = json.loads(record.read_text())
    assert first["written_by"] == "hf-attn perplexity" and first["tokens_scored"] == 254
    assert perplexity.main(argv) == 0  # its own record: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppl.json"]


# ----------------------------------------------------------------------------------- help, version


def test_benchmarks_write_json_only_where_asked(ws_text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench_perplexity.main([a.format(ws=ws_text) for a in BP]) == 0
    assert "ratio" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_group_help_version_and_every_default_in_help(capsys):
    for group, member in (("convert", "convert gqa"), ("bench", "bench decode")):
        assert hf_attn_cli.main([group, "--help"]) == 0
        assert member in capsys.readouterr().out
    assert hf_attn_cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("hf-attn ")
    for main in (G, E, M, heal.main, refine.main, perplexity.main, harness.main, bench_decode.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        options = [w for w in text.split() if w.startswith("--") and w not in ("--help",)]
        assert options and "(default:" in text, text[:200]
    parser = perplexity.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if (
            action.option_strings
            and action.nargs != 0
            and not action.required
            and action.help != "==SUPPRESS=="
        ):
            assert "default" in formatter._get_help_string(action).lower(), action.option_strings


def test_the_error_line_is_not_glued_to_a_progress_bar(capsys):
    from tqdm.auto import tqdm

    from hf_attn.tooling.errors import UserError

    def work() -> None:
        for i in tqdm(range(10), desc="calibration"):
            if i == 3:
                raise UserError("the third window is bad; use another text")

    assert run_command("hf-attn test", work) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "hf-attn test: error: the third window is bad; use another text", err


# ----------------------------------------------------------------------------------- real processes

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def test_a_bug_is_not_a_user_error():
    """A KeyError deep inside is a bug: run_command lets it through (the console script then shows its
    traceback and exits with status 1), where the old classification by type printed a vague one-liner."""
    with pytest.raises(KeyError):
        run_command("hf-attn test", lambda: {}["missing"])
    with pytest.raises(ValueError, match="NaN"):
        run_command("hf-attn test", lambda: int(float("nan")))


def test_ctrl_c_exits_130_with_one_line_after_cleanup(ws_text, tmp_path):
    """SIGINT during a perplexity run: exit status 130, one line, and the output never appears."""
    out = tmp_path / "ppl.json"
    argv = ["perplexity", "--model", str(ws_text / "tiny"), "--context-length", "64", "--output", str(out)]
    child = subprocess.Popen(
        [sys.executable, "-m", "hf_attn.eval.cli", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=tmp_path,
        # a suite started in the background of a script inherits SIGINT ignored; a terminal's Ctrl-C does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = ""
    while "perplexity" not in seen.split("Loading weights")[-1]:  # the evaluation's progress bar started
        char = child.stderr.read(1)
        assert char, seen[-2000:]
        seen += char
    child.send_signal(signal.SIGINT)
    rest = child.communicate(timeout=120)[1]
    lines = [line for line in rest.replace("\r", "\n").splitlines() if line.strip()]
    assert child.returncode == 130, rest[-2000:]
    assert (
        "Traceback" not in rest
        and lines[-1] == "hf-attn perplexity: interrupted (Ctrl-C); partial outputs were removed"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


KILLED = """
import os, signal, sys
from pathlib import Path
from hf_attn.tooling.files import atomic_directory, scratch_directory, write_text_atomic
where = Path(sys.argv[1])
scratch = scratch_directory("hf-attn-test-scratch-", dir=where / "scratch")
(Path(scratch.name) / "statistics.pt").write_bytes(b"x" * 1000)
with atomic_directory(where / "outputs" / "converted") as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
"""


def test_any_command_sweeps_what_a_killed_one_left_wherever_it_wrote(ws, tmp_path, capsys):
    for sub in ("scratch", "outputs"):
        (tmp_path / sub).mkdir()
    (tmp_path / "outputs" / "mine.txt").write_text("a user's file beside the outputs")
    res = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, env=ENV
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    left = sorted(p.name for p in (tmp_path / "scratch").iterdir()) + sorted(
        p.name for p in (tmp_path / "outputs").iterdir()
    )
    host = socket.gethostname()
    assert len(left) == 3 and all(host in n for n in left if n != "mine.txt"), left
    # another command, another output name, another directory: a bad input is enough to start the sweep
    assert _status(convert_cli.expand_main, ["--model", str(ws / "tiny"), "--output", str(ws / "tiny")]) == 2
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == []
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["mine.txt"]


def test_sweeping_keeps_running_processes_and_untagged_names(tmp_path):
    from hf_attn.tooling import files

    mine = tmp_path / f".out.{socket.gethostname()}-{os.getpid()}-live.tmp"
    mine.mkdir()
    files.register(mine)
    foreign = tmp_path / "results.json"
    foreign.write_text("{}")
    registry = files.cache_dir() / "running" / f"{socket.gethostname()}-999999999"
    registry.write_text(f"{foreign}\n{mine}\n")  # a dead process listing paths that are not its own
    files.sweep_leftovers()
    assert mine.is_dir() and foreign.is_file() and not registry.exists()
