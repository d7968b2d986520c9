"""The reference calibration pass of the tests: a model loaded whole, hooked in memory.

The converters read their source one decoder layer at a time (`layerwise.LayerwiseModel`). These tests check
that pass against this one, written independently: transformers runs the whole model over each window and a
forward pre-hook on every wanted `self_attn` hands its input to the callback, as a calibration tool that loads
the model whole would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Stop(Exception):
    """Raised by the hook of the last wanted layer: the rest of the forward is never needed."""


class WholeModel:
    """A loaded causal LM behind `LayerwiseModel`'s calibration interface (`model.layers`, `config`,
    `for_each_attention_input`), so the converters' statistics passes accept it."""

    def __init__(self, causal_lm):
        self.causal_lm = causal_lm.eval()
        self.model, self.config = causal_lm.model, causal_lm.config

    def for_each_attention_input(
        self, input_ids: torch.Tensor, fn, *, window: int, layers: Iterable[int] | None = None, progress=True
    ) -> None:
        """fn(layer, x (1, T, C), (cos, sin) each (1, T, D)) for every wanted layer and window of 1-D ids."""
        blocks = list(self.model.layers)
        wanted = sorted(set(range(len(blocks)) if layers is None else layers))
        handles = [
            blocks[i].self_attn.register_forward_pre_hook(self._hook(i, fn, wanted[-1]), with_kwargs=True)
            for i in wanted
        ]
        try:
            with torch.inference_mode():
                for start in range(0, len(input_ids), window):
                    try:
                        self.causal_lm(input_ids=input_ids[start : start + window][None], use_cache=False)
                    except _Stop:
                        pass
        finally:
            for h in handles:
                h.remove()

    @staticmethod
    def _hook(idx: int, fn, last: int):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            fn(idx, x.detach(), kwargs.get("position_embeddings"))
            if idx == last:
                raise _Stop

        return hook


def capture_attention_inputs(model, input_ids: torch.Tensor, *, layers, window: int, progress=False) -> dict:
    """layer -> (x (N, C), (cos, sin) each (N, D)): the attention inputs of `layers` over every window of
    `input_ids`, concatenated in order. `model`: a `LayerwiseModel`, a `WholeModel` or a loaded causal LM."""
    if not hasattr(model, "for_each_attention_input"):
        model = WholeModel(model)
    xs, cos, sin = {}, {}, {}

    def keep(idx: int, x: torch.Tensor, position_embeddings) -> None:
        xs.setdefault(idx, []).append(x.reshape(-1, x.shape[-1]).clone())  # (T, C)
        c, s = position_embeddings
        cos.setdefault(idx, []).append(c.reshape(-1, c.shape[-1]))  # (T, D)
        sin.setdefault(idx, []).append(s.reshape(-1, s.shape[-1]))

    model.for_each_attention_input(input_ids, keep, window=window, layers=layers, progress=False)
    return {i: (torch.cat(xs[i]), (torch.cat(cos[i]), torch.cat(sin[i]))) for i in xs}
