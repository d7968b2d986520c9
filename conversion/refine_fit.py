"""One layer of the refinement (`conversion.refine`): the fit of a converted decoder layer's attention to the
source layer's output, given the hidden states that enter it.

Notation: x (1, T, E) a window's hidden states entering the converted layer, m the residual stream after
its attention and y the layer's output:

    m = x + attn(input_layernorm(x))         y = m + mlp(post_attention_layernorm(m))
    rms(h) = h / sqrt(mean(h^2) + 1e-6)      (over E: what the next RMSNorm reads, without its gain)

The targets are the source layer's m (target "attention") or y (target "layer") on the source's own stream.
A layer's error is mean |rms(prediction) - rms(target)|^2 over every token of the windows. Its fit:
1. `refit_output`: o_proj (and its bias) by least squares, the rest of the attention fixed, on the attention
   target linearised at rms(m) ~ m / rms_src, i.e. per token weights w_t = 1 / rms_src,t^2:

       min_O sum_t w_t |x_t + O z_t - m_src,t|^2 + ridge |O - O_0|^2    z_t the input of o_proj

   solved as O = O_0 + (sum_t w_t (m_src,t - x_t - O_0 z_t) z_t^T)(sum_t w_t z_t z_t^T + ridge I)^-1 with
   ridge = OUTPUT_RIDGE x the mean diagonal of the weighted Gram: where the windows are silent O stays O_0;
2. `steps` Adam steps of one window each on all `self_attn` parameters, the rate decaying linearly to 0
   (`decay`), with target "attention" through the attention alone (the MLP is neither run nor
   differentiated: a fraction of the layer's work), with target "layer" through the MLP;
3. `refit_output` again, for the final q/k/v;
4. the weights are kept only if they lower the error over all windows (an exact conversion is left as it is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_attn.conversion import stages

TARGETS = ("attention", "layer")
DEFAULT_TARGET = "layer"
STEP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OUTPUT_RIDGE = 1e-3


@dataclass(frozen=True)
class LayerFit:
    """One layer's mean error over the calibration windows before and after; kept=False: not lowered, so the
    layer was left as converted."""

    layer: int
    error_before: float
    error_after: float
    kept: bool


def _rms(h: torch.Tensor) -> torch.Tensor:
    """h / sqrt(mean(h^2) + 1e-6) over the last dim (an RMSNorm without gain)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def attention_residual(layer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """m = x + self_attn(input_layernorm(x)), (1, T, E): the residual stream between attention and MLP."""
    out = layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)
    return x + (out[0] if isinstance(out, tuple) else out)


def mlp_residual(layer, m: torch.Tensor) -> torch.Tensor:
    """y = m + mlp(post_attention_layernorm(m)), (1, T, E): the layer's output from its attention residual."""
    return m + layer.mlp(layer.post_attention_layernorm(m))


def halves(layer, x: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, y) of one window: the decoder layer's forward, the residual stream between its halves kept."""
    m = attention_residual(layer, x, kwargs)
    return m, mlp_residual(layer, m)


@dataclass
class Targets:
    """The source layer on its own stream, per window: rms(target) (1, T, E) and the attention residual m
    with the per-token weights 1 / rms(m)^2 (1, T, 1) of the output refit."""

    normalized: list
    residual: list
    weights: list

    @classmethod
    def of(cls, mids: list, outputs: list, target: str) -> Targets:
        weights = [1.0 / (m.pow(2).mean(-1, keepdim=True) + 1e-6) for m in mids]
        return cls([_rms(m if target == "attention" else y) for m, y in zip(mids, outputs)], mids, weights)


def refit_output(layer, inputs: list, targets: Targets, kwargs: dict) -> None:
    """o_proj (and its bias) by ridge least squares given the rest of the attention (the module docstring's
    step 1), in float64."""
    proj = layer.self_attn.o_proj
    seen: list = []
    handle = proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    width = proj.in_features + (proj.bias is not None)
    gram = torch.zeros(width, width, dtype=torch.float64, device=proj.weight.device)
    cross = torch.zeros(proj.out_features, width, dtype=torch.float64, device=proj.weight.device)
    old = proj.weight.detach().double()
    if proj.bias is not None:
        old = torch.cat([old, proj.bias.detach().double()[:, None]], dim=1)  # (E, width)
    try:
        with torch.no_grad():
            for x, m, w in zip(inputs, targets.residual, targets.weights):
                predicted = attention_residual(layer, x, kwargs)  # (1, T, E)
                z = seen.pop().reshape(-1, proj.in_features).double()  # (T, in)
                if proj.bias is not None:
                    z = torch.cat([z, torch.ones_like(z[:, :1])], dim=1)  # (T, width)
                w = w.reshape(-1, 1).double()  # (T, 1)
                residual = (m - predicted).reshape(-1, m.shape[-1]).double()  # m_src - x - O_0 z, (T, E)
                gram += z.T @ (w * z)
                cross += (w * residual).T @ z
    finally:
        handle.remove()
    ridge = OUTPUT_RIDGE * torch.diagonal(gram).mean().clamp_min(1e-30)
    eye = torch.eye(width, dtype=gram.dtype, device=gram.device)
    new = old + torch.linalg.solve(gram + ridge * eye, cross.T).T  # (E, width)
    with torch.no_grad():
        proj.weight.copy_(new[:, : proj.in_features])
        if proj.bias is not None:
            proj.bias.copy_(new[:, -1])


def _predictions(layer, inputs: list, kwargs: dict, target: str, full: bool) -> tuple[list, list | None]:
    """(what the error compares per window, the layer outputs or None): the attention residual alone when
    the target is "attention" and `full` is false, else the whole layer."""
    with torch.no_grad():
        if target == "attention" and not full:
            return [attention_residual(layer, x, kwargs) for x in inputs], None
        both = [halves(layer, x, kwargs) for x in inputs]
    return [m if target == "attention" else y for m, y in both], [y for _, y in both]


def _error(predictions: list, targets: Targets) -> float:
    return sum(float((_rms(p) - t).pow(2).mean()) for p, t in zip(predictions, targets.normalized)) / len(
        predictions
    )


@dataclass(frozen=True)
class FitRule:
    """How a layer is fitted: Adam `steps` at `lr` (one rate) or `relative_lr` x each tensor's RMS (see
    `refine.param_groups`), decaying linearly to 0 if `decay`; the `target` ("attention" or "layer"); the
    closed-form output refit before and after the steps (`refit`)."""

    steps: int
    lr: float | None = None
    relative_lr: float | None = None
    target: str = DEFAULT_TARGET
    refit: bool = False
    decay: bool = False
    step_dtype: str = "float32"

    def __post_init__(self):
        if (self.lr is None) == (self.relative_lr is None):
            raise ValueError(f"give exactly one of lr ({self.lr}) and relative_lr ({self.relative_lr})")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.step_dtype not in STEP_DTYPES:
            raise ValueError(f"step_dtype must be one of {tuple(STEP_DTYPES)}, got {self.step_dtype!r}")


def fit_layer(index: int, layer, inputs: list, targets: Targets, kwargs: dict, rule: FitRule):
    """Fit `layer.self_attn` (the module docstring's steps 1-4); returns (LayerFit, the layer's outputs on
    `inputs` with the weights it keeps: the stream the next layer reads)."""
    from hf_attn.conversion.refine import param_groups  # (refine imports this module)

    attn = layer.self_attn
    with stages.stage("refine error"):
        predictions, outputs = _predictions(layer, inputs, kwargs, rule.target, full=False)
        before = _error(predictions, targets)
    saved = {k: v.clone() for k, v in attn.state_dict().items()}
    if rule.refit:
        with stages.stage("refine update"):
            refit_output(layer, inputs, targets, kwargs)
    params = list(attn.parameters())
    optimizer = torch.optim.Adam(param_groups(params, lr=rule.lr, relative_lr=rule.relative_lr))
    rates = [group["lr"] for group in optimizer.param_groups]
    predict = attention_residual if rule.target == "attention" else _layer_output
    for p in params:
        p.requires_grad_(True)
    with torch.enable_grad():
        for step in range(rule.steps):
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate * (1 - step / rule.steps) if rule.decay else rate
            optimizer.zero_grad(set_to_none=True)
            j = step % len(inputs)
            with stages.stage("refine forward"), _autocast(rule.step_dtype, inputs[j].device):
                predicted = predict(layer, inputs[j], kwargs).float()
                loss = (_rms(predicted) - targets.normalized[j]).pow(2).mean()
            with stages.stage("refine backward"):
                loss.backward()
            with stages.stage("refine update"):
                optimizer.step()
    for p in params:
        p.requires_grad_(False)
    if rule.refit and rule.steps:
        with stages.stage("refine update"):
            refit_output(layer, inputs, targets, kwargs)
    with stages.stage("refine error"):
        predictions, outputs = _predictions(layer, inputs, kwargs, rule.target, full=True)
        after = _error(predictions, targets)
        if after < before:
            return LayerFit(index, before, after, True), outputs
        attn.load_state_dict(saved)
        _, outputs = _predictions(layer, inputs, kwargs, rule.target, full=True)
    return LayerFit(index, before, before, False), outputs


def _autocast(step_dtype: str, device: torch.device):
    """The steps' matmuls in `step_dtype` (torch.autocast; float32: as they are)."""
    dtype = STEP_DTYPES[step_dtype]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def _layer_output(layer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # (1, T, E)
