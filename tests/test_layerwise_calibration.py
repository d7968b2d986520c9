"""Layer-by-layer calibration (conversion.checkpoint.layerwise) against the whole-model hooked pass it
replaces.

The reference is `calibration_reference.WholeModel`, the source loaded whole by transformers in float32
(what the calibrated converters did before): the attention inputs, RoPE tables and GQA statistics of the
layer-wise pass must equal it on tiny Llama (llama3 rope scaling), Mistral (sliding window shorter than the
calibration window), Qwen2 (q/k/v biases; mixed full/sliding layers) and the real SmolLM2. Also: one decoder
layer in memory at a time, later layers never read, the bfloat16 forward, and the command-line options."""

import json
from pathlib import Path

import pytest
import torch
from calibration_reference import WholeModel, capture_attention_inputs
from conftest import exit_status
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import gqa
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.checkpoint.layerwise import LayerwiseModel

TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
SOURCES = {
    "llama-llama3-rope": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE)),
    "mistral-sliding": (MistralConfig, dict(sliding_window=6)),
    "qwen2-biases": (Qwen2Config, {}),
    "qwen2-mixed-layers": (Qwen2Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)),
}
WINDOW = 16
IDS = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))  # windows of 16, 16 and 8


def make_source(path: Path, name: str, **overrides) -> Path:
    """A tiny random checkpoint; biases are made non-zero so reading them is tested."""
    config_class, extra = SOURCES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config_class(**{**TINY, **extra, **overrides}), dtype=torch.float32
    )
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith(".bias") or "norm" in param_name:
                p.normal_(1.0 if "norm" in param_name else 0.0, 0.5)
    model.save_pretrained(path)
    return path


def whole_model(path: Path, dtype=torch.float32):
    """The reference: the source loaded whole, as the converters loaded it before."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def assert_same_inputs(got: dict, want: dict, *, atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(want)
    for layer in want:
        (x, (cos, sin)), (x_ref, (cos_ref, sin_ref)) = got[layer], want[layer]
        assert x.dtype == torch.float32 and x.device.type == "cpu"
        torch.testing.assert_close(x, x_ref.float(), rtol=1e-5, atol=atol, msg=f"layer {layer} inputs")
        torch.testing.assert_close(cos, cos_ref.float(), rtol=0, atol=1e-7, msg=f"layer {layer} cos")
        torch.testing.assert_close(sin, sin_ref.float(), rtol=0, atol=1e-7, msg=f"layer {layer} sin")


@pytest.mark.parametrize("name", list(SOURCES))
def test_attention_inputs_equal_the_whole_model_pass(tmp_path, name, monkeypatch):
    monkeypatch.setattr(layerwise, "EMBEDDING_BLOCK_BYTES", 7 * TINY["hidden_size"] * 4)  # 7 rows a block
    src = make_source(tmp_path / name, name)
    layers = range(TINY["num_hidden_layers"])
    with torch.inference_mode():
        want = capture_attention_inputs(whole_model(src), IDS, layers=layers, window=WINDOW, progress=False)
    got = capture_attention_inputs(LayerwiseModel(src), IDS, layers=layers, window=WINDOW, progress=False)
    assert_same_inputs(got, want)


def test_sharded_source(tmp_path):
    """Tensors spread over several shards (model.safetensors.index.json) are found by name."""
    src = make_source(tmp_path / "one", "qwen2-biases")
    sharded = tmp_path / "sharded"
    whole_model(src).save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    want = capture_attention_inputs(LayerwiseModel(src), IDS, layers=[3], window=WINDOW, progress=False)
    got = capture_attention_inputs(LayerwiseModel(sharded), IDS, layers=[3], window=WINDOW, progress=False)
    assert_same_inputs(got, want, atol=0)


def test_the_comparison_sees_the_mask_and_the_rope_scaling(tmp_path):
    """The sliding window and llama3 scaling change the inputs this much, so the test above can fail."""
    sliding = capture_attention_inputs(
        LayerwiseModel(make_source(tmp_path / "a", "mistral-sliding")), IDS, layers=[3], window=WINDOW
    )
    full = capture_attention_inputs(
        LayerwiseModel(make_source(tmp_path / "b", "mistral-sliding", sliding_window=None)),
        IDS,
        layers=[3],
        window=WINDOW,
    )
    assert (sliding[3][0] - full[3][0]).abs().max() > 1e-2
    scaled = LayerwiseModel(make_source(tmp_path / "c", "llama-llama3-rope")).rotary.inv_freq
    plain = LayerwiseModel(make_source(tmp_path / "d", "llama-llama3-rope", rope_parameters=None)).rotary
    assert (scaled - plain.inv_freq).abs().max() > 1e-3


def test_gqa_statistics_equal_the_whole_model_pass(tmp_path):
    """The converters' own statistics code (which reads `model.layers[i].self_attn` in its callback)."""
    src = make_source(tmp_path / "src", "qwen2-mixed-layers")
    model = whole_model(src)
    pooling = gqa.check_pooling(AttentionGeometry.from_config(model.config.to_dict()), 1)
    with torch.inference_mode():
        want = gqa.collect_attention_statistics(
            WholeModel(model), IDS, pooling=pooling, window=WINDOW, progress=False
        )
        got = gqa.collect_attention_statistics(
            LayerwiseModel(src), IDS, pooling=pooling, window=WINDOW, progress=False
        )
    for layer in range(TINY["num_hidden_layers"]):
        assert got[layer].keys.dtype == torch.complex128 and got[layer].values.dtype == torch.float64
        assert got[layer].tokens == want[layer].tokens == len(IDS)
        torch.testing.assert_close(got[layer].keys, want[layer].keys, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[layer].values, want[layer].values, rtol=1e-5, atol=1e-7)


def test_bfloat16_forward_matches_the_bfloat16_model_and_hands_over_float32(tmp_path):
    src = make_source(tmp_path / "src", "qwen2-biases")
    layers = range(TINY["num_hidden_layers"])
    with torch.inference_mode():
        want = capture_attention_inputs(
            whole_model(src, torch.bfloat16), IDS, layers=layers, window=WINDOW, progress=False
        )
    lw = LayerwiseModel(src, forward_dtype="bfloat16")
    got = capture_attention_inputs(lw, IDS, layers=layers, window=WINDOW, progress=False)
    assert_same_inputs(got, want, atol=0)  # exact upcasts of the same bfloat16 activations
    fp32 = whole_model(src)
    seen = []

    def check(layer, x, position_embeddings):  # a float32 self_attn holding the source's weights
        attn = lw.model.layers[layer].self_attn
        seen.append(layer)
        assert attn.q_proj.weight.dtype == torch.float32 and attn.q_proj.weight.device.type == "cpu"
        torch.testing.assert_close(attn.k_proj.bias, fp32.model.layers[layer].self_attn.k_proj.bias)
        torch.testing.assert_close(attn.o_proj.weight, fp32.model.layers[layer].self_attn.o_proj.weight)

    lw.for_each_attention_input(IDS, check, window=WINDOW, progress=False)
    assert seen == [i for i in layers for _ in range(3)]


def test_one_layer_in_memory_and_later_layers_never_read(tmp_path):
    src = make_source(tmp_path / "src", "llama-llama3-rope", num_hidden_layers=6)
    lw = LayerwiseModel(src)
    loaded = []
    load = lw.load_layer
    lw.load_layer = lambda i: loaded.append(i) or load(i)
    calls = []
    lw.for_each_attention_input(IDS, lambda i, x, pe: calls.append(i), window=WINDOW, layers=[1, 3])
    assert loaded == [0, 1, 2, 3] and calls == [1, 1, 1, 3, 3, 3]
    assert lw.max_layers_loaded == 1
    assert all(p.is_meta for p in lw.model.parameters()), "every layer is freed afterwards"


def _tokenized_source(tmp_path: Path, smollm2_path: Path, name: str) -> Path:
    src = make_source(tmp_path / "src", name, vocab_size=49152)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (src / file).write_bytes((smollm2_path / file).read_bytes())
    return src


def test_converters_record_the_forward_settings(tmp_path, smollm2_path, capsys):
    """... and warn once where bfloat16 is emulated: on a CPU oneDNN has no bfloat16 kernels for (its own
    answer, not the rule under test)."""
    src = _tokenized_source(tmp_path, smollm2_path, "qwen2-biases")
    emulated = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    common = [
        "--model",
        str(src),
        "--calibration-tokens",
        "256",
        "--calibration-window",
        "128",
        "--refine-steps",
        "0",
    ]
    out = tmp_path / "mqa"
    argv = [*common, "--num-kv-heads", "1", "--method", "calibrated", "--forward-dtype", "bfloat16"]
    assert exit_status(convert_cli.gqa_main, [*argv, "--output", str(out)]) == 0
    record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["settings"]["device"] == "cpu" and record["settings"]["forward_dtype"] == "bfloat16"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == (
        [
            "hf-attn convert gqa: warning: --forward-dtype bfloat16 on cpu: this device has no "
            "native bfloat16 matmuls and torch emulates them (about 20x slower than float32); "
            "--forward-dtype float32 is faster"
        ]
        if emulated
        else []
    )
    out = tmp_path / "mla"
    assert exit_status(convert_cli.mla_main, [*common, "--kv-budget", "0.5", "--output", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["settings"]["device"] == "cpu" and record["settings"]["forward_dtype"] == "float32"
    assert record["calibration"]["forward_dtype"] == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = make_source(tmp_path / "src", "llama-llama3-rope")
    for main, extra in (
        (convert_cli.gqa_main, ["--num-kv-heads", "1", "--method", "calibrated"]),
        (convert_cli.mla_main, []),
    ):
        capsys.readouterr()
        argv = ["--model", str(src), "--output", str(tmp_path / "out"), "--device", "cuda", *extra]
        assert exit_status(main, argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--device cuda" in err and "--device cpu" in err
        assert not (tmp_path / "out").exists()
    assert (
        exit_status(
            convert_cli.gqa_main, ["--output", "x", "--num-kv-heads", "1", "--forward-dtype", "float16"]
        )
        == 2
    )


@pytest.mark.slow
def test_smollm2_attention_inputs_equal_the_whole_model_pass(smollm2_path):
    """512 tokens of the real model: the first, second and last of 30 layers (errors would accumulate)."""
    ids = torch.randint(0, 49152, (512,), generator=torch.Generator().manual_seed(0))
    layers = [0, 1, 29]
    with torch.inference_mode():
        want = capture_attention_inputs(
            whole_model(smollm2_path), ids, layers=layers, window=256, progress=False
        )
    got = capture_attention_inputs(
        LayerwiseModel(smollm2_path), ids, layers=layers, window=256, progress=False
    )
    assert_same_inputs(got, want, atol=1e-5)
