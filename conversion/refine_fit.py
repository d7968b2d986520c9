"""One layer of the refinement (`conversion.refine`): the fit of a converted decoder layer's attention to the
source layer's output, given the hidden states that enter it.

Notation: x (1, T, E) a window's hidden states entering the converted layer, m the residual stream after
its attention and y the layer's output:

    m = x + attn(input_layernorm(x))         y = m + mlp(post_attention_layernorm(m))
    rms(h) = h / sqrt(mean(h^2) + 1e-6)      (over E: what the next RMSNorm reads, without its gain)

The target is the source layer's y on the source's own stream (target "layer"), or its m (target "attention":
the steps then run neither the MLP nor its backward, at a measured cost in quality). A layer's error is mean
|rms(prediction) - rms(target)|^2 over every token of every 2nd window (windows 0, 2, ...:
KEEP_WINDOW_STRIDE), in float32. The fit: `steps` Adam steps on all `self_attn` parameters, step k on window k
mod N; each step's loss covers every `loss_stride`-th position of its window, the offset advancing with each
visit of the window (the MLP acts per position, so it runs on those positions alone, and the attention is
computed for those queries alone, over every key: the loss reads nothing else). The matmuls of the steps and
of the errors run in `step_dtype` (torch.autocast); their outputs are added to float32 hidden states, so the
errors stay float32. The weights are kept only if they lower the error (an exact conversion is left as it is).
The weights as converted are evaluated on the error's windows alone; after the fit every window runs once, for
the error and for the stream the next layer reads (again from the converted weights where the fit is not
kept).
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from hf_attn.attention.grouped import grouped_attention
from hf_attn.conversion import stages
from hf_attn.conversion.specs import STEP_DTYPES
from hf_attn.tooling.devices import native_bfloat16


@dataclass(frozen=True)
class LayerFit:
    """One layer's error (the module docstring) before and after; kept=False: not lowered, so the layer was
    left as converted."""

    layer: int
    error_before: float
    error_after: float
    kept: bool


@dataclass(frozen=True)
class FitRule:
    """How a layer is fitted (the module docstring): Adam `steps` at `lr` (one rate) or `relative_lr` x each
    tensor's RMS (`param_groups`), the `target`, each step's `loss_stride` and `step_dtype` (the values
    `refine.check_settings` checked)."""

    steps: int
    lr: float | None = None
    relative_lr: float | None = None
    target: str = "layer"
    loss_stride: int = 1
    step_dtype: str = "float32"

    def __post_init__(self):
        if (self.lr is None) == (self.relative_lr is None):
            raise ValueError(f"give exactly one of lr ({self.lr}) and relative_lr ({self.relative_lr})")


def _rms(h: torch.Tensor) -> torch.Tensor:
    """h / sqrt(mean(h^2) + 1e-6) over the last dim (an RMSNorm without gain)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def attention_residual(layer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """m = x + self_attn(input_layernorm(x)), (1, T, E): the residual stream between attention and MLP."""
    out = layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)
    return x + (out[0] if isinstance(out, tuple) else out)


def mlp_residual(layer, m: torch.Tensor) -> torch.Tensor:
    """y = m + mlp(post_attention_layernorm(m)): the layer's output from its attention residual."""
    return m + layer.mlp(layer.post_attention_layernorm(m))


def halves(layer, x: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, y) of one window: the decoder layer's forward, the residual stream between its halves kept."""
    m = attention_residual(layer, x, kwargs)
    return m, mlp_residual(layer, m)


def targets_of(mids: list, outputs: list, target: str) -> list:
    """rms(the source layer's m or y) per window, (1, T, E) each: what the error compares with."""
    return [_rms(m if target == "attention" else y) for m, y in zip(mids, outputs, strict=True)]


def resolve_step_dtype(step_dtype: str, device: torch.device) -> str:
    """The dtype a `step_dtype` names: "auto" is "bfloat16" where `device` runs it natively
    (`devices.native_bfloat16`), else "float32"."""
    if step_dtype != "auto":
        return step_dtype
    return "bfloat16" if native_bfloat16(device) else "float32"


def autocast(device: torch.device, step_dtype: str):
    """The matmuls of the refinement in `step_dtype` (torch.autocast; a no-op for float32): their outputs are
    added to float32 hidden states, so the stream and the errors stay float32."""
    dtype = STEP_DTYPES[step_dtype]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def frozen_linears_to(module: torch.nn.Module, step_dtype: str, *, skip: torch.nn.Module | None = None):
    """Cast the linear layers of `module` (outside `skip`, the part being trained) to `step_dtype` once, in
    place. Under autocast a float32 weight is cast at every matmul (its cache keeps trainable weights
    alone), and this is the same rounding done once: the matmuls keep their bits. No-op for float32."""
    dtype = STEP_DTYPES[step_dtype]
    if dtype == torch.float32:
        return
    skipped = set() if skip is None else set(skip.modules())
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub not in skipped:
            sub.to(dtype)


def _evaluate(layer, inputs: list, targets: list, kwargs: dict, rule: FitRule) -> tuple[list, list]:
    """(each window's error, the layer's outputs y: the stream the next layer reads, float32)."""
    errors, outputs = [], []
    with torch.no_grad(), autocast(inputs[0].device, rule.step_dtype):
        for x, t in zip(inputs, targets, strict=True):
            m, y = halves(layer, x, kwargs)  # (1, T, E) float32 each: x + bf16 increments
            errors.append(float((_rms(m if rule.target == "attention" else y) - t).pow(2).mean()))
            outputs.append(y)
    return errors, outputs


def _step_prediction(layer, x: torch.Tensor, kwargs: dict, rule: FitRule, visit: int):
    """(what a step's loss compares, (1, T', E); the window positions it covers): the attention residual
    (target "attention"), or the layer's output on every `loss_stride`-th position from `visit` mod stride,
    its attention computed for those queries alone (`strided_queries_attention`)."""
    if rule.target == "attention":
        return attention_residual(layer, x, kwargs), slice(None)
    positions = slice(visit % rule.loss_stride, None, rule.loss_stride)
    if rule.loss_stride == 1:
        return mlp_residual(layer, attention_residual(layer, x, kwargs)), positions
    with _query_side_at(layer.self_attn, positions):
        m = attention_residual(layer, x, {**kwargs, "query_rows": positions})  # (1, T, E), right there
    return mlp_residual(layer, m[:, positions]), positions


QUERY_SIDE = ("q_proj", "o_proj")  # the projections whose rows are the query positions' alone


class _AtRows(torch.nn.Module):
    """`linear` applied to the positions `rows` of its input (B, T, in) alone: (B, T, out), zero elsewhere."""

    def __init__(self, linear: torch.nn.Linear, rows: slice):
        super().__init__()
        self.linear, self.rows = linear, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x[:, self.rows])  # (B, Tq, out)
        out = y.new_zeros(*x.shape[:-1], y.shape[-1])  # (B, T, out)
        out[:, self.rows] = y
        return out


@contextmanager
def _query_side_at(attn, rows: slice):
    """The attention computed by STRIDED (`strided_queries_attention`), its query and output projections
    (QUERY_SIDE) on the positions `rows` alone: a strided step reads no other query and no other output row,
    so the other rows' matmuls (half of these two at stride 2, forward and backward) are skipped. Their
    parameters are the same tensors."""
    implementation, attn.config._attn_implementation = attn.config._attn_implementation, STRIDED
    linears = {n: getattr(attn, n) for n in QUERY_SIDE if isinstance(getattr(attn, n, None), torch.nn.Linear)}
    for name, linear in linears.items():
        setattr(attn, name, _AtRows(linear, rows))
    try:
        yield
    finally:
        for name, linear in linears.items():
            setattr(attn, name, linear)
        attn.config._attn_implementation = implementation


KEEP_WINDOW_STRIDE = 2  # the keep rule's error: every 2nd calibration window (the module docstring)
QUERY_CHUNKS = 4  # query chunks of `strided_queries_attention` without a mask (its docstring)


def strided_queries_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, query_rows, **kwargs
):
    """The attention contract (`fn(module, query, key, value, attention_mask, ...) -> (out, None)`) for the
    query positions `query_rows` (a slice) alone: query (B, Hq, T, D), key (B, Hkv, S, D), value
    (B, Hkv, S, Dv) -> out (B, T, Hq, Dv), zero at the other positions. Causal, bottom-right aligned, within
    `sliding_window` if given, or the rows of `attention_mask` (boolean or additive) where there is one.
    Without a mask the queries go in QUERY_CHUNKS chunks, each over the keys up to its last query (the later
    keys are masked for every query of the chunk, so the softmax over the keys kept is the same): the chunks
    skip most of the causal triangle's empty half. Each chunk is `grouped_attention`'s explicit path (matmuls,
    a float32 softmax, no K/V copies): on a 2-core CPU in bfloat16, forward and backward run 1.3-1.6x faster
    than one masked `scaled_dot_product_attention` call at these sizes (`python -m
    benchmarks.strided_attention`)."""
    b, hq, t, _ = query.shape
    s = key.shape[2]
    rows = torch.arange(t, device=query.device)[query_rows]  # (Tq,)
    outs = []
    for chunk in rows.chunk(QUERY_CHUNKS if attention_mask is None else 1):  # each (Tc,)
        at = chunk[:, None] + (s - t)  # (Tc, 1): each query's own key position
        seen = s if attention_mask is not None else int(at[-1]) + 1  # keys any query of the chunk reads
        if attention_mask is not None:
            mask = attention_mask[..., chunk, :]  # (B or 1, 1, Tc, S)
        else:
            keys = torch.arange(seen, device=query.device)[None]  # (1, S')
            mask = keys <= at  # (Tc, S')
            window = kwargs.get("sliding_window")
            if window is not None:
                mask &= at - keys < window
        q, k, v = query[:, :, chunk], key[:, :, :seen], value[:, :, :seen]  # (B, Hq, Tc, D), (B, Hkv, S', D)
        outs.append(grouped_attention(q, k, v, mask, scaling=scaling, dropout_p=dropout, backend="explicit"))
    out = torch.cat(outs, dim=1)  # (B, Tq, Hq, Dv)
    full = out.new_zeros(b, t, hq, value.shape[-1])
    full[:, rows] = out
    return full, None


def param_groups(params: list, *, lr: float | None, relative_lr: float | None) -> list[dict]:
    """Adam parameter groups: one rate `lr`, or `relative_lr` x each tensor's RMS (see `fit_layer`; an
    all-zero tensor gets the median tensor's rate). Healing's `--relative-lr` uses it too."""
    if lr is not None:
        return [{"params": params, "lr": lr}]
    rms = [float(p.detach().pow(2).mean().sqrt()) for p in params]
    fallback = statistics.median([r for r in rms if r > 0] or [1.0])
    return [{"params": [p], "lr": relative_lr * (r or fallback)} for p, r in zip(params, rms, strict=True)]


STRIDED = "hf_attn_strided_queries"  # the refinement's own attention implementation (registered here)
AttentionInterface.register(STRIDED, strided_queries_attention)


def fit_layer(index: int, layer, inputs: list, targets: list, kwargs: dict, rule: FitRule):
    """Fit `layer.self_attn` to `targets` (the module docstring); returns (LayerFit, the layer's outputs on
    `inputs` with the weights it keeps: the stream the next layer reads)."""
    attn = layer.self_attn
    checked = slice(None, None, KEEP_WINDOW_STRIDE)  # the windows the keep rule compares
    with stages.stage("refine error"):
        before = statistics.fmean(_evaluate(layer, inputs[checked], targets[checked], kwargs, rule)[0])
    saved = {k: v.clone() for k, v in attn.state_dict().items()}
    params = list(attn.parameters())
    groups = param_groups(params, lr=rule.lr, relative_lr=rule.relative_lr)
    optimizer = torch.optim.Adam(groups, fused=True)  # one kernel per group: 6x the per-tensor loop on a CPU
    attn.requires_grad_(True)
    with torch.enable_grad():
        for step in range(rule.steps):
            optimizer.zero_grad(set_to_none=True)
            j = step % len(inputs)
            with stages.stage("refine forward"), autocast(inputs[0].device, rule.step_dtype):
                predicted, positions = _step_prediction(layer, inputs[j], kwargs, rule, step // len(inputs))
                loss = (_rms(predicted.float()) - targets[j][:, positions]).pow(2).mean()
            with stages.stage("refine backward"):
                loss.backward()
            with stages.stage("refine update"):
                optimizer.step()
    attn.requires_grad_(False)
    with stages.stage("refine error"):
        errors, outputs = _evaluate(layer, inputs, targets, kwargs, rule)
    after = statistics.fmean(errors[checked])
    if after < before:
        return LayerFit(index, before, after, True), outputs
    attn.load_state_dict(saved)
    with stages.stage("refine error"):  # the stream again, from the weights as converted
        outputs = _evaluate(layer, inputs, targets, kwargs, rule)[1]
    return LayerFit(index, before, before, False), outputs
