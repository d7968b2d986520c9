"""Healing: short uptraining of a converted checkpoint. `heal` (`heal()` and `hf-attn heal`), `data` (the
settings and the training text), `recipe`, `state`, `loop`, `lora` and `teacher`. `python -m
conversion.training` is `hf-attn heal`."""
