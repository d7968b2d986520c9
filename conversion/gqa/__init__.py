"""MHA/GQA -> GQA/MQA and back: `convert_gqa` writes the pooled checkpoint (docs/layout.md lists the
modules). `python -m conversion.gqa` is `hf-attn convert gqa`."""

from hf_attn.conversion.gqa.convert import convert_gqa, describe
from hf_attn.conversion.gqa.pooling import (
    AttentionStatistics,
    Pooling,
    calibrate,
    calibrated_pool_layer,
    check_pooling,
    collect_attention_statistics,
    fit_keys,
    fit_values,
    mean_pool_heads,
)

__all__ = [
    "AttentionStatistics",
    "Pooling",
    "calibrate",
    "calibrated_pool_layer",
    "check_pooling",
    "collect_attention_statistics",
    "convert_gqa",
    "describe",
    "fit_keys",
    "fit_values",
    "mean_pool_heads",
]
