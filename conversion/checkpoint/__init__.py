"""Checkpoints and the layer-by-layer model the converters read them through (docs/layout.md lists the
modules: `io`, `shards`, `layerwise`, `calibration`, `threads`).

`hf_attn.conversion.checkpoint.NAME` for a name of `io` (e.g. `check_supported`, `open_source`) still gives
it, with a warning naming `hf_attn.conversion.checkpoint.io.NAME`."""

import warnings

from hf_attn.conversion.checkpoint import io


def __getattr__(name: str):
    if name.startswith("__") or not hasattr(io, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is now {__name__}.io.{name}", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(io, name)  # warned once: later reads find it here
    return value
