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
- `attention_pca` (beyond both): PCA in the metric of what attention computes, key errors through the scores
  of the queries that read them and value errors through the output projection (its docstring has the
  weights), with least-squares decoders. (Compared on SmolLM2 in the README's MLA curve.)

All arithmetic in float64; the caller casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowRank:
    """y ~ up @ (down @ x) + up_bias."""

    down: torch.Tensor  # (rank, C)
    up: torch.Tensor  # (W, rank)
    up_bias: torch.Tensor | None  # (W,) or None

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
    m = moment.double()
    mx = m[:-1, :-1] / m[-1, -1]  # (C, C): E[x x^T] from the summed sum [x;1][x;1]^T (C+1, C+1)
    scales = balance_scales(w, mx, num_key_rows)  # (W,)
    ws = scales[:, None] * w  # (W, C): D W
    cov = ws @ mx @ ws.T  # (W, W): E[D z z^T D]
    cov = (cov + cov.T) / 2
    _, evecs = torch.linalg.eigh(cov)  # ascending
    basis = evecs[:, -rank:].flip(-1)  # (W, rank), largest first
    return LowRank(basis.T @ ws, basis / scales[:, None], None if bias is None else bias.double().clone())


def _sqrt_psd(a: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """Symmetric square root of a PSD matrix, eigenvalues floored at `ridge` times the largest."""
    evals, evecs = torch.linalg.eigh((a + a.T) / 2)
    evals = evals.clamp_min(ridge * evals.max().clamp_min(1e-300))
    return (evecs * evals.sqrt()) @ evecs.T


def lstsq_decoder(target_cov: torch.Tensor, latent_cov: torch.Tensor, ridge: float = 1e-9) -> torch.Tensor:
    """B minimising E||y - B c||^2 given E[y c^T] (W, r) and E[c c^T] (r, r): B = E[y c^T] E[c c^T]^-1."""
    eye = torch.eye(latent_cov.shape[0], dtype=latent_cov.dtype)
    reg = latent_cov + ridge * torch.diagonal(latent_cov).mean().clamp_min(1e-300) * eye
    return torch.linalg.solve(reg, target_cov.T).T


def attention_pca(
    *,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    w_v: torch.Tensor,
    b_v: torch.Tensor | None,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_o: torch.Tensor,
    moment: torch.Tensor,
    num_kv_heads: int,
    rank: int,
    input_side: bool | None = None,
) -> LowRank:
    """PCA in the metric of what attention computes, with least-squares decoders.

    w_k (Hkv*dn, C) non-RoPE key rows, w_v (Hkv*d, C), w_q (Hq*dn, C) the matching non-RoPE query rows,
    w_o (C, Hq*d); biases (out,) or None; moment: sum [x;1][x;1]^T (C+1, C+1).
    - Key errors matter through the scores q_nope . dk / sqrt(d) of the group's queries; a constant key offset
      shifts every score of a query equally, which softmax ignores: keys are centred, weighted by
      A_K,g = (sum_{h in g} E[q_h q_h^T] / d)^(1/2).
    - Value errors matter through the output projection: A_V,g = (sum_{h in g} O_h^T O_h)^(1/2); values are
      centred only if their up-projection has a bias to carry the mean.
    - Key weights are scaled by the spread of the group's value outputs (mean over its heads of
      tr(O_h Cov(v_g) O_h^T)), the size of the output change per unit score error.
    The latent c = U_r^T A W x (top-r eigenvectors U_r of the weighted second moment); `up` and `up_bias` are
    the least-squares decoders of the keys (centred) and values from c.
    Where W > C + 1 (a 7B MHA layer: W ~ 7300, C = 4096) the weighted moment, of rank <= C + 1, is never
    formed: its top eigenvectors are the left singular vectors of its (W, C + 1) factor (`input_side`:
    None chooses so, True / False force either computation).
    """
    w_k, w_v, w_q, w_o = w_k.double(), w_v.double(), w_q.double(), w_o.double()
    _check(torch.cat([w_k, w_v]), None, rank)
    metric = _attention_metric(w_k, w_v, w_q, b_q, b_v, w_o, moment, num_kv_heads)
    if _input_side(w_k, w_v, moment, rank, input_side):  # W > C + 1: never form a (W, W) matrix
        basis = metric.top_directions(rank)  # (W, r)
    else:
        weighted = metric.weighted()  # (W, W)
        _, evecs = torch.linalg.eigh((weighted + weighted.T) / 2)
        basis = evecs[:, -rank:].flip(-1)  # (W, r)
    down = basis.T @ metric.aw  # (r, C): U_r^T A W

    # least-squares decoders: keys from the centred latent, values from the latent (+1 if biased)
    cov_d = metric.cov @ down.T  # (C, r): E[(x - mean) c^T] = Cov(x) D^T, shared by every decoder
    c_cov = down @ cov_d  # (r, r)
    up_k = lstsq_decoder(w_k @ cov_d, c_cov)  # (nk, r)
    if metric.v_center:
        up_v = lstsq_decoder(w_v @ cov_d, c_cov)  # (nv, r)
    else:
        second_d = metric.second @ down.T  # (C, r)
        up_v = lstsq_decoder(w_v @ second_d, down @ second_d)  # (nv, r)
    up = torch.cat([up_k, up_v])  # (W, r)
    up_bias = None
    if b_k is not None or b_v is not None:
        assert b_k is not None and b_v is not None, "keys and values both biased or neither"
        mean, c_mean = metric.mean, down @ metric.mean  # (C,), (r,)
        up_bias = torch.cat(
            [w_k @ mean + b_k.double() - up_k @ c_mean, w_v @ mean + b_v.double() - up_v @ c_mean]
        )
    return LowRank(down, up, up_bias)


def attention_spectrum(
    *,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    b_v: torch.Tensor | None,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_o: torch.Tensor,
    moment: torch.Tensor,
    num_kv_heads: int,
    input_side: bool | None = None,
) -> torch.Tensor:
    """Eigenvalues (W,), descending, of the weighted second moment that `attention_pca` truncates (its
    arguments, no rank): keeping the top c directions leaves the sum of the eigenvalues after the c-th as the
    metric error (before the least-squares decoders, which can only lower it)."""
    w_k, w_v, w_q, w_o = w_k.double(), w_v.double(), w_q.double(), w_o.double()
    metric = _attention_metric(w_k, w_v, w_q, b_q, b_v, w_o, moment, num_kv_heads)
    if _input_side(w_k, w_v, moment, 1, input_side):  # F F^T and F^T F share their nonzero eigenvalues
        f = metric.factor()  # (W, C+1)
        evals = torch.linalg.eigvalsh(f.T @ f).flip(0).clamp_min(0.0)  # (C+1,) descending
        return torch.cat([evals, evals.new_zeros(f.shape[0] - evals.numel())])  # (W,)
    weighted = metric.weighted()
    return torch.linalg.eigvalsh((weighted + weighted.T) / 2).flip(0).clamp_min(0.0)


def _input_side(w_k, w_v, moment, rank: int, forced: bool | None) -> bool:
    """Whether to work with the metric's (W, C + 1) factor instead of its (W, W) square."""
    if forced is not None:
        return forced
    width, inputs = w_k.shape[0] + w_v.shape[0], moment.shape[0]
    return width > inputs and rank <= inputs


@dataclass(frozen=True)
class _Metric:
    """`attention_pca`'s metric: the weighted second moment A J A^T (W, W), J = E[z z^T] of
    z = M [x; 1] = [W_K (x - mean); W_V x (- W_V mean if the values are centred)],
    A = block_diag(A_K,g, A_V,g)."""

    am: torch.Tensor  # (W, C+1): A M
    moment: torch.Tensor  # (C+1, C+1): E[[x;1][x;1]^T]
    cov: torch.Tensor  # (C, C)
    second: torch.Tensor  # (C, C): E[x x^T]
    mean: torch.Tensor  # (C,)
    v_center: bool

    @property
    def aw(self) -> torch.Tensor:
        """A W (W, C): the input columns of A M."""
        return self.am[:, :-1]

    def factor(self) -> torch.Tensor:
        """F (W, C+1) with F F^T = A J A^T: A M times a square root of the augmented moment."""
        evals, root = torch.linalg.eigh(self.moment)  # (C+1,), (C+1, C+1)
        root.mul_(evals.clamp_min(0.0).sqrt())  # V diag(sqrt(lambda)): root root^T = moment
        return self.am @ root  # (W, C+1)

    def top_directions(self, rank: int) -> torch.Tensor:
        """(W, rank) orthonormal columns spanning the top-`rank` eigenvectors of F F^T, from the (C+1, C+1)
        Gram F^T F: u_i = F v_i / sqrt(lambda_i). Where F has fewer than `rank` nonzero singular values
        (fewer calibration tokens than inputs), the metric is zero on the rest of the space and a seeded
        random orthonormal completion is as good as any."""
        f = self.factor()  # (W, C+1)
        evals, evecs = torch.linalg.eigh(f.T @ f)  # ascending
        evals, evecs = evals.flip(0), evecs.flip(-1)
        nonzero = int((evals > 1e-12 * evals[0].clamp_min(1e-300)).sum())
        k = min(rank, nonzero)
        u = f @ (evecs[:, :k] / evals[:k].sqrt())  # (W, k)
        del f, evecs
        if k < rank:
            g = torch.Generator().manual_seed(0)
            u = torch.cat([u, torch.randn(u.shape[0], rank - k, generator=g, dtype=u.dtype)], 1)  # (W, r)
        return torch.linalg.qr(u)[0]  # orthonormal; its first k columns span u's first k

    def weighted(self) -> torch.Tensor:
        """A J A^T = (A M) E[[x;1][x;1]^T] (A M)^T (W, W): one product through the augmented moment."""
        return self.am @ self.moment @ self.am.T


def _attention_metric(w_k, w_v, w_q, b_q, b_v, w_o, moment, num_kv_heads) -> _Metric:
    """`attention_pca`'s metric from float64 weights (see `_Metric`)."""
    nk, nv, hkv = w_k.shape[0], w_v.shape[0], num_kv_heads
    dn, d = nk // hkv, nv // hkv
    group = w_o.shape[1] // d // hkv  # query heads per KV head
    m = moment.double() / moment[-1, -1].double()  # (C+1, C+1): E[[x;1][x;1]^T]
    mean = m[:-1, -1]  # (C,)
    second = m[:-1, :-1]  # (C, C)
    cov = second - torch.outer(mean, mean)  # (C, C)
    b_q = b_q.double() if b_q is not None else w_q.new_zeros(w_q.shape[0])
    wq_aug = torch.cat([w_q, b_q[:, None]], 1)  # (Hq*dn, C+1)

    k_blocks, v_blocks = [], []  # A_K,g and A_V,g
    for g in range(hkv):
        heads = range(g * group, (g + 1) * group)
        o_cols = [w_o[:, h * d : (h + 1) * d] for h in heads]  # each (C, d)
        w_vg = w_v[g * d : (g + 1) * d]  # (d, C)
        cv = w_vg @ cov @ w_vg.T  # (d, d)
        v_spread = sum(((o @ cv) * o).sum() for o in o_cols) / group
        q_rows = [wq_aug[h * dn : (h + 1) * dn] for h in heads]  # each (dn, C+1)
        sq = sum(q @ m @ q.T for q in q_rows)  # (dn, dn)
        k_blocks.append(_sqrt_psd(sq * (v_spread / d)) if dn else sq)
        v_blocks.append(_sqrt_psd(sum(o.T @ o for o in o_cols)))

    v_center = b_v is not None
    am = torch.empty(nk + nv, cov.shape[0] + 1, dtype=torch.float64)  # (W, C+1): M, then A M
    am[:nk, :-1], am[nk:, :-1] = w_k, w_v  # [W_K; W_V], then the shift: z = W x - shift
    am[:nk, -1] = -(w_k @ mean)  # keys always centred
    am[nk:, -1] = -(w_v @ mean) if v_center else 0.0  # values only if their bias absorbs the mean
    row = 0
    for block in k_blocks + v_blocks:  # A M, block by block (A is block-diagonal)
        n = block.shape[0]
        am[row : row + n] = block @ am[row : row + n]
        row += n
    return _Metric(am, m, cov, second, mean, v_center)
