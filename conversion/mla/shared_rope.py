"""The DeepSeek layout of an MLA conversion: one RoPE key per layer shared by all heads, and a latent RMSNorm.

DeepSeek-V2/V3's MLA caches per token and layer a latent `c` (normalised by `kv_a_layernorm` before
`kv_b_proj` decodes it) and ONE rotated key `k_pe` read by every query head, its frequencies the standard
sequence over `qk_rope_head_dim`. `conversion.mla --layout deepseek` builds that from a Llama-family layer
with two fits, each a small pure float64 function here (the caller casts).

Notation per layer: C hidden size, Hq / Hkv query / KV heads, d head_dim, G = Hq / Hkv, P the kept pairs
(r of the d/2, the same for every layer), d_c the latent width. RoPE rotates pair i (rows i, i + d/2 of a
head) as the complex number z_i = row_i + j row_{i+d/2}, multiplied by exp(j theta_i t); the score term of
pair i is Re(conj(q_i) z_i) (both rotated).

1. The shared key (per kept pair i). The per-head keys z_{g,i} = W_{g,i} x become a_{g,i} z_i with one
   shared z_i = sum_g coef_{g,i} z_{g,i} (a complex combination of the heads' key rows: it commutes with RoPE)
   and per-head complex scales a_{g,i} folded into the query rows of group g
   (q_{h,i} <- conj(a_{g,i}) q_{h,i}, so Re(conj(q') z') = Re(conj(q) a z)). Fitted as calibrated GQA
   pooling fits a group (`conversion.gqa.pooling.fit_keys`): minimise sum_g sum_t w_{g,t,i} |z_{g,t,i} -
   a_{g,i} z_{t,i}|^2, w_{g,t,i} the query power that attention sends to token t through the heads reading
   g (`SharedKeyStatistics`). Exact when the heads' keys of a pair are complex multiples of each other (Hkv =
   1, identical heads). What the shared key misses (the residual z_g - a_g z) is dropped: carrying it in the
   latent would need the un-rotated query rows of the kept pairs as extra query dims (qk_nope_head_dim = d),
   which this layout does not have.
2. The pairs (`progression_pairs`, `choose_stride`): DeepSeek's k_pe rotates by the standard frequency
   sequence of a RoPE base; the source's pairs {0, s, 2s, ..., (r-1)s} are exactly such a sequence (base
   theta^(s r / (d/2)) over 2r dims), so an export needs no padding. The stride s maximises the calibrated
   `attention` pair scores (rope_selection.AttentionPairStats) of the kept pairs summed over layers and heads.
3. The latent norm (`fit_latent_norm`): c_n = gain * c / rms(c), rms(c) = sqrt(mean(c^2) + eps). The
   decoders k_up / v_up are refitted by least squares on calibration inputs for the normalised latent (keys
   centred: a key offset common to all tokens cancels in softmax). The gain is redundant with the decoders
   (a diagonal scale either side), so it is 1 and `down` is scaled so that the mean rms(c) is 1 (eps then
   negligible, c_n ~ c on average); the per-dimension scale of `down` is not redundant (it weighs the rms),
   so two are tried, the factorization's own and equal power per dimension, and the one with the smaller
   error kept. Then (NORM_REFINE_STEPS > 0) the encoder itself is refined by L-BFGS through the norm, the
   decoders re-solved by least squares inside the objective (relative key + value error on the samples);
   kept only if it lowers that error. Exact when rms(c) is the same for every token; otherwise healing
   recovers the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import rotate_half

from hf_attn.conversion.checkpoint.calibration import causal_probabilities
from hf_attn.conversion.gqa.pooling import fit_keys
from hf_attn.conversion.mla import factorization as fac

QUERY_STRIDE = 8  # SharedKeyStatistics weighs keys by the attention of every 8th query of a window (all keys)
SAMPLE_STRIDE = 2  # the latent-norm refit uses the attention inputs of every 2nd calibration token
NORM_REFINE_STEPS = 15  # L-BFGS iterations on the encoder through the latent norm (see fit_latent_norm)
LBFGS_HISTORY = 10  # steps of L-BFGS history in the encoder refinement ...
LBFGS_HISTORY_BYTES = 512 * 1024**2  # ... at most this much memory of it


def progression_pairs(rope_pairs: int, stride: int) -> list[int]:
    """[0, s, 2s, ..., (r - 1) s]."""
    return [j * stride for j in range(rope_pairs)]


def max_stride(half: int, rope_pairs: int) -> int:
    """Largest s with (r - 1) s < d/2 (any s for r <= 1: 1)."""
    return 1 if rope_pairs <= 1 else (half - 1) // (rope_pairs - 1)


def choose_stride(scores: torch.Tensor | None, *, half: int, rope_pairs: int) -> int:
    """The stride whose progression keeps the most score. scores (d/2,) per pair, larger = keep (None: 1,
    the highest frequencies). Ties go to the smaller stride."""
    if scores is None or rope_pairs in (0, half):
        return 1
    assert scores.shape == (half,), (tuple(scores.shape), half)
    strides = range(1, max_stride(half, rope_pairs) + 1)  # max: the first (smallest) of equal totals
    return max(strides, key=lambda s: float(scores[progression_pairs(rope_pairs, s)].sum()))


class SharedKeyStatistics:
    """Per layer S (Hkv, d/2, Hkv, Hkv) complex: S[g, i] = sum_t w_{g,t,i} z_{t,i} z_{t,i}^H, z_{t,i} the Hkv
    complex keys of pair i at token t (before RoPE), w_{g,t,i} = sum_{h reads g} sum_s p^h_{s,t} |q^h_{s,i}|^2
    (the source's attention probabilities of every `query_stride`-th query s of a window)."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, query_stride: int = QUERY_STRIDE):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.query_stride = query_stride
        self.sums: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def add(self, layer: int, x, cos, sin, w_q, b_q, w_k, b_k, *, window: int | None = None) -> None:
        """x (T, C) one window's attention input; cos / sin (T, d); `window` the sliding window or None."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half, group = d // 2, hq // hkv
        x = x.reshape(-1, x.shape[-1]).to(w_q.dtype)  # (T, C)
        T = x.shape[0]
        tq = torch.arange(0, T, self.query_stride)
        Tq = len(tq)
        q = torch.nn.functional.linear(x[tq], w_q, b_q).view(Tq, hq, d)  # (Tq, Hq, d)
        k = torch.nn.functional.linear(x, w_k, b_k).view(T, hkv, d)  # (T, Hkv, d)
        cos, sin = cos.reshape(T, 1, d).to(q.dtype), sin.reshape(T, 1, d).to(q.dtype)
        qr = (q * cos[tq] + rotate_half(q) * sin[tq]).view(Tq, hkv, group, d)  # (Tq, Hkv, G, d), rotated
        kr = k * cos + rotate_half(k) * sin  # (T, Hkv, d)
        p = causal_probabilities(qr, kr, tq, window=window)  # (Hkv, G, Tq, T)
        q_power = (q[..., :half] ** 2 + q[..., half:] ** 2).view(Tq, hkv, group, half)  # (Tq, Hkv, G, d/2)
        w = torch.einsum("gjts,tgji->gsi", p, q_power).double()  # (Hkv, T, d/2)
        z = torch.complex(k[..., :half].double(), k[..., half:].double())  # (T, Hkv, d/2)
        s = torch.einsum("gti,tai,tbi->giab", w.to(torch.complex128), z, z.conj())  # (Hkv, d/2, Hkv, Hkv)
        self.sums[layer] = self.sums[layer] + s if layer in self.sums else s


@dataclass(frozen=True)
class SharedKey:
    """The shared key of one layer on the kept pairs: z_i = sum_g coef[i, g] z_{g,i}; head g's key is
    approximated by scale[i, g] z_i; residual[i]: the weighted error left, relative to the keys' weighted
    power (0 = exact)."""

    pairs: tuple[int, ...]
    coef: torch.Tensor  # (r, Hkv) complex
    scale: torch.Tensor  # (r, Hkv) complex
    residual: torch.Tensor  # (r,) float64


def fit_shared_key(stats: torch.Tensor | None, pairs: list[int], *, iterations: int = 30) -> SharedKey:
    """stats: SharedKeyStatistics.sums[layer], (Hkv, d/2, Hkv, Hkv) complex (None only without pairs);
    pairs: the kept pair indices."""
    hkv = 0 if stats is None else stats.shape[0]
    assert stats is None or stats.shape[2:] == (hkv, hkv), tuple(stats.shape)
    r = len(pairs)
    if r == 0:
        empty = torch.zeros(0, hkv, dtype=torch.complex128)
        return SharedKey(tuple(pairs), empty, empty, torch.zeros(0, dtype=torch.float64))
    s = stats[:, list(pairs)].to(torch.complex128)  # (Hkv, r, Hkv, Hkv)
    coef, scale = fit_keys(s, iterations=iterations)  # (r, Hkv) each
    # residual of head g: v_g^T z with v_g = e_g - scale_g coef; weighted error v_g^T S_g conj(v_g)
    eye = torch.eye(hkv, dtype=torch.complex128)
    v = eye[None] - scale[:, :, None] * coef[:, None, :]  # (r, Hkv_g, Hkv)
    err = torch.einsum("iga,giab,igb->i", v, s, v.conj()).real  # (r,)
    own = sum(s[g, :, g, g].real for g in range(hkv))  # (r,): sum_g sum_t w_{g,t} |z_{g,t}|^2
    return SharedKey(tuple(pairs), coef, scale, (err / own.clamp_min(1e-300)).clamp_min(0.0))


def complex_rows(rows: torch.Tensor, r: int) -> torch.Tensor:
    """Rope-first rows of one head (2r, K): rows [P | P + d/2] -> (r, K) complex."""
    return torch.complex(rows[:r].double(), rows[r:].double())


def real_rows(z: torch.Tensor) -> torch.Tensor:
    """Inverse of `complex_rows`: (r, K) complex -> (2r, K)."""
    return torch.cat([z.real, z.imag], 0)


def share_rope_rows(
    *, q_rope: torch.Tensor, k_rope: torch.Tensor, key: SharedKey
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a fitted shared key to the rope-first rows of one layer.

    q_rope (Hq, 2r, K), k_rope (Hkv, 2r, K): the kept pairs' rows [P | P + d/2] of every head (K = C, or C + 1
    with the bias as the last column). Returns (Hq, 2r, K) query rows, head h scaled by conj(scale[:, h // G])
    per pair, and the shared key rows (2r, K)."""
    hq, hkv, r = q_rope.shape[0], k_rope.shape[0], len(key.pairs)
    assert q_rope.shape[1] == k_rope.shape[1] == 2 * r and hq % hkv == 0, (q_rope.shape, k_rope.shape, r)
    group = hq // hkv
    kc = torch.stack([complex_rows(k_rope[g], r) for g in range(hkv)])  # (Hkv, r, K)
    shared = torch.einsum("ig,gik->ik", key.coef, kc)  # (r, K)
    q_out = torch.stack(
        [real_rows(key.scale[:, h // group].conj()[:, None] * complex_rows(q_rope[h], r)) for h in range(hq)]
    )  # (Hq, 2r, K)
    return q_out, real_rows(shared)


def rms_normalize(c: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """gain * c / sqrt(mean(c^2) + eps) over the last dim (an RMSNorm, in float64)."""
    c = c.double()
    return gain.double() * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class LatentNorm:
    """keys ~ up_k rms_normalize(down x, gain) (+ up_bias_k), values likewise; errors relative to the
    targets' power on the calibration sample (keys centred)."""

    down: torch.Tensor  # (d_c, C)
    gain: torch.Tensor  # (d_c,)
    up_k: torch.Tensor  # (nk, d_c)
    up_v: torch.Tensor  # (nv, d_c)
    bias_k: torch.Tensor | None  # (nk,) or None
    bias_v: torch.Tensor | None  # (nv,) or None
    key_error: float
    value_error: float
    scaling: str  # which per-dimension scale of `down` was kept


def _decoders(x, down, gain, eps, y_k, y_v, pk, pv, biased: bool) -> tuple:
    """The least-squares decoders of the normalised latent of `down` (keys from the centred latent, values
    with a bias column when `biased`): (key error, value error, relative to pk / pv; the latent (N, d_c);
    up_k (nk, d_c); up_v (nv, d_c); the value bias (nv,) or None)."""
    cn = rms_normalize(x @ down.T, gain, eps)  # (N, d_c)
    design_v = torch.cat([cn, torch.ones_like(cn[:, :1])], 1) if biased else cn
    ck = cn - cn.mean(0)
    # B minimising sum_t |y_t - B c_t|^2 (relative ridge) from the sums c^T y and c^T c of the samples
    up_k = fac.lstsq_decoder((ck.T @ y_k).T, ck.T @ ck)  # (nk, d_c)
    dec_v = fac.lstsq_decoder((design_v.T @ y_v).T, design_v.T @ design_v)  # (nv, d_c [+1])
    ek = (y_k - ck @ up_k.T).pow(2).sum() / pk
    ev = (y_v - design_v @ dec_v.T).pow(2).sum() / pv
    up_v, bias_v = (dec_v[:, :-1], dec_v[:, -1]) if biased else (dec_v, None)
    return ek, ev, cn, up_k, up_v, bias_v


def fit_latent_norm(
    *,
    down: torch.Tensor,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    w_v: torch.Tensor,
    b_v: torch.Tensor | None,
    samples: torch.Tensor,
    eps: float,
    refine_steps: int = 0,
) -> LatentNorm:
    """Decoders for the normalised latent. down (d_c, C) the factorization's encoder; w_k (nk, C) and w_v
    (nv, C) the source's non-RoPE key rows and value rows (biases (out,) or None: with biases the decoders
    get one); samples (N, C) calibration inputs of the layer. See the module docstring. The encoder's
    refinement (`refine_steps`) runs only with more samples than inputs (N > C); below that it is
    underdetermined, and at 7B it would hold several (d_c, C) float64 copies for nothing."""
    x = samples.double()
    down = down.double()
    w_k, w_v = w_k.double(), w_v.double()
    biased = b_k is not None or b_v is not None
    y_k = x @ w_k.T + (b_k.double() if b_k is not None else 0.0)  # (N, nk)
    y_v = x @ w_v.T + (b_v.double() if b_v is not None else 0.0)  # (N, nv)
    y_k = y_k - y_k.mean(0)  # keys centred: a common offset cancels in softmax
    pk, pv = y_k.pow(2).sum().clamp_min(1e-300), y_v.pow(2).sum().clamp_min(1e-300)
    candidates = {"factorization": torch.ones(down.shape[0], dtype=torch.float64)}
    candidates["equal-power"] = (x @ down.T).pow(2).mean(0).clamp_min(1e-300).rsqrt()  # of c (N, d_c)
    best = None
    for name, dim_scale in candidates.items():
        d_s = dim_scale[:, None] * down  # (d_c, C)
        c = x @ d_s.T  # (N, d_c)
        d_s = d_s / c.pow(2).mean(-1).mean().sqrt().clamp_min(1e-300)  # mean rms(c) ~ 1 (mean square)
        gain = torch.ones(down.shape[0], dtype=torch.float64)
        ek, ev, cn, up_k, up_v, bias_v = _decoders(x, d_s, gain, eps, y_k, y_v, pk, pv, biased)
        bias_k = None
        if biased:  # keys: reproduce the source's mean too (harmless, and exact where the rest is)
            mean_k = (x @ w_k.T).mean(0) + (b_k.double() if b_k is not None else 0.0)
            bias_k = mean_k - up_k @ cn.mean(0)
        fit = LatentNorm(d_s, gain, up_k, up_v, bias_k, bias_v, float(ek), float(ev), name)
        if best is None or fit.key_error + fit.value_error < best.key_error + best.value_error:
            best = fit
    if refine_steps and x.shape[0] > x.shape[1]:  # fewer samples than inputs: the encoder is underdetermined
        best = _refine(best, x, y_k, y_v, pk, pv, eps, biased, refine_steps)
    return best


def _refine(fit: LatentNorm, x, y_k, y_v, pk, pv, eps, biased, steps: int) -> LatentNorm:
    """L-BFGS on the encoder (the decoders re-solved by least squares inside the objective): minimise the
    relative key + value error through the norm."""
    with torch.inference_mode(False):  # convert_layer runs in inference mode; autograd needs normal tensors
        x, y_k, y_v, pk, pv = (t.clone() for t in (x, y_k, y_v, pk, pv))
        down = fit.down.clone().requires_grad_(True)
        gain = fit.gain.clone()
        # L-BFGS keeps 2 vectors the size of `down` per step of history: capped by bytes (a 7B layer's `down`
        # is ~128 MB in float64), so SmolLM2 keeps all 10 steps and a 7B layer a few
        history = max(1, min(LBFGS_HISTORY, LBFGS_HISTORY_BYTES // (2 * down.numel() * down.element_size())))
        opt = torch.optim.LBFGS([down], max_iter=steps, history_size=history, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            ek, ev, *_ = _decoders(x, down, gain, eps, y_k, y_v, pk, pv, biased)
            loss = ek + ev
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        with torch.no_grad():
            d = down.detach()
            d = d / (x @ d.T).pow(2).mean(-1).mean().sqrt().clamp_min(1e-300)
            ek, ev, cn, up_k, up_v, bias_v = _decoders(x, d, gain, eps, y_k, y_v, pk, pv, biased)
        if float(ek + ev) >= fit.key_error + fit.value_error:
            return fit
        bias_k = None
        if biased:  # the same mean key as the unrefined fit
            mean_c = rms_normalize(x @ fit.down.T, gain, eps).mean(0)
            bias_k = fit.bias_k + fit.up_k @ mean_c - up_k @ cn.mean(0)
        return LatentNorm(d, gain, up_k, up_v, bias_k, bias_v, float(ek), float(ev), fit.scaling + "+refined")
