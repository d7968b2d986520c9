"""Partial RoPE for MLA conversion: which r of the d/2 frequency pairs each KV head keeps rotating (MHA2MLA).

RoPE (rotate-half layout) rotates pair i = (row i, row i + d/2) of every head by the angle t * inv_freq[i];
pair 0 has the highest frequency. The MLA latent cannot rotate, so each KV head keeps RoPE on r pairs only
(its `k_rope`, cached after rotation) and the other d/2 - r pairs become position-free ("nope") and join the
low-rank latent. Selections, each `[num_layers][Hkv][r]` lists of sorted pair indices:

- `high`: pairs 0..r-1, the highest frequencies, the same for every layer and head.
- `uniform`: r pairs evenly spaced over the spectrum, j * (d/2) // r for j < r (always including pair 0).
- `2norm`: per layer and KV head, the r pairs with the largest mean ||q_pair|| * ||k_pair|| on calibration
  text, the query norm averaged over the head's group of query heads. ||q_i|| ||k_i|| bounds the pair's
  contribution |q_i . R k_i| to a score whatever the rotation R, and pair norms are rotation-invariant, so
  the un-rotated projections suffice.
- `attention` (beyond MHA2MLA): per layer and KV head, the r pairs whose loss of rotation would change the
  attention scores most, measured on calibration text under the source's own attention probabilities
  (`AttentionPairStats`): for every dropped pair the query rows are also refitted with the complex factor
  alpha that best reproduces the rotated score term from the un-rotated one (a 2x2 mix of the query rows
  i and i + d/2, i.e. an average rotation and damping, per query head), and the pairs kept are those whose
  error remains largest after that fit. Frequency, norm and how far each head looks all enter (the
  selections are compared in the README's MLA curve).
"""

from __future__ import annotations

import torch

from hf_attn.conversion.checkpoint.calibration import causal_probabilities
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.specs import CALIBRATED_SELECTIONS
from hf_attn.models.llama_mla.modeling_llama_mla import rope_dim_indices

QUERY_STRIDE = 32  # `attention` statistics use every 32nd query of each calibration window (all keys)


def top_pairs(scores: torch.Tensor, rope_pairs: int) -> list[list[int]]:
    """Per KV head the r pairs of largest score, sorted ascending. scores (Hkv, d/2) -> [Hkv][r]."""
    assert scores.dim() == 2 and rope_pairs <= scores.shape[1], (tuple(scores.shape), rope_pairs)
    # stable tie-break towards high frequencies: sort by (-score, index)
    order = torch.argsort(-scores.double(), dim=1, stable=True)  # (Hkv, d/2)
    return [sorted(row[:rope_pairs].tolist()) for row in order]


def select_rope_pairs(
    selection: str,
    geometry: AttentionGeometry,
    rope_pairs: int,
    scores: dict[int, torch.Tensor] | None = None,
) -> list[list[list[int]]]:
    """`[num_layers][Hkv][r]` kept pairs, each list strictly ascending. `scores` (layer -> (Hkv, d/2), larger
    = keep) is required by the calibrated selections (`2norm`: `PairNormScores.scores()`, `attention`:
    `AttentionPairStats`); the selection (one of SELECTIONS) and r are checked by the caller (`MLASpec`,
    `ranks.plan_shape`)."""
    half, num_layers = geometry.head_dim // 2, geometry.num_layers
    if selection in CALIBRATED_SELECTIONS:
        if scores is None or sorted(scores) != list(range(num_layers)):
            raise ValueError(f"rope selection {selection!r} needs calibration scores for every layer.")
        return [top_pairs(scores[i], rope_pairs) for i in range(num_layers)]
    uniform = [j * half // rope_pairs for j in range(rope_pairs)]  # distinct because r <= half
    pairs = range(rope_pairs) if selection == "high" else uniform
    return [[list(pairs) for _ in range(geometry.num_kv_heads)] for _ in range(num_layers)]


class PairNormScores:
    """Accumulates mean ||q_pair|| and ||k_pair|| over calibration tokens, per layer, for `2norm`.

    Feed it the attention inputs x (N, C) of a layer with that layer's q/k projections; `scores()` gives per
    layer (Hkv, d/2): mean_t ||k_{g,i}(t)|| * mean_{h in group g} mean_t ||q_{h,i}(t)||.
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_sum, self.k_sum, self.count = {}, {}, {}  # layer -> summed (Hq, d/2), (Hkv, d/2) norms; tokens

    def _pair_norms(self, proj: torch.Tensor, heads: int) -> torch.Tensor:
        """(H, d/2) summed norms of the pairs (rows i and i + d/2 of each head) of proj (N, H d)."""
        return proj.reshape(-1, heads, 2, self.head_dim // 2).double().norm(dim=2).sum(0)

    @torch.inference_mode()
    def add(self, layer: int, x: torch.Tensor, w_q, b_q, w_k, b_k) -> None:
        """x (N, C); w_q (Hq*d, C), w_k (Hkv*d, C), biases (out,) or None."""
        x = x.reshape(-1, x.shape[-1]).to(w_q.dtype)  # (N, C)
        q = torch.nn.functional.linear(x, w_q, b_q)  # (N, Hq*d)
        k = torch.nn.functional.linear(x, w_k, b_k)  # (N, Hkv*d)
        q_norms, k_norms = self._pair_norms(q, self.num_heads), self._pair_norms(k, self.num_kv_heads)
        self.q_sum[layer] = self.q_sum[layer] + q_norms if layer in self.count else q_norms
        self.k_sum[layer] = self.k_sum[layer] + k_norms if layer in self.count else k_norms
        self.count[layer] = self.count.get(layer, 0) + x.shape[0]

    def scores(self) -> dict[int, torch.Tensor]:
        out = {}
        group = self.num_heads // self.num_kv_heads
        for layer, n in self.count.items():
            q_mean = (self.q_sum[layer] / n).reshape(self.num_kv_heads, group, -1).mean(1)  # (Hkv, d/2)
            out[layer] = q_mean * (self.k_sum[layer] / n)  # (Hkv, d/2)
        return out


class AttentionPairStats:
    """Per layer, query head and pair: what removing that pair's rotation does to the attention scores.

    For query t, key s <= t and pair i, the source's score term is y = q'_i . k'_i (both rotated by RoPE at
    their positions); without rotation it becomes f1 = q_i . k_i; a query-side complex factor alpha = a + jb
    on the pair (rows i and i + d/2 of q mixed as [[a, -b], [b, a]]) makes it a f1 + b f2 with
    f2 = q_i . J k_i, J = [[0, 1], [-1, 0]]. A change of the scores that is the same for all keys of a
    query does nothing (softmax), so what counts is the variance over keys under the source's attention
    probabilities p_ts. Accumulated (summed over queries): Var_p(y), Var_p(f1), Var_p(f2) and the
    covariances, per (Hq, d/2). From them:
      cost without compensation   Var_p(y - f1)
      cost with the best alpha    Var_p(y) - r^T G^-1 r   (G = Cov_p(f), r = Cov_p(f, y))
    Every sum over keys is one matmul of the probabilities with per-key products of k and k' (so the whole
    pass costs about Hq * Tq * T * 14 d/2 multiply-adds per window), Tq = T / `query_stride` queries.
    """

    NAMES = ("vy", "v11", "v12", "v22", "v1y", "v2y")

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, query_stride: int = QUERY_STRIDE):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.query_stride = query_stride
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    @torch.inference_mode()
    def add(self, layer: int, x, cos, sin, w_q, b_q, w_k, b_k, *, window: int | None = None) -> None:
        """x (T, C) one calibration window's attention input; cos/sin (T, d) of its positions;
        `window`: sliding-window size of this layer (None: full causal attention)."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half, group = d // 2, hq // hkv
        x = x.reshape(-1, x.shape[-1]).to(w_q.dtype)  # (T, C)
        T = x.shape[0]
        tq = torch.arange(0, T, self.query_stride)
        Tq = len(tq)
        q = torch.nn.functional.linear(x[tq], w_q, b_q).double().view(Tq, hq, 2, half)  # (Tq, Hq, 2, d/2)
        k = torch.nn.functional.linear(x, w_k, b_k).double().view(T, hkv, 2, half)  # (T, Hkv, 2, d/2)
        c = cos.reshape(T, d)[:, None, :half].double()  # (T, 1, d/2): rotate-half uses one angle per pair
        s = sin.reshape(T, d)[:, None, :half].double()

        def rotate(v, c, s):  # (N, H, 2, d/2): pair i = (v[:, :, 0, i], v[:, :, 1, i])
            v1, v2 = v[:, :, 0], v[:, :, 1]
            return v1 * c - v2 * s, v2 * c + v1 * s

        q1, q2 = q[:, :, 0], q[:, :, 1]  # (Tq, Hq, d/2)
        p1, p2 = rotate(q, c[tq], s[tq])  # rotated queries
        k1, k2 = k[:, :, 0], k[:, :, 1]  # (T, Hkv, d/2)
        r1, r2 = rotate(k, c, s)  # rotated keys
        qr = torch.stack((p1, p2), 2).view(Tq, hkv, group, d)  # (Tq, Hkv, G, d) in pair-blocked order
        kr = torch.stack((r1, r2), 2).view(T, hkv, d)  # (T, Hkv, d), same order: dot products agree
        p = causal_probabilities(qr, kr, tq, window=window)  # (Hkv, G, Tq, T)

        # per-key features of every pair, averaged under p: k, k' and the products the variances need
        squares = [k1 * k1, k1 * k2, k2 * k2, r1 * r1, r1 * r2, r2 * r2]
        cross = [a * b for a in (k1, k2) for b in (r1, r2)]  # k1 r1, k1 r2, k2 r1, k2 r2
        feats = torch.stack((k1, k2, r1, r2, *squares, *cross), -1)  # (T, Hkv, d/2, 14)
        e = torch.einsum("gjts,sgif->gjtif", p, feats).reshape(hq, Tq, half, 14).unbind(-1)
        m1, m2, n1, n2, a11, a12, a22, b11, b12, b22, c11, c12, c21, c22 = e  # each (Hq, Tq, d/2)
        # queries as (Hq, Tq, d/2); f1 = q . k, f2 = q . J k = q1 k2 - q2 k1 = u . k, u = (-q2, q1); y = q'.k'
        q1, q2 = q1.transpose(0, 1), q2.transpose(0, 1)
        p1, p2 = p1.transpose(0, 1), p2.transpose(0, 1)
        u1, u2 = -q2, q1
        f1m, f2m, ym = q1 * m1 + q2 * m2, u1 * m1 + u2 * m2, p1 * n1 + p2 * n2

        def kk(a, b):  # a^T E[k k^T] b
            return a[0] * b[0] * a11 + (a[0] * b[1] + a[1] * b[0]) * a12 + a[1] * b[1] * a22

        def kr_(a, b):  # a^T E[k k'^T] b
            return a[0] * b[0] * c11 + a[0] * b[1] * c12 + a[1] * b[0] * c21 + a[1] * b[1] * c22

        qa, ua, pa = (q1, q2), (u1, u2), (p1, p2)
        stats = {
            "vy": p1 * p1 * b11 + 2 * p1 * p2 * b12 + p2 * p2 * b22 - ym * ym,
            "v11": kk(qa, qa) - f1m * f1m,
            "v12": kk(qa, ua) - f1m * f2m,
            "v22": kk(ua, ua) - f2m * f2m,
            "v1y": kr_(qa, pa) - f1m * ym,
            "v2y": kr_(ua, pa) - f2m * ym,
        }
        acc = self.sums.setdefault(layer, {n: 0.0 for n in self.NAMES})
        for n in self.NAMES:
            acc[n] = acc[n] + stats[n].sum(1)  # (Hq, d/2)

    def costs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cost without compensation, cost with the best alpha, alpha): each (Hq, d/2), alpha complex."""
        s = self.sums[layer]
        vy, v11, v12, v22, v1y, v2y = (s[n] for n in self.NAMES)
        drop = vy - 2 * v1y + v11
        gram = torch.stack((torch.stack((v11, v12), -1), torch.stack((v12, v22), -1)), -2)  # (Hq, d/2, 2, 2)
        ridge = 1e-12 * (v11 + v22).clamp_min(1e-300)
        gram = gram + ridge[..., None, None] * torch.eye(2, dtype=gram.dtype)
        rhs = torch.stack((v1y, v2y), -1)  # (Hq, d/2, 2)
        ab = torch.linalg.solve(gram, rhs)  # (Hq, d/2, 2)
        fitted = (vy - (ab * rhs).sum(-1)).clamp_min(0.0)
        return drop, fitted, torch.complex(ab[..., 0], ab[..., 1])

    def pair_scores(self, layer: int) -> torch.Tensor:
        """(Hkv, d/2): the error left after the query fit, summed over each KV head's query heads."""
        _, fitted, _ = self.costs(layer)
        group = self.num_heads // self.num_kv_heads
        return fitted.view(self.num_kv_heads, group, -1).sum(1)

    def query_fit(self, layer: int) -> torch.Tensor:
        """(Hq, d/2) complex alpha per query head and pair (apply it to the dropped pairs only)."""
        return self.costs(layer)[2]


def apply_query_fit(
    weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor, kept: list[list[int]], group: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mix rows (i, i + d/2) of every query head h by [[a, -b], [b, a]], alpha[h, i] = a + jb, for the pairs
    i its KV head no longer rotates (not in kept[h // group]). weight (Hq*d, C), bias (Hq*d,)."""
    hq, half = alpha.shape
    d = 2 * half
    w = weight.clone().view(hq, 2, half, -1)  # (Hq, 2, d/2, C): rows i and i + d/2 of each head
    b = None if bias is None else bias.clone().view(hq, 2, half, 1)
    dropped = [[i for i in range(half) if i not in set(p)] for p in kept]
    for h in range(hq):
        idx = torch.tensor(dropped[h // group], dtype=torch.long)
        if idx.numel() == 0:
            continue
        a = alpha[h, idx].real.to(weight.dtype)[:, None]  # (n, 1)
        c = alpha[h, idx].imag.to(weight.dtype)[:, None]
        for t in [t for t in (w, b) if t is not None]:
            r1, r2 = t[h, 0, idx].clone(), t[h, 1, idx].clone()  # (n, C)
            t[h, 0, idx] = a * r1 - c * r2
            t[h, 1, idx] = c * r1 + a * r2
    return w.view(hq * d, -1), None if b is None else b.view(hq * d)


def nope_queries(
    w_q: torch.Tensor, b_q: torch.Tensor | None, geometry: AttentionGeometry, rope_pairs: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The non-RoPE rows of permuted (rope-first) query rows: w_q (Hq d, C) -> (Hq (d - 2r), C), b_q
    (Hq d,) -> (Hq (d - 2r),) or None."""
    hq, d, rd = geometry.num_heads, geometry.head_dim, 2 * rope_pairs
    q = w_q.view(hq, d, -1)[:, rd:]  # (Hq, d - 2r, C)
    return q.reshape(-1, q.shape[-1]), None if b_q is None else b_q.view(hq, d)[:, rd:].reshape(-1)


def layer_rows(pairs: list[list[int]], geometry: AttentionGeometry) -> dict[str, list[int]]:
    """Global row indices of one layer: "q" (Hq d, every query head permuted like its KV head), "k_rope"
    (Hkv 2r) and "k_nope" (Hkv (d - 2r)) into the source's q_proj / k_proj rows, head-major. Head-local rows
    (contract): rope part [P, P + d/2] (2r rows, the model's `rope_dim_indices`), nope part the other d - 2r
    rows in ascending order ([C, C + d/2], C the dropped pairs)."""
    d, group = geometry.head_dim, geometry.group_size
    ropes = [rope_dim_indices([list(p)], d)[0].tolist() for p in pairs]  # [Hkv] (2r,)
    orders = [(rope, [j for j in range(d) if j not in rope]) for rope in ropes]
    q = [h * d + j for h in range(geometry.num_heads) for j in orders[h // group][0] + orders[h // group][1]]
    k_rope = [g * d + j for g, (rope, _) in enumerate(orders) for j in rope]
    k_nope = [g * d + j for g, (_, nope) in enumerate(orders) for j in nope]
    return {"q": q, "k_rope": k_rope, "k_nope": k_nope}
