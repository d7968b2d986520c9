"""Every Llama-family variant, end to end: expand, GQA (mean and calibrated), MLA (per-head layout and
DeepSeek layout), the DeepSeek export, heal, perplexity and generation, over tiny random checkpoints built
here.

Variants (tied and untied embeddings both covered): Llama with llama3 RoPE scaling (GQA), Llama MHA, Mistral
with a sliding window shorter than the test sequence, Qwen2 with q/k/v biases. Each step's reference is
independent of the code under test where one exists: expansion and full-rank all-pairs MLA reproduce the
vanilla transformers source in fp32; mean pooling equals the source with its K/V heads averaged by hand; the
exported deepseek_v3 checkpoint (vanilla transformers' DeepseekV3ForCausalLM) equals its llama_mla source;
generation equals a greedy loop of full forwards without a cache. Lossy steps (calibrated pooling, low-rank
MLA, heal) must load and give finite logits / perplexity. Refusals by design (DeepSeek export of llama3
scaling, nonzero biases, a sliding window shorter than the context) are asserted with their message. The depth
of each step is in its own tests (test_expand, test_gqa, test_mla_conversion, test_export, test_heal); this
file is about the combinations.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_SHAPE
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from hf_attn.conversion import export, gqa, mla
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.specs import CalibrationSpec, ExpandSpec, GQASpec, MLASpec
from hf_attn.conversion.training.data import HealSettings
from hf_attn.conversion.training.heal import heal
from hf_attn.eval import perplexity

TOL = 1e-4  # max |diff| relative to max |logit|, fp32
T = 12  # test sequence length: longer than Mistral's window
CAL_GQA = dict(tokens=48, window=24)
CAL = dict(tokens=80, window=40)  # MLA: windows > rope_selection.QUERY_STRIDE
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of boiled "
    "cabbage and old rag mats. At one end of it a coloured poster had been tacked to the wall. "
) * 6
BASE = dict(**TINY_SHAPE, max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# name -> (config class, overrides, why the DeepSeek export refuses it (None: it does not), export options)
VARIANTS = {
    "llama3_scaling_untied": (
        LlamaConfig,
        dict(rope_parameters=LLAMA3, tie_word_embeddings=False),
        "rope_type='llama3'",
        {},
    ),
    "llama_mha_tied": (LlamaConfig, dict(num_key_value_heads=6, tie_word_embeddings=True), None, {}),
    "mistral_window_untied": (
        MistralConfig,
        dict(sliding_window=5, tie_word_embeddings=False),
        "sliding_window=5 < max_position_embeddings",
        dict(max_position_embeddings=5),  # exact up to the window: the documented way out
    ),
    "qwen2_bias_tied": (Qwen2Config, dict(tie_word_embeddings=True), "is nonzero", {}),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(TEXT)
    return path


class Variant:
    """A tiny source checkpoint and the outputs of the steps so far (converted once, shared by the tests)."""

    def __init__(self, name: str, root: Path, tokenizer_from: Path):
        cls, overrides, self.export_refusal, self.export_options = VARIANTS[name]
        self.name, self.root = name, root
        config = cls(vocab_size=_vocab(tokenizer_from), **{**BASE, **overrides})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.1 * noise if "norm" in pname else 0.2 * noise)
        self.src = root / "src"
        model.save_pretrained(self.src)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / f, self.src / f)
        self.config = model.config
        self.ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(7))
        self.ref_logits = logits_of(model, self.ids)
        self.outputs: dict[str, Path] = {}

    def out(self, step: str, convert) -> Path:
        if step not in self.outputs:
            self.outputs[step] = convert(self.root / step)
        return self.outputs[step]


def _vocab(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp(request.param)
    yield Variant(request.param, root, smollm2_path)
    shutil.rmtree(root, ignore_errors=True)


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3g} > {tol} * max |logit| {scale:.3g}"


def assert_finite_model(path: Path, v: Variant) -> None:
    logits = logits_of(load(path), v.ids)
    assert logits.shape == v.ref_logits.shape and torch.isfinite(logits).all()


def pooled_kv_reference(v: Variant, num_kv_heads: int) -> torch.Tensor:
    """The source with each group of K/V heads replaced by its mean, built by hand (vanilla transformers)."""
    cfg = v.config
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    model = load(v.src)
    state = model.state_dict()
    config = type(cfg)(**{**cfg.to_dict(), "num_key_value_heads": num_kv_heads})
    pooled = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, tensor in list(state.items()):
        if ".k_proj." in name or ".v_proj." in name:
            rows = tensor.reshape(hkv, d, *tensor.shape[1:])  # (Hkv, d[, E])
            state[name] = (
                rows.reshape(num_kv_heads, hkv // num_kv_heads, d, *tensor.shape[1:])
                .mean(1)
                .reshape(num_kv_heads * d, *tensor.shape[1:])
            )  # (Hkv', d[, E]) -> (Hkv' d[, E])
    pooled.load_state_dict(state, strict=False)
    pooled.tie_weights()
    return logits_of(pooled.eval(), v.ids)


# ------------------------------------------------------------------------------------------------ conversions


def test_expand_reproduces_source(variant):
    v = variant
    out = v.out("expand", lambda dst: expand.expand_checkpoint(ExpandSpec(), src=v.src, dst=dst))
    model = load(out)
    assert model.config.num_key_value_heads == v.config.num_attention_heads
    assert_close(logits_of(model, v.ids), v.ref_logits)


def test_gqa_mean_equals_hand_pooled(variant):
    v = variant
    target = 1
    out = v.out(
        "gqa_mean",
        lambda dst: gqa.convert_gqa(GQASpec(num_kv_heads=target, method="mean"), src=v.src, dst=dst),
    )
    assert_close(logits_of(load(out), v.ids), pooled_kv_reference(v, target))


def test_gqa_calibrated(variant, text_file):
    v = variant
    out = v.out(
        "gqa_calibrated",
        lambda dst: gqa.convert_gqa(
            GQASpec(num_kv_heads=1, method="calibrated"),
            src=v.src,
            dst=dst,
            calibration=CalibrationSpec(text=[text_file], **CAL_GQA),
        ),
    )
    assert_finite_model(out, v)


def test_mla_full_rank_reproduces_source(variant):
    v = variant
    out = v.out("mla_full", lambda dst: mla.convert_to_mla(MLASpec(kv_budget=1.0), src=v.src, dst=dst))
    assert_close(logits_of(load(out), v.ids), v.ref_logits)


def _mla_low(v: Variant, text_file: Path) -> Path:
    return v.out(
        "mla_low",
        lambda dst: mla.convert_to_mla(
            MLASpec(kv_lora_rank=8, rope_pairs=2),
            src=v.src,
            dst=dst,
            calibration=CalibrationSpec(text=[text_file], **CAL),
        ),
    )


def test_mla_per_head_low_rank(variant, text_file):
    assert_finite_model(_mla_low(variant, text_file), variant)


def _deepseek(v: Variant, text_file: Path) -> Path:
    return v.out(
        "mla_deepseek",
        lambda dst: mla.convert_to_mla(
            MLASpec(kv_lora_rank=8, rope_pairs=2, layout="deepseek", rope_selection="high"),
            src=v.src,
            dst=dst,
            calibration=CalibrationSpec(text=[text_file], **CAL),
        ),
    )


def test_mla_deepseek_layout_and_export(variant, text_file, tmp_path):
    v = variant
    src = _deepseek(v, text_file)
    assert_finite_model(src, v)
    dst = tmp_path / "deepseek_v3"
    if v.export_refusal is not None:
        with pytest.raises(ValueError, match="cannot export exactly to deepseek_v3") as err:
            export.export_checkpoint(src=src, dst=dst)
        assert v.export_refusal in str(err.value)
        assert not dst.exists()
        if not v.export_options:
            return
    export.export_checkpoint(src=src, dst=dst, **v.export_options)
    exported = load(dst)
    assert exported.config.model_type == "deepseek_v3"
    ids = v.ids[:, : v.export_options.get("max_position_embeddings", T)]
    assert_close(logits_of(exported, ids), logits_of(load(src), ids))


# -------------------------------------------------------------------------------------------- heal, evaluate


def test_heal_perplexity_generate(variant, text_file):
    """Heal the low-rank per-head MLA conversion 2 steps, evaluate its perplexity, generate greedily."""
    v = variant
    src = _mla_low(v, text_file)
    healed = v.out(
        "healed",
        lambda dst: (
            heal(
                HealSettings(
                    model=str(src),
                    output=str(dst),
                    train_text=[str(text_file)],
                    max_steps=2,
                    seq_len=16,
                    lr=1e-3,
                    eval_tokens=0,
                    trust_remote_code=True,
                ),
                progress=False,
            )
            and dst
        ),
    )
    record = perplexity.run(
        perplexity.PerplexitySettings(
            model=str(healed), texts=[str(text_file)], context_length=16, max_tokens=64, progress=False
        )
    )
    assert record["tokens_scored"] > 0 and math.isfinite(record["perplexity"])

    model = load(healed)
    prompt = v.ids[:1, :6]
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        ids = prompt
        for _ in range(4):  # the reference: full forwards without a cache
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, ids)


def test_mla_refuses_a_calibration_window_of_one_query(tmp_path, text_file):
    """--rope-selection attention reads every QUERY_STRIDE-th query of a window: a window that short gives one
    query attending to one key, zero score variance and a 0/0 query fit (NaN or ~1e12 query weights, which
    then poison healing); refused before any work."""
    from hf_attn.conversion.mla import rope_selection

    src = tmp_path / "src"
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, **BASE)).save_pretrained(src)
    with pytest.raises(ValueError, match="--calibration-window 32 is too short"):
        mla.convert_to_mla(
            MLASpec(kv_lora_rank=8, rope_pairs=2),
            src=src,
            dst=tmp_path / "out",
            calibration=CalibrationSpec(text=[text_file], window=rope_selection.QUERY_STRIDE),
        )
    assert not (tmp_path / "out").exists()


def test_gqa_calibrated_mha_to_mqa_from_few_tokens_is_finite(tmp_path, text_file, smollm2_path):
    """80 calibration tokens in windows of 40 leave the value statistics rank-deficient and, after float32
    accumulation, slightly indefinite: the value refit must stop rather than diverge (it once overflowed)."""
    v = Variant("llama_mha_tied", tmp_path, smollm2_path)
    out = gqa.convert_gqa(
        GQASpec(num_kv_heads=1, method="calibrated"),
        src=v.src,
        dst=tmp_path / "gqa",
        calibration=CalibrationSpec(text=[text_file], tokens=80, window=40),
    )
    assert_finite_model(out, v)
