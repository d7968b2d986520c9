"""The one place that registers hf-attn with transformers. Idempotent: safe to call any number of times."""

from __future__ import annotations

from transformers import AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hf_attn.attention.grouped import grouped_attention_forward, grouped_attention_mask
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

# name -> (attention function, mask function). The mask function decides which masks reach the attention
# function: `grouped_attention_mask` (transformers' `sdpa_mask`) gives a boolean (B, 1, T, S) mask, or None
# for a plain causal batch without padding where T == 1 or T == S.
IMPLEMENTATIONS = {
    "hf_attn_grouped": (grouped_attention_forward, grouped_attention_mask),
}

_FORBIDDEN = ("flash", "sdpa", "flex_attention", "/")


def register() -> None:
    """Register every hf-attn attention implementation, and the `llama_mla` model type with AutoConfig /
    AutoModelForCausalLM (skipped where already registered), with transformers."""
    for name, (fn, mask_fn) in IMPLEMENTATIONS.items():
        assert name.startswith("hf_attn_") and not any(s in name for s in _FORBIDDEN), name
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask_fn)
    model_type = LlamaMLAConfig.model_type
    if model_type not in CONFIG_MAPPING or CONFIG_MAPPING[model_type] is not LlamaMLAConfig:
        AutoConfig.register(model_type, LlamaMLAConfig)  # raises if transformers itself defines the name
    mapping = MODEL_FOR_CAUSAL_LM_MAPPING
    if LlamaMLAConfig not in mapping or mapping[LlamaMLAConfig] is not LlamaMLAForCausalLM:
        AutoModelForCausalLM.register(LlamaMLAConfig, LlamaMLAForCausalLM)
