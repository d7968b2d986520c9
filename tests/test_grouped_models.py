"""`hf_attn_grouped` inside real transformers models (tiny random configs) against `sdpa` and `eager`."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_attn
from hf_attn.attention.grouped import grouped_attention_forward

GROUPED = "hf_attn_grouped"
HEADS = 6
SEQ = 10
ATOL = 1e-5
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4}),  # window shorter than SEQ
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v projections carry biases
}
GROUP_SIZES = (1, 3, HEADS)  # MHA, GQA, MQA


def tiny_model(arch: str, group_size: int, seed: int = 0):
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // group_size,
        head_dim=48 // HEADS,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    if arch == "qwen2":  # biases start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def batch(padding: str, generator_seed: int = 1):
    """input ids (3, SEQ) and the 2-D attention mask; `padding` is 'none', 'left' or 'right'."""
    gen = torch.Generator().manual_seed(generator_seed)
    ids = torch.randint(3, 96, (3, SEQ), generator=gen)
    lengths = [SEQ, SEQ] if padding == "none" else [SEQ, 7, 3]
    mask = torch.zeros(3, SEQ, dtype=torch.long)
    for b, n in enumerate(lengths + [SEQ] * (3 - len(lengths))):
        if padding == "right":
            mask[b, :n] = 1
        else:
            mask[b, SEQ - n :] = 1
    return ids.masked_fill(mask == 0, 0), mask


def logits_under(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_sdpa_and_eager(arch, group_size, padding):
    model = tiny_model(arch, group_size)
    ids, mask = batch(padding)
    real = mask.bool()  # padded positions have no meaningful logits (no visible key for left padding)
    ours = logits_under(model, GROUPED, input_ids=ids, attention_mask=mask)
    for reference in ("eager", "sdpa"):
        theirs = logits_under(model, reference, input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(ours[real], theirs[real], atol=ATOL, rtol=0, msg=reference)
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_multi_token_decode_against_cache(arch, group_size, padding):
    """Prefill 6 tokens, then feed 4 at once against the cache: same logits as one eager pass."""
    model = tiny_model(arch, group_size)
    ids, mask = batch(padding)
    full = logits_under(model, "eager", input_ids=ids, attention_mask=mask)
    model.set_attn_implementation(GROUPED)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, 6:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    real = mask[:, 6:].bool()
    torch.testing.assert_close(step[real], full[:, 6:][real], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "arch,group_size,padding",
    [(arch, g, "left") for arch in ARCHS for g in GROUP_SIZES] + [("mistral", 3, "none")],
)
def test_greedy_generate_same_tokens(arch, group_size, padding):
    model = tiny_model(arch, group_size)
    model.generation_config.pad_token_id = 0
    ids, mask = batch(padding)
    tokens = {}
    for implementation in (GROUPED, "sdpa", "eager"):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True
        )
    assert tokens[GROUPED].shape[1] > SEQ
    assert torch.equal(tokens[GROUPED], tokens["eager"]) and torch.equal(tokens[GROUPED], tokens["sdpa"])


def test_static_cache_prefill_is_top_left_causal():
    """A static cache is longer than the prompt during prefill; transformers' sdpa mask skip would rely on
    top-left `is_causal` there. The grouped mask function builds the mask instead: same tokens as eager."""
    model = tiny_model("llama", 3)
    model.generation_config.pad_token_id = 0
    ids, mask = batch("none")
    tokens = {}
    for implementation in (GROUPED, "eager"):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="static",
        )
    assert torch.equal(tokens[GROUPED], tokens["eager"])


def test_registration_is_idempotent_and_names_are_valid():
    before = dict(hf_attn.IMPLEMENTATIONS)
    hf_attn.register()
    hf_attn.register()
    assert hf_attn.IMPLEMENTATIONS == before
    assert ALL_ATTENTION_FUNCTIONS[GROUPED] is grouped_attention_forward
    assert GROUPED in AttentionInterface._global_mapping
    for name, (fn, mask_fn) in hf_attn.IMPLEMENTATIONS.items():
        assert name.startswith("hf_attn_")
        assert not any(bad in name for bad in ("flash", "sdpa", "flex_attention", "/")), name
        assert ALL_ATTENTION_FUNCTIONS[name] is fn
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is mask_fn  # else transformers passes attention_mask=None
    model = tiny_model("llama", 3)
    model.set_attn_implementation(GROUPED)  # still selectable after registering again
    assert model.config._attn_implementation == GROUPED
