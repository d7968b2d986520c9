"""Joint low-rank factorization of the non-RoPE keys and the values of one attention layer (MLA conversion).

Stack the projections whose outputs the latent must reproduce, W = [W_k,nope (all KV heads); W_v (all KV
heads)] (W rows, C columns) with bias b (or None), and find `down` (rank, C), `up` (W, rank) and `up_bias`
(W,) so that y = W x + b is approximated by up (down x) + up_bias. The cached latent is c = down x.

- `full_rank`: down = W, up = I, up_bias = b: exact (rank = W).
- `weight_svd` (MHA2MLA's SVD-joint): the top singular subspace U_r of W itself; down = U_r^T W, up = U_r,
  up_bias = b. Minimises the weight error ||W - up down||_F, blind to which inputs actually occur.
- `activation_pca` (TransMLA's BKV-PCA idea): PCA of the actual activations z = W x on calibration text, with
  the key rows and the value rows scaled to equal total norm first (s_K, s_V; otherwise whichever of K or V
  is larger takes the whole latent). With D = diag(s) and U_r the top-r eigenvectors of E[D z z^T D]:
  down = U_r^T D W, up = D^-1 U_r, up_bias = b (the bias is added after the latent, so it stays exact).
  Minimises the (scaled) activation error E||D (z - up down x)||^2.

All arithmetic in float64; the caller casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FACTORIZATIONS = ("weight-svd", "activation")
CALIBRATED_FACTORIZATIONS = ("activation",)


@dataclass(frozen=True)
class LowRank:
    """y ~ up @ (down @ x) + up_bias."""

    down: torch.Tensor  # (rank, C)
    up: torch.Tensor  # (W, rank)
    up_bias: torch.Tensor | None  # (W,) or None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def reconstruct(self) -> torch.Tensor:
        """The effective weight up @ down, (W, C)."""
        return self.up @ self.down


def _check(weight: torch.Tensor, bias: torch.Tensor | None, rank: int) -> None:
    rows, _ = weight.shape
    if not 1 <= rank <= rows:
        raise ValueError(f"kv_lora_rank must be in [1, {rows}] (the stacked K/V width), got {rank}.")
    assert bias is None or bias.shape == (rows,), (tuple(bias.shape), rows)


def full_rank(weight: torch.Tensor, bias: torch.Tensor | None) -> LowRank:
    """The exact factorization: down = W (W, C), up = identity (W, W)."""
    w = weight.double()
    eye = torch.eye(w.shape[0], dtype=torch.float64)
    return LowRank(w.clone(), eye, None if bias is None else bias.double().clone())


def weight_svd(weight: torch.Tensor, bias: torch.Tensor | None, rank: int) -> LowRank:
    """Top-`rank` singular subspace of the stacked weight (W, C)."""
    _check(weight, bias, rank)
    w = weight.double()
    u, _, _ = torch.linalg.svd(w, full_matrices=False)  # u (W, min(W, C))
    basis = u[:, :rank]  # (W, rank), orthonormal columns
    return LowRank(basis.T @ w, basis, None if bias is None else bias.double().clone())


def second_moment(moment: torch.Tensor) -> torch.Tensor:
    """E[x x^T] (C, C) from the summed augmented moment sum [x;1][x;1]^T (C+1, C+1)."""
    m = moment.double()
    return m[:-1, :-1] / m[-1, -1]


def balance_scales(weight: torch.Tensor, moment_x: torch.Tensor, num_key_rows: int) -> torch.Tensor:
    """Row scales s (W,): s_K on the first `num_key_rows` rows, s_V on the rest, so that the scaled keys and
    the scaled values have equal total mean-square activation, normalised so that s_K * s_V = 1."""
    w = weight.double()
    power = ((w @ moment_x) * w).sum(1)  # (W,): E[z_j^2]
    pk, pv = power[:num_key_rows].sum(), power[num_key_rows:].sum()
    scales = torch.ones(w.shape[0], dtype=torch.float64)
    if num_key_rows == 0 or num_key_rows == w.shape[0] or pk <= 0 or pv <= 0:
        return scales
    ratio = (pv / pk).sqrt().sqrt()  # s_K = ratio, s_V = 1 / ratio: s_K^2 pk = s_V^2 pv
    scales[:num_key_rows] = ratio
    scales[num_key_rows:] = 1.0 / ratio
    return scales


def activation_pca(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rank: int,
    *,
    moment: torch.Tensor,
    num_key_rows: int,
) -> LowRank:
    """Balanced PCA of the activations W x. moment: summed [x;1][x;1]^T over calibration tokens (C+1, C+1)."""
    _check(weight, bias, rank)
    w = weight.double()
    mx = second_moment(moment)  # (C, C)
    scales = balance_scales(w, mx, num_key_rows)  # (W,)
    ws = scales[:, None] * w  # (W, C): D W
    cov = ws @ mx @ ws.T  # (W, W): E[D z z^T D]
    cov = (cov + cov.T) / 2
    _, evecs = torch.linalg.eigh(cov)  # ascending
    basis = evecs[:, -rank:].flip(-1)  # (W, rank), largest first
    return LowRank(basis.T @ ws, basis / scales[:, None], None if bias is None else bias.double().clone())
