"""MHA/GQA -> MLA (the `llama_mla` model type): `convert_to_mla` writes the checkpoint; docs/layout.md lists
the modules. `python -m conversion.mla` is `hf-attn convert mla`."""

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
