"""MHA/GQA -> MLA (the `llama_mla` model type): `convert` (`convert_to_mla`, the written checkpoint),
`plan` (validation, pair choice, the planned conversion), `calibration` (the statistics pass), `ranks`
(r and d_c from a rank or a KV budget, and their allocation across layers), `layer` (one layer's fit),
`factorization` (the joint low-rank latent), `rope_selection` (which RoPE pairs each KV head keeps, the
row permutation) and `shared_rope` (the DeepSeek layout). `python -m conversion.mla` is
`hf-attn convert mla`."""

from hf_attn.conversion.mla.calibration import Calibration, calibrate
from hf_attn.conversion.mla.convert import convert_to_mla, describe, write_conversion
from hf_attn.conversion.mla.layer import convert_layer
from hf_attn.conversion.mla.plan import MLAConversion, check_spec, plan_conversion
from hf_attn.conversion.mla.ranks import MLAShape, default_rope_pairs, plan_shape

__all__ = [
    "Calibration",
    "MLAConversion",
    "MLAShape",
    "calibrate",
    "check_spec",
    "convert_layer",
    "convert_to_mla",
    "default_rope_pairs",
    "describe",
    "plan_conversion",
    "plan_shape",
    "write_conversion",
]
