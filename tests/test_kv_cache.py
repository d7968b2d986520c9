"""KV bytes per token: the config formula, a real cache after a forward pass, and numbers written out by hand
agree (tiny MHA/GQA/MQA/sliding-window configs, the real SmolLM2, MLA when its model type is available)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from hf_attn.eval.kv_cache import kv_bytes_per_token, kv_cache_bytes, measured_kv_bytes_per_token

TINY = dict(
    vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=3, max_position_embeddings=128
)


def tiny_llama(hq: int, hkv: int, head_dim: int = 16, cls=LlamaConfig, **extra):
    return cls(**TINY, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_config_equals_measured_and_hand_count(hq, hkv, dtype):
    config = tiny_llama(hq, hkv)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    size = 4 if dtype == torch.float32 else 2
    by_hand = 2 * hkv * 16 * size  # K and V of every KV head, head_dim 16
    computed = kv_bytes_per_token(config, dtype)
    measured = measured_kv_bytes_per_token(model, seq_len=8)
    assert computed.per_layer == measured.per_layer == by_hand
    assert computed.total == measured.total == 3 * by_hand
    assert computed.numbers_per_token_per_layer == measured.numbers_per_token_per_layer == 2 * hkv * 16
    assert computed.layers == measured.layers == 3


def test_head_dim_defaults_to_hidden_over_heads():
    config = LlamaConfig(**TINY, num_attention_heads=8, num_key_value_heads=2)  # head_dim 64 / 8 = 8
    assert kv_bytes_per_token(config).numbers_per_token_per_layer == 2 * 2 * 8


def test_sliding_window_counts_per_token_and_caps_totals():
    config = tiny_llama(4, 2, cls=MistralConfig, sliding_window=40)
    model = AutoModelForCausalLM.from_config(config).eval()
    per_layer = 2 * 2 * 16 * 4
    assert (
        kv_bytes_per_token(config).total
        == measured_kv_bytes_per_token(model, seq_len=8).total
        == 3 * per_layer
    )
    assert kv_cache_bytes(config, 30) == 3 * 30 * per_layer
    assert kv_cache_bytes(config, 100, batch_size=2) == 2 * 3 * 40 * per_layer  # each layer holds the window


def test_mixed_full_and_sliding_layers():
    # Qwen2 with sliding window on layers >= max_window_layers: layer 0 full, layers 1-2 sliding (window 40)
    config = tiny_llama(
        4, 2, cls=Qwen2Config, use_sliding_window=True, sliding_window=40, max_window_layers=1
    )
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    per_layer = 2 * 2 * 16 * 4
    assert kv_cache_bytes(config, 100) == (100 + 40 + 40) * per_layer
    model = AutoModelForCausalLM.from_config(config).eval()
    assert measured_kv_bytes_per_token(model, seq_len=8).total == kv_bytes_per_token(config).total


def test_real_smollm2(smollm2_path):
    config = AutoConfig.from_pretrained(smollm2_path)
    computed = kv_bytes_per_token(config)
    assert computed.per_layer == 2 * 3 * 64 * 4 and computed.total == 30 * 2 * 3 * 64 * 4  # 46,080 B/token
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    assert measured_kv_bytes_per_token(model, seq_len=4).to_dict() == computed.to_dict()


def test_mla_formula_from_config_fields():
    config = tiny_llama(4, 2)
    config.model_type = "llama_mla"  # instance attribute: only the fields the formula reads
    config.kv_lora_rank, config.rope_pairs = 24, 3
    kv = kv_bytes_per_token(config, torch.bfloat16)
    assert kv.numbers_per_token_per_layer == 24 + 2 * 2 * 3
    assert kv.total == 3 * (24 + 12) * 2


def test_mla_model_measured_equals_config():
    try:
        config = AutoConfig.for_model(
            "llama_mla", **TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
    except (ValueError, KeyError):
        pytest.skip("the llama_mla model type is not registered yet")
    config.kv_lora_rank, config.rope_pairs = 24, 3
    model = AutoModelForCausalLM.from_config(config).eval()
    assert measured_kv_bytes_per_token(model, seq_len=8).to_dict() == kv_bytes_per_token(config).to_dict()
