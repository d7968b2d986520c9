"""Model types added by hf-attn (registered with the transformers Auto classes by `hf_attn.registry`)."""
