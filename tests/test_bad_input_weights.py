"""A checkpoint's weights against bad input, table-driven like tests/test_bad_input.py: each row runs a
command's `main(argv)` in-process on a tiny random checkpoint damaged one way and asserts exit status 2,
exactly one line `hf-attn <command>: error: ...` naming the problem, and that nothing in the workspace was
written or changed. Around the table: the files a directory holds are read the way transformers reads them
(a stale shard index beside `model.safetensors` changes nothing, checked against transformers' own logits),
old exports' `rotary_emb.inv_freq` buffers are accepted, and no JSON record ever holds a bare NaN."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tree_hashes
from safetensors.torch import load_file, save_file
from test_bad_input import TINY, make_checkpoint
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import perplexity as bench_perplexity
from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import export
from hf_attn.conversion.training import heal
from hf_attn.eval import harness, perplexity
from hf_attn.eval.bench import decode as bench_decode
from hf_attn.tooling import assets
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import write_json

WEIGHTS = "model.safetensors"


def _edit_weights(path: Path, edit) -> None:
    """Rewrite `path`/model.safetensors with `edit(tensors)` applied (it changes the dict in place)."""
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _variant(root: Path, name: str, *, config: dict | None = None, edit=None, base: str = "tiny") -> Path:
    """A copy of root/`base` named `name`, its config.json updated with `config` and its weights with
    `edit`."""
    path = root / name
    shutil.copytree(root / base, path)
    if config:
        _edit_config(path, **config)
    if edit is not None:
        _edit_weights(path, edit)
    return path


def _set(name: str, value: float, at=(0, 0)):
    def edit(tensors):
        tensors[name][at] = value

    return edit


def _stale_index(root: Path) -> Path:
    """root/tiny's model.safetensors beside the shards and index of another model with the same config (an
    earlier sharded save left behind): transformers reads model.safetensors and ignores the index."""
    path = _variant(root, "stale")
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(
        root / "sharded", max_shard_size="2MB"
    )
    for f in (root / "sharded").iterdir():
        if f.name.startswith("model-") or f.name.endswith(".index.json"):
            shutil.copy(f, path / f.name)
    shutil.rmtree(root / "sharded")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _add_inv_freq(tensors) -> None:
    """The per-layer rotary buffers that exports of older transformers versions stored."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, TINY["head_dim"], 2).float() / TINY["head_dim"]))
    for layer in range(TINY["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace every row runs in: one tiny checkpoint and its damaged copies, and a text."""
    root = tmp_path_factory.mktemp("bad-weights")
    make_checkpoint(root / "tiny")
    _variant(root, "nan", edit=_set("model.layers.1.mlp.down_proj.weight", float("nan")))
    _variant(root, "inf", edit=_set("model.embed_tokens.weight", float("-inf"), at=(5, 3)))
    _fresh(root, "oddheads", num_key_value_heads=4)  # 6 query heads
    _fresh(root, "smallvocab", vocab_size=256)  # SmolLM2's tokenizer has 49152 tokens
    _variant(root, "untied", config={"tie_word_embeddings": False})
    _variant(root, "invfreq", edit=_add_inv_freq)
    _stale_index(root)
    mla_argv = ["--model", str(root / "tiny"), "--output", str(root / "mla"), "--layout", "deepseek"]
    assert (
        convert_cli.mla_main([*mla_argv, "--calibration-tokens", "256", "--factorization", "weight-svd"]) == 0
    )
    _variant(root, "mla-nan", base="mla", edit=_set("model.layers.0.mlp.up_proj.weight", float("nan")))
    shutil.rmtree(root / "mla")
    (root / "text.txt").write_text(assets.train_text_files()[0].read_text(encoding="utf-8")[:20000])
    return root


def _fresh(root: Path, name: str, **config) -> Path:
    """A tiny random Llama of TINY updated with `config`, with root/tiny's tokenizer files."""
    path = root / name
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, **config})).save_pretrained(path)
    for f in (root / "tiny").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path


T, O = "{ws}/tiny", "{ws}/{out}"  # {out}: a name of its own per row
PPL = ["--context-length", "128", "--max-tokens", "256", "--no-progress"]
HEAL = ["--output", O, "--train-text", "{ws}/text.txt", "--eval-tokens", "0", "--max-steps", "1"]
BP = ["--context-length", "64", "--windows", "1", "--repeats", "1"]
HAR = ["--limit", "2"]
BD = ["--prompt-tokens", "16", "--batch-sizes", "1", "--new-tokens", "2"]
ODD = "num_attention_heads=6 is not a multiple of num_key_value_heads=4"
SEED = "--seed must be an integer in [0, 4294967295]"
P, H, B, D = perplexity.main, heal.main, bench_perplexity.main, bench_decode.main
E, G, M, X = convert_cli.expand_main, convert_cli.gqa_main, convert_cli.mla_main, export.main
NAN = "model.layers.1.mlp.down_proj.weight holds NaN"
INF = "model.embed_tokens.weight holds -inf"
ROWS = [
    # --------------------------------------------------------------------- non-finite weights
    (P, ["--model", "{ws}/nan", *PPL], NAN),
    (P, ["--model", "{ws}/nan", *PPL, "--output", "{ws}/ppl.json"], NAN),
    (P, ["--model", "{ws}/inf", *PPL], INF),
    (B, ["--model", "{ws}/nan", *BP], NAN),
    (harness.main, ["--model", "{ws}/nan", *HAR], NAN),
    (H, ["--model", "{ws}/nan", *HEAL], NAN),
    (E, ["--model", "{ws}/nan", "--output", O], NAN),
    (G, ["--model", "{ws}/inf", "--output", O, "--num-kv-heads", "1"], INF),
    (M, ["--model", "{ws}/nan", "--output", O, "--calibration-tokens", "256"], NAN),
    (
        M,
        ["--model", "{ws}/inf", "--output", O, "--factorization", "weight-svd", "--allocation", "uniform"],
        INF,
    ),
    (X, ["--model", "{ws}/mla-nan", "--output", O, "--to", "deepseek_v3"], "up_proj.weight holds NaN"),
    # --------------------------------------------------------------------- seeds numpy / torch cannot take
    (H, ["--model", T, *HEAL, "--seed", "-1"], f"{SEED}, got -1"),
    (H, ["--model", T, *HEAL, "--seed", str(2**32)], f"{SEED}, got 4294967296"),
    (harness.main, ["--model", T, *HAR, "--seed", "-1"], f"{SEED}, got -1"),
    (harness.main, ["--model", T, *HAR, "--seed", str(2**32)], f"{SEED}, got 4294967296"),
    # --------------------------------------------------------------------- query heads vs KV heads
    (P, ["--model", "{ws}/oddheads", *PPL], ODD),
    (B, ["--model", "{ws}/oddheads", *BP], ODD),
    (H, ["--model", "{ws}/oddheads", *HEAL], ODD),
    # --------------------------------------------------------------------- a tokenizer beyond the embedding
    (P, ["--model", "{ws}/smallvocab", *PPL], "the model's embedding holds 256"),
    (B, ["--model", "{ws}/smallvocab", *BP], "the model's embedding holds 256"),
    (H, ["--model", "{ws}/smallvocab", *HEAL], "the model's embedding holds 256"),
    (M, ["--model", "{ws}/smallvocab", "--output", O, "--calibration-tokens", "256"], "embedding holds 256"),
    (harness.main, ["--model", "{ws}/smallvocab", *HAR], "the model's embedding holds 256"),
    (D, ["--model", "{ws}/smallvocab", *BD], "the model's embedding holds 256"),
    # --------------------------------------------------------------------- untied embeddings, no lm_head
    (E, ["--model", "{ws}/untied", "--output", O], "lm_head.weight"),
    (G, ["--model", "{ws}/untied", "--output", O, "--num-kv-heads", "1"], "lm_head.weight"),
    (M, ["--model", "{ws}/untied", "--output", O, "--calibration-tokens", "256"], "lm_head.weight"),
    (P, ["--model", "{ws}/untied", *PPL], "tie_word_embeddings"),
]
PROGS = {
    P: "hf-attn perplexity",
    H: "hf-attn heal",
    B: "python -m benchmarks.perplexity",
    D: "hf-attn bench decode",
    harness.main: "hf-attn harness",
    E: "hf-attn convert expand",
    G: "hf-attn convert gqa",
    M: "hf-attn convert mla",
    X: "hf-attn export",
}


def _status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse
        return exit_.code


@pytest.mark.parametrize(
    "main,argv,expected",
    ROWS,
    ids=[f"{PROGS[m][8:]}:{a[1].removeprefix('{ws}/')}:{' '.join(a[-2:])}" for m, a, _ in ROWS],
)
def test_bad_weights_are_one_line_exit_2_and_write_nothing(ws, main, argv, expected, capsys, monkeypatch):
    monkeypatch.chdir(ws)  # default outputs land in the hashed workspace
    before = tree_hashes(ws)
    capsys.readouterr()
    out = f"out-{ROWS.index((main, argv, expected))}"
    status = _status(main, [a.format(ws=ws, out=out) for a in argv])
    err = capsys.readouterr().err.strip()
    assert status == 2, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(f"{PROGS[main]}: error: ") and expected in err, err
    assert tree_hashes(ws) == before


# ----------------------------------------------------------------------------------- what is accepted


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_stale_shard_index_is_ignored_as_transformers_ignores_it(ws, tmp_path, capsys):
    """model.safetensors beside an index of other shards: transformers loads model.safetensors, and so do
    the converters, so the exact expansion reproduces transformers' logits of the source bit for bit."""
    out = tmp_path / "mha"
    assert convert_cli.expand_main(["--model", str(ws / "stale"), "--output", str(out)]) == 0, (
        capsys.readouterr().err
    )
    assert not (out / "model.safetensors.index.json").exists()
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    source, expanded = _logits(ws / "stale", ids), _logits(out, ids)
    assert torch.equal(source, expanded)
    assert torch.equal(source, _logits(ws / "tiny", ids))  # the index's shards played no part


def test_a_config_naming_its_weights_file_is_read_as_transformers_reads_it(ws, tmp_path, capsys):
    """config.json's `transformers_weights` names the file transformers loads, whatever else is there."""
    src = tmp_path / "named"
    shutil.copytree(ws / "stale", src)
    (src / WEIGHTS).rename(src / "chosen.safetensors")
    shutil.copy(ws / "nan" / WEIGHTS, src / WEIGHTS)  # present, but not the file the config names
    _edit_config(src, transformers_weights="chosen.safetensors")
    out = tmp_path / "mha"
    assert convert_cli.expand_main(["--model", str(src), "--output", str(out)]) == 0, capsys.readouterr().err
    assert "transformers_weights" not in json.loads((out / "config.json").read_text())
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(src, ids), _logits(out, ids))


def test_old_rotary_buffers_are_accepted_and_dropped_like_transformers_does(ws, tmp_path, capsys):
    src = ws / "invfreq"
    argv = ["--model", str(src), *PPL]
    assert perplexity.main(argv) == 0, capsys.readouterr().err
    out = tmp_path / "mha"
    assert convert_cli.expand_main(["--model", str(src), "--output", str(out)]) == 0, capsys.readouterr().err
    assert not any("inv_freq" in k for k in load_file(out / WEIGHTS))
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(src, ids), _logits(out, ids))


# ----------------------------------------------------------------------------------- non-finite numbers


def test_no_json_record_holds_a_bare_nan(tmp_path):
    out = tmp_path / "ppl.json"
    with pytest.raises(ValueError):
        write_json(out, {"perplexity": float("nan")}, prog=perplexity.PROG)
    assert list(tmp_path.iterdir()) == []


def test_a_non_finite_perplexity_is_an_error_not_a_number(ws, tmp_path, capsys):
    """Finite weights whose logits overflow: the perplexity is not a number, so no number is reported (known
    only once evaluated: the line saying where it ran comes before the error line)."""
    src = tmp_path / "huge"
    shutil.copytree(ws / "tiny", src)
    _edit_weights(src, lambda t: t["model.norm.weight"].fill_(3e38))
    out = tmp_path / "ppl.json"
    status = perplexity.main(["--model", str(src), *PPL, "--output", str(out)])
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert status == 2 and "Traceback" not in captured.err, captured.err[-3000:]
    assert last.startswith("hf-attn perplexity: error: the perplexity is not finite"), last
    assert "perplexity" not in captured.out and not out.exists()


def test_check_finite_names_the_first_offending_tensor():
    from hf_attn.tooling.weights import check_finite

    good = torch.zeros(3)
    check_finite([("a", good), ("ids", torch.arange(3))], where="m")
    with pytest.raises(UserError, match=r"m: b holds NaN \(1 of 4 values not finite\)"):
        check_finite(
            [("a", good), ("b", torch.tensor([0, math.nan, 1, 2])), ("c", torch.tensor([math.inf]))],
            where="m",
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("value,kind", [(math.nan, "NaN"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_one_non_finite_value_is_found_wherever_it_is(dtype, value, kind, monkeypatch):
    """One NaN or infinity at the first, a middle or the last position of a tensor checked in several
    chunks is counted once, with its kind: checked against the value planted there."""
    from hf_attn.tooling import weights

    monkeypatch.setattr(weights, "_CHECK_CHUNK", 64)
    n = 64 * 3 + 5  # four chunks, the last one short
    for position in (0, 100, n - 1):
        tensor = torch.linspace(-3, 3, n).to(dtype)
        tensor[position] = value
        assert weights._non_finite(tensor) == (1, kind)
    assert weights._non_finite(torch.linspace(-3, 3, n).to(dtype)) is None
