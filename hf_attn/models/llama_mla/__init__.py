"""The `llama_mla` model type: Llama / Mistral / Qwen2 with multi-head latent attention on a latent KV cache.

The checkpoint layout is fixed by `configuration_llama_mla.LlamaMLAConfig` and the module docstring of
`modeling_llama_mla` (the binding contract with the converter, `conversion.mla`).
"""

from hf_attn.models.llama_mla.configuration_llama_mla import LlamaMLAConfig
from hf_attn.models.llama_mla.modeling_llama_mla import (
    LlamaMLAAttention,
    LlamaMLAForCausalLM,
    LlamaMLAModel,
    LlamaMLAPreTrainedModel,
)

__all__ = [
    "LlamaMLAAttention",
    "LlamaMLAConfig",
    "LlamaMLAForCausalLM",
    "LlamaMLAModel",
    "LlamaMLAPreTrainedModel",
]
