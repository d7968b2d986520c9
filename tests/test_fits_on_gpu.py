"""The conversions' layer fits on a CUDA device against the same fits in float64 on the CPU (they skip without
CUDA). Light on purpose: torch, transformers and the converters only, and SmolLM2's tokenizer without its
weights, so that `python -m benchmarks.gpu --parts kernel-tests --set 'kernel-tests.tests="THIS FILE"'` runs
them on a GPU machine that has only the carried bundle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hf_attn.conversion import mla
from hf_attn.conversion.specs import CalibrationSpec, MLASpec
from hf_attn.tooling import assets

TEXT = (
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, never took "
    "up any book but the Baronetage; there he found occupation for an idle hour, and consolation in a "
    "distressed one. " * 30
)


def tiny_llama(path: Path) -> Path:
    """A tiny random Llama with q/k/v/o biases (hidden 16, 4 query and 2 KV heads of 8, 2 layers), SmolLM2's
    tokenizer, and `calibration.txt` beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer_dir = assets.cache_dir() / "smollm2-135m-instruct"  # the tokenizer only: no weights needed
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    (path.parent / "calibration.txt").write_text(TEXT)
    return path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["per-head", "deepseek"])
def test_mla_layer_fits_on_gpu_match_the_cpu_fits_on_gpu(tmp_path, layout):
    """`convert_layer_on` the calibration pass's CUDA device against the same plan's fits on the CPU: every
    converted tensor of both layouts, biases included."""
    src = tiny_llama(tmp_path / "src")
    calibration = CalibrationSpec(text=[src.parent / "calibration.txt"], tokens=256, window=64, device="cpu")
    plan = mla.plan_conversion(src, MLASpec(layout=layout, kv_budget=0.5), calibration)
    assert plan.fit_device.type == "cpu" and plan.calibration is not None
    on_cpu = dict(plan.tensors())
    plan.calibration.record["device"] = "cuda"
    on_gpu = dict(plan.tensors())
    assert set(on_gpu) == set(on_cpu) and all(t.device.type == "cpu" for t in on_gpu.values())
    # A latent direction is an eigenvector, fixed up to its sign: compare what the layer computes from the
    # latent (up x gain x down, for keys and values) and the latent's Gram matrix (its RMS), the rest as is.
    for name, expected in on_cpu.items():
        if not name.endswith(LATENT):
            torch.testing.assert_close(on_gpu[name], expected, rtol=1e-4, atol=1e-5)
    layers = sorted({n.removesuffix(LATENT[0]) for n in on_cpu if n.endswith(LATENT[0])})
    assert len(layers) == 2
    for prefix in layers:
        pairs = zip(latent_products(on_gpu, prefix), latent_products(on_cpu, prefix), strict=True)
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


LATENT = ("kv_down_proj.weight", "k_up_proj.weight", "v_up_proj.weight", "latent_norm.weight")


def latent_products(tensors: dict, prefix: str) -> list[torch.Tensor]:
    """[k_up g down, v_up g down, down^T down] of the layer at `prefix` (g: the latent norm's gain, or 1)."""
    down = tensors[prefix + "kv_down_proj.weight"].double()  # (d_c, C)
    gain = tensors.get(prefix + "latent_norm.weight", torch.ones(down.shape[0])).double()  # (d_c,)
    ups = [tensors[prefix + f"{kv}_up_proj.weight"].double() * gain for kv in ("k", "v")]  # (rows, d_c)
    return [up @ down for up in ups] + [down.T @ down]
