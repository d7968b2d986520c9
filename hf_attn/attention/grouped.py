"""Grouped attention (MHA / GQA / MQA) that never materialises repeated K/V.

Shape notation used throughout this module:
    B    batch size
    T    query length (prefill: the prompt; decode: 1 or a few tokens against a cache)
    S    key/value length (cache length, including the current tokens)
    Hq   query heads, Hkv key/value heads, G = Hq // Hkv the group size (1: MHA, Hq: MQA)
    D    query/key head dim, Dv value head dim (Dv may differ from D, as in MLA's absorbed path)

Query head h reads KV head h // G (transformers' `repeat_kv` order), so the query tensor is viewed as
(B, Hkv, G, T, D) against un-expanded (B, Hkv, S, D) keys/values. Two paths compute the same function:

* fused: torch's `scaled_dot_product_attention` on grouped views. Short queries (decode) pack the group into
  the query axis, (B, Hkv, G*T, D), so every KV head is read once; longer ones use `enable_gqa=True`. Chosen
  only when torch reports a fused kernel for the call (its math fallback would repeat K/V), e.g. torch's CPU
  flash kernel, which accumulates fp16/bf16 in fp32 and takes boolean, additive and per-head masks.
* explicit: matmuls on the grouped views, softmax in fp32 (fp64 stays fp64), dropout, key and value head dims
  that differ. Used for everything the fused kernel does not take.

Both give zeros, never NaN, for query rows whose every key is masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from transformers.masking_utils import sdpa_mask

__all__ = ["grouped_attention", "grouped_attention_forward", "grouped_attention_mask"]

_BACKENDS = ("auto", "fused", "explicit")
_FUSED_OK = {
    int(SDPBackend.FLASH_ATTENTION),
    int(SDPBackend.EFFICIENT_ATTENTION),
    int(SDPBackend.CUDNN_ATTENTION),
}
_HAS_ENABLE_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)
# Up to this many query rows per KV head (G * T) the fused path packs the group into the query axis, reading
# each KV head once at the price of a G-fold copy of the mask rows. Measured on this project's 2-core AVX-512
# CPU (torch 2.13, fp32, 1 thread, S = 1k..16k, G = 3 and 9): 1.1-6x faster than enable_gqa up to 36 rows,
# a wash from 48 rows on. Longer queries use enable_gqa (no copies).
_PACK_MAX_ROWS = 36


def grouped_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention function registered as `hf_attn_grouped`.

    Shapes:
        query           (B, Hq, T, D)
        key             (B, Hkv, S, D)
        value           (B, Hkv, S, Dv)
        attention_mask  None, or bool (True = attend) / additive float, broadcastable to (B, 1, T, S)
                        or (B, Hq, T, S)
        returns         ((B, T, Hq, Dv) contiguous, None)

    With no mask the module is causal iff `kwargs["is_causal"]` (when given) or `module.is_causal` (default
    True) says so and T > 1; the causal mask is then aligned bottom-right: query t sees keys s <= t + S - T.
    Dropout applies only while `module.training`.
    """
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    dropout_p = dropout if getattr(module, "training", False) else 0.0
    out = grouped_attention(
        query, key, value, attention_mask, scaling=scaling, is_causal=bool(is_causal), dropout_p=dropout_p
    )
    return out, None


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped scaled-dot-product attention; returns the output in the layout the model consumes.

    Shapes:
        query           (B, Hq, T, D)
        key             (B, Hkv, S, D)      Hq % Hkv == 0, G = Hq // Hkv
        value           (B, Hkv, S, Dv)
        attention_mask  None, or bool (True = attend) / additive float, broadcastable to (B, Hq, T, S)
                        with a head axis of 1 or Hq (missing leading axes are broadcast)
        returns         (B, T, Hq, Dv) contiguous, in query's dtype

    `is_causal` applies only when `attention_mask` is None and T > 1 (bottom-right aligned: query t sees keys
    s <= t + S - T). `scaling` defaults to D ** -0.5. `backend` is "auto" (fused kernel when torch has one for
    the call, else explicit), "fused" (fail if none) or "explicit".
    """
    B, Hq, T, D, Hkv, S, Dv = _check_shapes(query, key, value)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    scale = D**-0.5 if scaling is None else float(scaling)
    mask = _check_mask(attention_mask, B, Hq, T, S)
    causal = mask is None and is_causal and T > 1
    if T == 0 or S == 0:  # nothing to attend to: every row is fully masked
        return query.new_zeros(B, T, Hq, Dv)

    if backend != "explicit":
        out = _fused(query, key, value, mask, causal, scale, dropout_p, require=backend == "fused")
        if out is not None:
            return out
    if causal:
        mask = _bottom_right_causal(T, S, query.device)
    return _explicit(query, key, value, mask, scale, dropout_p)


def grouped_attention_mask(batch_size, q_length, kv_length, *, allow_is_causal_skip=True, **kwargs):
    """Mask function registered with `AttentionMaskInterface` for `hf_attn_grouped`: transformers'
    `sdpa_mask`, a boolean (B, 1, T, S) mask, or None where a plain causal rule suffices.

    `sdpa_mask` may return None for a prefill into a longer static cache (S > T, empty slots at the end),
    relying on torch's top-left `is_causal`. This kernel reads a missing mask as bottom-right causal (right
    for decoding against a cache), so a mask is skipped only where both alignments agree: T == 1 or T == S.
    """
    if q_length > 1 and kv_length != q_length:
        allow_is_causal_skip = False
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def _check_shapes(query, key, value):
    """Validate query/key/value shapes; returns B, Hq, T, D, Hkv, S, Dv."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "expected 4-D query (B, Hq, T, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv); got "
            + _shapes(query, key, value)
        )
    B, Hq, T, D = query.shape
    Bk, Hkv, S, Dk = key.shape
    Bv, Hv, Sv, Dv = value.shape
    if not (B == Bk == Bv):
        raise ValueError(
            f"batch sizes differ ({B}, {Bk}, {Bv}) in {_shapes(query, key, value)}; make them equal"
        )
    if Hkv != Hv:
        raise ValueError(
            f"key has {Hkv} heads but value has {Hv} in {_shapes(query, key, value)}; make them equal"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"query heads ({Hq}) must be a positive multiple of key/value heads ({Hkv}) in "
            f"{_shapes(query, key, value)}; check num_attention_heads / num_key_value_heads"
        )
    if S != Sv:
        raise ValueError(f"key length {S} differs from value length {Sv} in {_shapes(query, key, value)}")
    if D != Dk:
        raise ValueError(f"query head dim {D} differs from key head dim {Dk} in {_shapes(query, key, value)}")
    return B, Hq, T, D, Hkv, S, Dv


def _shapes(query, key, value):
    return f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"


def _check_mask(mask, B, Hq, T, S):
    """Validate a mask and return it as a 4-D tensor broadcastable to (B, Hq, T, S) (a view), or None."""
    if mask is None:
        return None
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise ValueError(f"attention_mask must be bool (True = attend) or additive float, not {mask.dtype}")
    if mask.dim() > 4:
        raise ValueError(f"attention_mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (b, h, t, s), a view
    b, h, t, s = mask.shape
    if b not in (1, B) or h not in (1, Hq) or t not in (1, T) or s not in (1, S):
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, T, S) = "
            f"({B}, {Hq}, {T}, {S}); give it shape (B, 1, T, S) or (B, Hq, T, S)"
        )
    return mask


def _bottom_right_causal(T, S, device):
    """Causal mask for T queries that are the last T of S positions: query t sees keys s <= t + S - T."""
    s, t = torch.arange(S, device=device), torch.arange(T, device=device)
    keep = s[None, :] <= t[:, None] + (S - T)  # (T, S)
    return keep[None, None]  # (1, 1, T, S)


def _fused(query, key, value, mask, causal, scale, dropout_p, require):
    """torch's fused SDPA on grouped views, or None when torch has no fused kernel for this call."""
    B, Hq, T, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    pack = G == 1 or G * T <= _PACK_MAX_ROWS
    if causal and (S != T or (pack and G > 1)):
        # torch's is_causal is top-left aligned (this contract is bottom-right), and packed rows need a mask.
        mask, causal = _bottom_right_causal(T, S, query.device), False

    if pack:
        # Few query rows per group: pack the group into the query axis so that each KV head is read once.
        q = query.reshape(B, Hkv, G * T, D)  # (B, Hkv, G*T, D)
        m = None if mask is None else _pack_mask(mask, Hkv, G, T)  # (b, Hkv|1, G*T, s)
        gqa_kwargs = {}
    else:
        # Many query rows: enable_gqa lets every query head read its KV head in place.
        if not _HAS_ENABLE_GQA:
            return _fail(require, "torch < 2.5 has no enable_gqa")
        q, m, gqa_kwargs = query, mask, {"enable_gqa": True}  # (B, Hq, T, D) against (B, Hkv, S, D)

    choice = torch._fused_sdp_choice(q, key, value, m, dropout_p, causal, scale=scale, **gqa_kwargs)
    if int(choice) not in _FUSED_OK:
        return _fail(require, f"no fused SDPA kernel for this call (torch chose {SDPBackend(choice)})")
    out = F.scaled_dot_product_attention(
        q, key, value, attn_mask=m, dropout_p=dropout_p, is_causal=causal, scale=scale, **gqa_kwargs
    )  # (B, Hkv, G*T, Dv) or (B, Hq, T, Dv)
    out = out.reshape(B, Hq, T, Dv)  # (B, Hq, T, Dv)
    if mask is not None and out.device.type != "cpu":
        # Rows with no visible key must give zeros. torch's CPU flash kernel does so itself (the tests check
        # it through this path); other devices' kernels are not relied on.
        out = out.masked_fill(_fully_masked_rows(mask), 0.0)
    return out.transpose(1, 2).contiguous()  # (B, T, Hq, Dv)


def _pack_mask(mask, Hkv, G, T):
    """A (b, h, t, s) mask over (B, Hq, T, S) scores -> (b, Hkv|1, G*T, s) over queries packed as
    (B, Hkv, G*T, D). A view when T == 1 or G == 1, else a copy of G*T rows (at most _PACK_MAX_ROWS)."""
    b, h, t, s = mask.shape
    if h == 1 and t == 1:
        return mask  # (b, 1, 1, s): one row shared by every packed query
    m = mask.reshape(b, Hkv, G, t, s) if h != 1 else mask.unsqueeze(2)  # (b, Hkv|1, G|1, t, s)
    m = m.expand(b, m.shape[1], G, T, s)  # (b, Hkv|1, G, T, s)
    return m.reshape(b, m.shape[1], G * T, s)  # (b, Hkv|1, G*T, s)


def _fail(require, why):
    if require:
        raise RuntimeError(f"backend='fused' requested but {why}")
    return None


def _fully_masked_rows(mask):
    """(b, h, t, 1) bool: True where every key of the row is masked out."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def _explicit(query, key, value, mask, scale, dropout_p):
    """Grouped attention with explicit matmuls; softmax in fp32 (fp64 for fp64 inputs)."""
    B, Hq, T, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32

    q = query.reshape(B, Hkv, G * T, D).to(ct)  # (B, Hkv, G*T, D)
    scores = torch.matmul(q, key.to(ct).transpose(-1, -2))  # (B, Hkv, G*T, S)
    scores = scores.mul_(scale).view(B, Hkv, G, T, S)  # (B, Hkv, G, T, S)
    if mask is not None:
        b, h, t, s = mask.shape
        m = mask.reshape(b, Hkv, G, t, s) if h == Hq else mask.unsqueeze(2)  # (b, Hkv|1, G|1, t, s)
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.to(ct)

    # Softmax that gives all-zero probabilities (not NaN) for rows where every key is masked.
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (B, Hkv, G, T, 1)
    row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
    probs = torch.exp(scores - row_max)  # (B, Hkv, G, T, S)
    denom = probs.sum(dim=-1, keepdim=True)  # (B, Hkv, G, T, 1)
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)

    out = torch.matmul(probs.view(B, Hkv, G * T, S), value.to(ct))  # (B, Hkv, G*T, Dv)
    out = out.view(B, Hq, T, Dv).to(query.dtype)  # (B, Hq, T, Dv)
    return out.transpose(1, 2).contiguous()  # (B, T, Hq, Dv)
