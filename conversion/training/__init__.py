"""Healing: short uptraining of a converted checkpoint (`hf_attn.conversion.heal` is its command)."""
