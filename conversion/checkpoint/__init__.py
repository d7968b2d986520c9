"""Checkpoints and the layer-by-layer model the converters read them through: `io` (reading a source,
its geometry and records, streaming the output), `shards` (the sharded safetensors writer and spilled
layers), `layerwise` (`LayerwiseModel`: one decoder layer in memory at a time), `calibration` (the
calibration text and each attention layer's inputs) and `threads` (torch's CPU threads on a shared
machine)."""
