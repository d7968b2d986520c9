"""Healing: short uptraining of a converted checkpoint. `heal` (`heal()` and `hf-attn heal`, also `python -m
conversion.training`), `data` (settings, training text), `recipe`, `state`, `loop`, `lora` and `teacher`."""
