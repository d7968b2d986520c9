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
"""

from __future__ import annotations

import torch

SELECTIONS = ("high", "uniform", "2norm")
CALIBRATED_SELECTIONS = ("2norm",)

PairIndices = list[list[list[int]]]  # [num_layers][Hkv][r], each list strictly ascending


def check_rope_pairs(rope_pairs: int, head_dim: int) -> None:
    """ValueError unless 0 <= r <= d/2."""
    half = head_dim // 2
    if not isinstance(rope_pairs, int) or not 0 <= rope_pairs <= half:
        raise ValueError(
            f"--rope-pairs must be an integer in [0, head_dim / 2 = {half}] (head_dim {head_dim}), "
            f"got {rope_pairs!r}."
        )


def high_pairs(half: int, rope_pairs: int) -> list[int]:
    """The r highest-frequency pairs: [0, 1, ..., r - 1]."""
    return list(range(rope_pairs))


def uniform_pairs(half: int, rope_pairs: int) -> list[int]:
    """r pairs evenly spaced over [0, half): j * half // r (distinct because r <= half)."""
    return [j * half // rope_pairs for j in range(rope_pairs)]


def top_pairs(scores: torch.Tensor, rope_pairs: int) -> list[list[int]]:
    """Per KV head the r pairs of largest score, sorted ascending. scores (Hkv, d/2) -> [Hkv][r]."""
    assert scores.dim() == 2 and rope_pairs <= scores.shape[1], (tuple(scores.shape), rope_pairs)
    if rope_pairs == 0:
        return [[] for _ in range(scores.shape[0])]
    # stable tie-break towards high frequencies: sort by (-score, index)
    order = torch.argsort(-scores.double(), dim=1, stable=True)  # (Hkv, d/2)
    return [sorted(row[:rope_pairs].tolist()) for row in order]


def select_rope_pairs(
    selection: str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    rope_pairs: int,
    scores: dict[int, torch.Tensor] | None = None,
) -> PairIndices:
    """`[num_layers][Hkv][r]` kept pairs. `scores` (layer -> (Hkv, d/2)) is required by `2norm`."""
    check_rope_pairs(rope_pairs, head_dim)
    half = head_dim // 2
    if selection in ("high", "uniform"):
        pairs = (high_pairs if selection == "high" else uniform_pairs)(half, rope_pairs)
        return [[list(pairs) for _ in range(num_kv_heads)] for _ in range(num_layers)]
    if selection == "2norm":
        if scores is None or sorted(scores) != list(range(num_layers)):
            raise ValueError("rope selection '2norm' needs calibration scores for every layer.")
        return [top_pairs(scores[i], rope_pairs) for i in range(num_layers)]
    raise ValueError(f"Unknown --rope-selection {selection!r}; choose one of {', '.join(SELECTIONS)}.")


class PairNormScores:
    """Accumulates mean ||q_pair|| and ||k_pair|| over calibration tokens, per layer, for `2norm`.

    Feed it the attention inputs x (N, C) of a layer with that layer's q/k projections; `scores()` gives per
    layer (Hkv, d/2): mean_t ||k_{g,i}(t)|| * mean_{h in group g} mean_t ||q_{h,i}(t)||.
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_sum: dict[int, torch.Tensor] = {}
        self.k_sum: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}

    def _pair_norms(self, proj: torch.Tensor, heads: int) -> torch.Tensor:
        half = self.head_dim // 2
        pairs = proj.reshape(-1, heads, 2, half)  # (N, H, 2, d/2): rows i and i + d/2 of each head
        return pairs.double().norm(dim=2).sum(0)  # (H, d/2)

    @torch.inference_mode()
    def add(self, layer: int, x: torch.Tensor, w_q, b_q, w_k, b_k) -> None:
        """x (N, C); w_q (Hq*d, C), w_k (Hkv*d, C), biases (out,) or None."""
        x = x.reshape(-1, x.shape[-1]).to(w_q.dtype)  # (N, C)
        q = torch.nn.functional.linear(x, w_q, b_q)  # (N, Hq*d)
        k = torch.nn.functional.linear(x, w_k, b_k)  # (N, Hkv*d)
        q_norms, k_norms = self._pair_norms(q, self.num_heads), self._pair_norms(k, self.num_kv_heads)
        if layer in self.count:
            self.q_sum[layer] += q_norms
            self.k_sum[layer] += k_norms
            self.count[layer] += x.shape[0]
        else:
            self.q_sum[layer], self.k_sum[layer], self.count[layer] = q_norms, k_norms, x.shape[0]

    def scores(self) -> dict[int, torch.Tensor]:
        out = {}
        group = self.num_heads // self.num_kv_heads
        for layer, n in self.count.items():
            q_mean = (self.q_sum[layer] / n).reshape(self.num_kv_heads, group, -1).mean(1)  # (Hkv, d/2)
            out[layer] = q_mean * (self.k_sum[layer] / n)  # (Hkv, d/2)
        return out
