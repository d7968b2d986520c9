"""Optional GPU kernels (Triton; `pip install hf-attn[kernels]`).

Importing this package imports nothing heavy: `hf_attn.kernels.mla_decode` imports triton and is loaded only
where a kernel is used (`llama_mla`'s absorbed decode on CUDA tensors).
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    """True when triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None
