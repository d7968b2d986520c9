"""`hf-attn engine-check`: exports served by vLLM (its own environment, `make engine`) against vanilla
transformers and the llama_mla checkpoints they were exported from.

One vLLM launch serves the whole module (a module-scoped fixture): SmolLM2 converted to MLA at half its
cache in the DeepSeek layout and exported at 576 (what vLLM's CPU backend takes), a tiny random export, and
a copy of the tiny export with two RoPE rows of its keys swapped, which vLLM and transformers read alike but
which is no longer the source: the check must fail it. Skipped, with the reason, where the engine
environment could not be built.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import exit_status

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import export, mla
from hf_attn.conversion.specs import CalibrationSpec, MLASpec
from hf_attn.eval.engine import check
from hf_attn.eval.engine import environment as env

LENGTHS = (12, 37, 70, 131)  # tokens: partial and several 16-token cache blocks, four sequences at once
NEW_TOKENS = 8


def engine_or_skip() -> env.EngineInfo:
    """The engine environment, or a skip naming why it is missing (with `make engine`'s last log line)."""
    log, venv = Path(env.ENGINE_VENV) / "install.log", Path(env.ENGINE_VENV)
    failed = log.exists() and not list(venv.glob(".installed-*"))  # make engine started and did not finish
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if failed else []
    why = f" (install.log: {tail[0]})" if tail else ""
    try:
        python = env.engine_python()
        venv = python.parent.parent
        if venv.name == env.ENGINE_VENV and not list(venv.glob(".installed-*")):
            pytest.skip(f"`make engine` did not finish in {venv}{why}")
        return env.engine_info(python)
    except env.EngineUnavailable as err:
        pytest.skip(f"no vLLM engine environment: {err}{why}")


@pytest.fixture(scope="module")
def engine() -> env.EngineInfo:
    return engine_or_skip()


def tiny_source(path: Path) -> Path:
    """A random llama_mla checkpoint in the DeepSeek layout (test_export's tiny geometry), 2 kept pairs."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_export import deepseek_layout_model, save_source

    model = deepseek_layout_model(
        "llama",
        seed=3,
        vocab_size=300,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        mla=dict(rope_pair_indices=[[[0, 1]], [[0, 1]]]),
    )
    return save_source(model, path)


def swap_rope_rows(export_dir: Path, dst: Path) -> Path:
    """A copy of `export_dir` whose kv_a_proj_with_mqa has two RoPE rows (of different slots) swapped in
    every layer: the shared RoPE key is no longer the source's."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    D, R = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    tensors = load_file(str(dst / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("kv_a_proj_with_mqa.weight"):
            used = [i for i in range(R) if w[D + i].abs().sum() > 0]
            a = used[0]
            b = next(i for i in used if i // 2 != a // 2)
            w[[D + a, D + b]] = w[[D + b, D + a]]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def exports(tmp_path_factory, smollm2_path, engine):
    root = tmp_path_factory.mktemp("engine")
    mla50 = mla.convert_to_mla(
        MLASpec(layout="deepseek", kv_budget=0.5),
        src=smollm2_path,
        dst=root / "smollm2-mla50",
        calibration=CalibrationSpec(tokens=640, window=128),
    )
    out = {
        "smollm2": export.export_checkpoint(src=mla50, dst=root / "smollm2-mla50-576", engine_dims="576"),
        "tiny": export.export_checkpoint(
            src=tiny_source(root / "tiny"), dst=root / "tiny-576", engine_dims="576"
        ),
    }
    out["swapped"] = swap_rope_rows(out["tiny"], root / "tiny-576-swapped")
    yield out
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reports(exports):
    models = [(exports[name], None) for name in ("smollm2", "tiny", "swapped")]
    found = check.engine_check_many(models, lengths=LENGTHS, new_tokens=NEW_TOKENS)
    return dict(zip(("smollm2", "tiny", "swapped"), found))


def test_smollm2_mla50_served_as_converted(reports):
    r = reports["smollm2"]
    assert r["vllm_vs_source"]["identical"] == len(LENGTHS), check.format_report(r)
    assert r["vllm_vs_export"]["identical"] == len(LENGTHS), check.format_report(r)
    assert r["passed"], check.format_report(r)
    # the export matches transformers' eps (1e-6), vLLM uses rms_norm_eps (1e-5): a measured, small effect
    assert r["latent_norm_eps"]["transformers"] == 1e-6 and r["latent_norm_eps"]["vllm"] == pytest.approx(
        1e-5
    )
    assert 0 < r["eps_effect"] < 0.05 and r["tolerance"] == pytest.approx(r["eps_effect"] + check.FLOAT_TOL)
    assert r["rotary_workaround"] == r["rotary_probe"]["bug"]
    assert str(Path(r["model"]).resolve()) in r["serve_command"]
    assert ("-rotary_embedding" in r["serve_command"]) == r["rotary_workaround"]


def test_tiny_random_export_served_as_converted(reports):
    r = reports["tiny"]
    assert r["passed"] and r["vllm_vs_source"]["identical"] == len(LENGTHS), check.format_report(r)
    assert r["eps_effect"] == 0.0  # rms_norm_eps 1e-6: both readers use the same eps


def test_swapped_rope_rows_fail_the_check(reports):
    """vLLM and transformers agree on the wrong export; only the comparison with the source catches it."""
    r = reports["swapped"]
    assert r["vllm_vs_export"]["max_prompt_logprob_diff"] <= r["tolerance"], check.format_report(r)
    assert r["vllm_vs_source"]["max_prompt_logprob_diff"] > 100 * r["tolerance"], check.format_report(r)
    assert not r["passed"] and "FAIL" in check.format_report(r)


# ------------------------------------------------------------------------------------------- bad input


def _one_line_exit_2(capsys, argv: list[str], needle: str) -> None:
    capsys.readouterr()
    assert exit_status(check.main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_engine_check_refuses_a_directory_that_is_not_an_export(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _one_line_exit_2(capsys, ["--model", str(tmp_path)], "hf-attn export --to deepseek_v3")


def test_engine_check_without_engine_environment(tmp_path, capsys):
    src = tiny_source(tmp_path / "src")
    out = export.export_checkpoint(src=src, dst=tmp_path / "out", engine_dims="576")
    _one_line_exit_2(capsys, ["--model", str(out), "--engine-python", str(tmp_path / "none")], "make engine")


def test_engine_check_refuses_dims_no_cpu_backend_accepts(tmp_path, capsys, engine):
    if engine.platform != "cpu":
        pytest.skip(f"the engine is vLLM for {engine.platform}, where TRITON_MLA accepts any dims")
    out = export.export_checkpoint(src=tiny_source(tmp_path / "src"), dst=tmp_path / "out")  # native: 12 + 4
    _one_line_exit_2(capsys, ["--model", str(out)], "--engine-dims 576")


@pytest.mark.parametrize("dims", ["512", "320"])
def test_export_engine_dims_are_exact(tmp_path, dims):
    """Padded to (size - 64) + 64 and still the source's logits in vanilla transformers."""
    from transformers import AutoModelForCausalLM

    import hf_attn  # noqa: F401

    src = tiny_source(tmp_path / "src")
    out = export.export_checkpoint(src=src, dst=tmp_path / "out", engine_dims=dims)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (int(dims) - 64, 64)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


# ---------------------------------------------------------------------------------- convert --engine-dims


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory, smollm2_path):
    """A one-layer random Llama with 64-dim heads and 4 KV heads (full rank 256 at 32 pairs), SmolLM2's
    tokenizer (for the calibration text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("wide") / "src"
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    return path


def test_convert_to_engine_dims_exports_without_padding(wide_heads, tmp_path):
    """--engine-dims 320: d_c 256 and 32 shared pairs, so the export at 320 pads nothing."""
    out = mla.convert_to_mla(
        MLASpec(layout="deepseek", engine_dims="320"),
        src=wide_heads,
        dst=tmp_path / "mla",
        calibration=CalibrationSpec(tokens=192, window=64),
    )
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["rope_pairs"]) == (256, 32)
    exported = export.export_checkpoint(src=out, dst=tmp_path / "ds", engine_dims="320")
    cache = json.loads((exported / "config.json").read_text())["hf_attn"]["history"][-1]
    assert cache["cache_numbers_per_token_and_layer"] == {"source": 320, "export": 320}


def test_convert_to_engine_dims_the_source_cannot_carry(wide_heads, tmp_path, capsys):
    argv = [
        "--model",
        str(wide_heads),
        "--output",
        str(tmp_path / "out"),
        "--layout",
        "deepseek",
        "--engine-dims",
        "576",
    ]  # full rank 256 < 512
    capsys.readouterr()
    assert exit_status(convert_cli.mla_main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "export with --engine-dims 576" in err, err
    assert not (tmp_path / "out").exists()
