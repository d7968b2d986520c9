"""The typed conversion specs (conversion.specs) and the one pipeline (conversion.pipeline): the commands'
parsers carry the specs' defaults field by field, `hf-attn convert gqa` without options writes exactly what
the library pipeline with default specs writes, a KV budget's numbers against hand-computed values, and spec
errors told as one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from conftest import exit_status
from test_refine import tiny_llama

from hf_attn.conversion import cli, pipeline
from hf_attn.conversion.checkpoint.io import read_tensor, tensor_index
from hf_attn.conversion.gqa import convert as gqa
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.mla import convert as mla
from hf_attn.conversion.specs import (
    METHODS,
    CalibrationSpec,
    ExpandSpec,
    GQASpec,
    KVBudget,
    MLASpec,
    RefineSpec,
    WriteSpec,
    spec_from_args,
)
from hf_attn.tooling.errors import UserError

COMMANDS = [(gqa, GQASpec, ["--num-kv-heads", "1"]), (mla, MLASpec, []), (expand, ExpandSpec, [])]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("module,spec,required", COMMANDS, ids=["gqa", "mla", "expand"])
def test_every_flag_default_is_the_spec_default(module, spec, required):
    parser = cli.build_parser(module.PROG, module.__doc__, spec)
    stages = {"spec": spec, **cli.STAGES} if spec is not ExpandSpec else {"spec": spec, "write": WriteSpec}
    for prefix, cls in stages.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            shown = [
                a for a in parser._actions if a.dest == f"{prefix}.{f.name}" and a.help != argparse.SUPPRESS
            ]
            assert len(shown) == 1, f"{cls.__name__}.{f.name} has no flag"
            if not f.metadata.get("required"):
                assert shown[0].default == _default(f), (cls.__name__, f.name)
    args = parser.parse_args(["--output", "o", *required])
    built = spec_from_args(spec, args, prefix="spec")
    assert built == (GQASpec(num_kv_heads=1) if spec is GQASpec else spec())
    if spec is not ExpandSpec:
        assert spec_from_args(CalibrationSpec, args, prefix="calibration") == CalibrationSpec()
        assert spec_from_args(RefineSpec, args, prefix="refine") == RefineSpec()


def test_the_old_dtype_flag_still_sets_the_save_dtype(capsys):
    parser = cli.build_parser(gqa.PROG, gqa.__doc__, GQASpec)
    args = parser.parse_args(["--output", "o", "--num-kv-heads", "1", "--dtype", "bfloat16"])
    assert spec_from_args(WriteSpec, args, prefix="write") == WriteSpec(save_dtype="bfloat16")
    assert "--dtype is deprecated; use --save-dtype" in capsys.readouterr().err


def test_the_defaults_are_the_measured_best_recipe():
    """calibrated pooling, 32 refinement steps, one calibration default of 8,192 tokens, MLA at half the cache
    (docs/results/conversions.md measures them); the GQA paper's mean pooling is one option away."""
    assert GQASpec(num_kv_heads=1).method == "calibrated" and "mean" in METHODS
    assert RefineSpec().steps == 32 and RefineSpec().tokens == 4096
    assert CalibrationSpec().tokens == 8192 and CalibrationSpec().text is None
    assert MLASpec().budget == KVBudget(0.5) and MLASpec(kv_lora_rank=8).budget is None
    assert MLASpec(rope_pairs=3).budget is None  # a rank option alone: no budget (all pairs: exact)


def test_kv_budget_numbers_by_hand():
    # SmolLM2: 3 KV heads of width 64 -> the source caches 2 * 3 * 64 = 384 numbers per token and layer
    assert KVBudget.source_numbers(3 * 64) == 384
    assert KVBudget(0.5).numbers(3 * 64) == 192
    assert KVBudget(0.3).numbers(3 * 64) == 115  # 115.2 rounded down
    assert KVBudget(1).numbers(3 * 64) == 384
    assert 0.57 * 100 < 57 and KVBudget(0.57).numbers(50) == 57  # binary rounding does not lose a number
    for bad in (0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(UserError, match=r"--kv-budget must be a fraction in \(0, 1\]"):
            KVBudget(bad)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: GQASpec(num_kv_heads=0), "--num-kv-heads must be a positive integer, got 0"),
        (lambda: GQASpec(num_kv_heads=1, method="svd"), "Unknown --method 'svd'; choose one of"),
        (lambda: GQASpec(num_kv_heads=1, grouping="random"), "Unknown --grouping 'random'"),
        (lambda: ExpandSpec(num_kv_heads=-2), "--num-kv-heads must be a positive integer"),
        (lambda: MLASpec(kv_budget=0.5, kv_lora_rank=8), "either --kv-lora-rank or --kv-budget"),
        (lambda: MLASpec(engine_dims="576"), "--engine-dims sets d_c and r of --layout deepseek"),
        (lambda: MLASpec(layout="deepseek", rope_selection="2norm"), "--rope-selection 2norm picks pairs"),
        (lambda: MLASpec(layout="deepseek", kv_budget=0.5, allocation="greedy"), "use --allocation uniform"),
        (lambda: MLASpec(rope_selection="high", allocation="greedy"), "use both `attention`"),
        (lambda: MLASpec(layout="interleaved"), "Unknown --layout 'interleaved'"),
        (lambda: CalibrationSpec(tokens=0), "--calibration-tokens must be a finite integer >= 1"),
        (lambda: CalibrationSpec(window=2.5), "--calibration-window must be a finite integer"),
        (lambda: CalibrationSpec(corpus="shakespeare"), "Unknown --calibration-corpus 'shakespeare'"),
        (lambda: CalibrationSpec(text=["/nonexistent.txt"]), "does not exist"),
        (lambda: CalibrationSpec(forward_dtype="float16"), "Unknown --forward-dtype 'float16'"),
        (lambda: RefineSpec(steps=-1), "--refine-steps must be a finite integer >= 0"),
        (lambda: RefineSpec(tokens=0), "--refine-tokens must be a finite integer >= 1"),
        (lambda: WriteSpec(save_dtype="int8"), "Unknown --save-dtype 'int8'"),
    ],
)
def test_spec_errors_name_the_flag(build, match):
    with pytest.raises(UserError, match=match) as err:
        build()
    assert "\n" not in str(err.value)


def test_spec_errors_in_the_library_pipeline_write_nothing(tmp_path):
    with pytest.raises(UserError, match="unknown export"):
        pipeline.convert(GQASpec(num_kv_heads=1), src=None, dst=tmp_path / "out", export="gguf")
    with pytest.raises(UserError, match=r"unknown gqa options \['kv_budget'\]"):
        pipeline.specs_from_options("gqa", {"num_kv_heads": 1, "kv_budget": 0.5})
    assert list(tmp_path.iterdir()) == []


def _tensors(path) -> dict[str, torch.Tensor]:
    return {name: read_tensor(info) for name, info in tensor_index(path).items()}


def test_command_is_the_library_pipeline_with_default_specs(tmp_path, smollm2_path):
    """`hf-attn convert gqa --num-kv-heads 1` and `pipeline.convert(GQASpec(num_kv_heads=1))` on a tiny
    Llama with SmolLM2's tokenizer: the same tensors bit for bit, both calibrated pooling refined for 32
    steps. Only the text sizes are given (128 tokens each, to keep the test short); that the command's
    defaults of every flag are the specs' is `test_every_flag_default_is_the_spec_default`."""
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tiny_llama(3, vocab_size=len(tokenizer)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    command, library = tmp_path / "command", tmp_path / "library"
    sizes = ["--calibration-tokens", "128", "--refine-tokens", "128"]
    argv = ["--model", str(src), "--output", str(command), "--num-kv-heads", "1", *sizes]
    assert exit_status(cli.gqa_main, argv) == 0
    converted = pipeline.convert(
        GQASpec(num_kv_heads=1),
        src=src,
        dst=library,
        calibration=CalibrationSpec(tokens=128),
        refine=RefineSpec(tokens=128),
    )
    assert converted.path == library.resolve() and converted.refined["settings"]["steps"] == 32
    a, b = _tensors(command), _tensors(library)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    history = json.loads((command / "config.json").read_text())["hf_attn"]["history"]
    assert [r["kind"] for r in history] == ["gqa", "refine"]
    assert history[0]["settings"]["method"] == "calibrated" and history[0]["calibration"]["tokens"] == 128
    assert history[1]["settings"]["steps"] == 32 and history[1]["source"] == pipeline.CLOSED_FORM_SOURCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["command", "library", "src"]  # no scratch
