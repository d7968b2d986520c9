"""GQA/MQA pooling: the fits that pool H key/value heads into G groups (`conversion.gqa.convert` writes the
pooled checkpoint). Group g of G takes the source KV heads g*H/G ... (g+1)*H/G - 1 (`Pooling`).

method="mean" (the GQA paper): each group's K and V projection rows (and biases) are the mean of its heads',
accumulated in float64 and cast back, so pooling identical heads returns them bit for bit; q_proj and o_proj
are untouched. Streams tensor by tensor: memory is one tensor (`hf-attn bench stream` measures it).

method="calibrated" (beyond the paper, derived in docs/gqa.md): the pooled K/V projections are fitted on
calibration activations so that what attention computes changes least, and the query / output projections
refitted to read them: keys per RoPE pair with complex coefficients (`fit_keys`), values in the metric of the
output projection (`fit_values`), from per-layer statistics of one fp32 pass (`AttentionStatistics`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import rotate_half

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.specs import DEFAULT_WINDOW, CalibrationSpec, check_num_kv_heads
from hf_attn.tooling.errors import UserError

_RIDGE = 1e-9  # relative ridge on the covariances that are inverted or square-rooted
_RANGE_TOL = 1e-10  # value statistics: eigenvalues up to this fraction of the largest are never seen
_CG_STEPS, _CG_TOL = 50, 1e-4  # conjugate-gradient budget of one value refit (relative residual)
KEY_ITERATIONS, VALUE_ITERATIONS = 20, 10  # alternating least-squares rounds of `calibrated_pool_layer`


@dataclass(frozen=True)
class Pooling:
    """H source KV heads pooled into G groups of r = H / G consecutive heads."""

    geometry: AttentionGeometry  # of the source
    num_groups: int  # G

    @property
    def heads_per_group(self) -> int:
        return self.geometry.num_kv_heads // self.num_groups

    @property
    def groups(self) -> list[list[int]]:
        r = self.heads_per_group
        return [list(range(g * r, (g + 1) * r)) for g in range(self.num_groups)]

    def query_heads_of(self, kv_head: int) -> list[int]:
        """Query heads that read source KV head `kv_head` (repeat_kv order)."""
        n = self.geometry.group_size
        return list(range(kv_head * n, (kv_head + 1) * n))


def check_pooling(geometry: AttentionGeometry, num_kv_heads: int) -> Pooling:
    """Validate the target number of KV heads G against the source's H; UserError naming both otherwise."""
    h = geometry.num_kv_heads
    check_num_kv_heads(num_kv_heads)
    if num_kv_heads > h:
        raise UserError(
            f"--num-kv-heads {num_kv_heads} is larger than the source's {h} KV heads: pooling only reduces "
            f"them; to add KV heads use `hf-attn convert expand --num-kv-heads {num_kv_heads}`"
        )
    if h % num_kv_heads:
        divisors = [g for g in range(1, h + 1) if h % g == 0]
        raise UserError(
            f"The source's {h} KV heads cannot be split into {num_kv_heads} equal groups "
            f"({h} % {num_kv_heads} != 0); choose --num-kv-heads from {', '.join(map(str, divisors))}"
        )
    return Pooling(geometry, num_kv_heads)


@torch.inference_mode()
def mean_pool_heads(tensor: torch.Tensor, *, pooling: Pooling) -> torch.Tensor:
    """K or V projection weight (H*d, C) or bias (H*d,) -> (G*d, C) or (G*d,): the mean over each group,
    accumulated in float64 and cast back to the input dtype."""
    g, r, d = pooling.num_groups, pooling.heads_per_group, pooling.geometry.head_dim
    assert tensor.shape[0] == g * r * d, (tuple(tensor.shape), g, r, d)
    rest = tuple(tensor.shape[1:])
    grouped = tensor.reshape(g, r, d, *rest)  # (G, r, d, C) or (G, r, d)
    return grouped.double().mean(dim=1).to(tensor.dtype).reshape(g * d, *rest)  # (G*d, C) or (G*d,)


def _augment(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[W | b] in float64: (out, C) and (out,) -> (out, C + 1); a missing bias is a zero column."""
    w = weight.double()
    b = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    return torch.cat([w, b[:, None]], dim=1)  # (out, C + 1)


def _split(augmented: torch.Tensor, like_bias: torch.Tensor | None, dtype: torch.dtype):
    """Inverse of `_augment`: (out, C + 1) -> weight (out, C) and bias (out,) or None; cast to `dtype`."""
    weight, bias = augmented[:, :-1], augmented[:, -1]
    if like_bias is None:
        assert bias.abs().max() <= 1e-6 * max(weight.abs().max().item(), 1.0), "bias appeared from nowhere"
    return weight.to(dtype).contiguous(), None if like_bias is None else bias.to(dtype).contiguous()


def _sym_sqrt(a: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a PSD matrix (eigenvalues clipped at a relative ridge)."""
    evals, evecs = torch.linalg.eigh(a)
    evals = evals.clamp_min(_RIDGE * evals.max().clamp_min(1e-300))
    return (evecs * evals.sqrt()) @ evecs.T


@dataclass
class AttentionStatistics:
    """What calibrated pooling needs from one attention layer, summed over the calibration tokens.

    keys   (G, r, d/2, r, r) complex: for source head h (2nd index) of group g and rotary pair i,
           S[g, h, i] = sum_t w_{h,t,i} z_t z_t^H, z_t the group's r complex keys of pair i at token t
           (before RoPE) and w_{h,t,i} = sum_{h' reads h} sum_s p^{h'}_{s,t} |q^{h'}_{s,i}|^2 the query power
           that attention sends to token t.
    values (G, n r, r d, r d): for each query head h' of group g (n = Hq/H per source head),
           Y[g, h'] = sum_s y_s y_s^T with y_s = sum_t p^{h'}_{s,t} [v_{h,t} for h in g], the
           attention-averaged stacked values of the group (what the output projection reads).
    Memory per layer: G r^2 (d/2) r^2 complex + Hq (r d)^2 float64 numbers."""

    keys: torch.Tensor
    values: torch.Tensor
    tokens: int = 0

    def __iadd__(self, other: AttentionStatistics) -> AttentionStatistics:
        self.keys += other.keys
        self.values += other.values
        self.tokens += other.tokens
        return self


def _window_statistics(att, x: torch.Tensor, position_embeddings, pooling: Pooling) -> AttentionStatistics:
    """AttentionStatistics of one window: x (1, T, C) the input of `att` (a Llama-family self_attn)."""
    geo = pooling.geometry
    hq, h, d, half, n = geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.head_dim // 2, geo.group_size
    r, g_count = pooling.heads_per_group, pooling.num_groups
    x = x[0].float()  # (T, C)
    t = x.shape[0]
    q = att.q_proj(x).view(t, hq, d).transpose(0, 1).float()  # (Hq, T, d), before RoPE
    k = att.k_proj(x).view(t, h, d).transpose(0, 1).float()  # (H, T, d)
    v = att.v_proj(x).view(t, h, d).transpose(0, 1).float()  # (H, T, d)
    cos, sin = (e[0].float() for e in position_embeddings)  # each (T, d)
    q_rot = (q * cos + rotate_half(q) * sin) * att.scaling  # (Hq, T, d), scaled
    k_rot = k * cos + rotate_half(k) * sin  # (H, T, d)
    q_power = q[..., :half] ** 2 + q[..., half:] ** 2  # (Hq, T, d/2): |q_i|^2, invariant under RoPE
    v_groups = v.view(g_count, r, t, d).permute(0, 2, 1, 3).reshape(g_count, 1, t, r * d)  # (G, 1, T, r*d)

    w = q_power.new_zeros(hq, t, half)  # (Hq, T, d/2): sum_s p_{s,t} |q_{s,i}|^2 per query head
    y = []  # per query chunk (G, n*r, Tc, r*d): y_s = sum_t p_{s,t} v_t, the group's values stacked
    for (a, b), (lo, p) in _causal_probabilities(q_rot, k_rot, getattr(att, "sliding_window", None)):
        w[:, lo:b] += p.transpose(1, 2) @ q_power[:, a:b]  # (Hq, Sc, d/2)
        y.append(p.view(g_count, r * n, b - a, b - lo) @ v_groups[:, :, lo:b])
    y = torch.cat(y, dim=2)  # (G, n*r, T, r*d)

    w = w.view(h, n, t, half).sum(1).double()  # (H, T, d/2): w_{h,t,i}
    z = torch.complex(k[..., :half].double(), k[..., half:].double())  # (H, T, d/2)
    z = z.view(g_count, r, t, half)  # (G, r, T, d/2)
    w = w.view(g_count, r, t, half).to(torch.complex128)  # (G, r, T, d/2)
    keys = torch.einsum("ghti,gati,gbti->ghiab", w, z, z.conj())  # (G, r, d/2, r, r)
    values = torch.einsum("gqta,gqtb->gqab", y, y).double()  # (G, n*r, r*d, r*d)
    return AttentionStatistics(keys=keys, values=values, tokens=t)


CAUSAL_CHUNKS = 4  # query blocks of the causal attention probabilities (about 5/8 of the full square)


def _causal_probabilities(q_rot: torch.Tensor, k_rot: torch.Tensor, window: int | None):
    """The causal attention probabilities of one window in CAUSAL_CHUNKS blocks of query rows, each over the
    keys its rows can read (from the first one inside the `window` of its first row, None: 0, to its last
    row): q_rot (Hq, T, d) scaled, k_rot (H, T, d), grouped heads (query head j reads key head j // (Hq/H)).
    Yields ((a, b): the rows, (lo, p)): p (Hq, b - a, b - lo) the probabilities over keys lo..b-1, whose
    other keys are masked for every row of the block, so each row's softmax is the full one's."""
    hq, t, d = q_rot.shape
    h = k_rot.shape[0]
    bounds = [t * i // CAUSAL_CHUNKS for i in range(CAUSAL_CHUNKS + 1)]
    for a, b in itertools.pairwise(bounds):
        if b == a:
            continue
        lo = 0 if window is None else max(0, a - window + 1)
        rows = torch.arange(a, b)[:, None]  # (Tc, 1)
        keys = torch.arange(lo, b)[None]  # (1, Sc)
        hidden = keys > rows if window is None else (keys > rows) | (rows - keys >= window)  # (Tc, Sc)
        q = q_rot[:, a:b].reshape(h, (hq // h) * (b - a), d)  # (H, n*Tc, d)
        scores = (q @ k_rot[:, lo:b].transpose(1, 2)).view(hq, b - a, b - lo)  # (Hq, Tc, Sc): no K copies
        yield (a, b), (lo, scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1))


def collect_attention_statistics(
    model,
    input_ids: torch.Tensor,
    *,
    pooling: Pooling,
    window: int = DEFAULT_WINDOW,
    progress: bool = True,
    done: Callable[[int, AttentionStatistics], None] | None = None,
) -> dict[int, AttentionStatistics]:
    """Per layer, AttentionStatistics of the source model on the calibration tokens (1-D `input_ids`).

    done: if given, called as done(layer, statistics) as soon as a layer's statistics are complete (they
    cover every calibration token), which are then dropped: the returned dict is empty. With the layer-by-
    layer model that is right after the pass leaves the layer, so only one layer's statistics are ever held.
    """
    layers = model.model.layers
    out: dict[int, AttentionStatistics] = {}
    total = int(input_ids.numel())

    def accumulate(idx: int, x: torch.Tensor, position_embeddings) -> None:
        if position_embeddings is None:
            raise ValueError("calibrated pooling needs RoPE position embeddings passed to self_attn")
        stats = _window_statistics(layers[idx].self_attn, x, position_embeddings, pooling)
        if idx in out:
            out[idx] += stats
        else:
            out[idx] = stats
        if done is not None and out[idx].tokens == total:  # every window of this layer is in
            done(idx, out.pop(idx))

    model.for_each_attention_input(input_ids, accumulate, window=window, progress=progress)
    if done is not None:
        for idx in sorted(out):  # (not reached when every window reports its tokens)
            done(idx, out.pop(idx))
    return out


def fit_keys(s: torch.Tensor, *, iterations: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled key of one group, per rotary pair: z' = coef . z, decoded by z_h ~ u_h z'.

    s: (r, d/2, r, r) complex, the key statistics of the group (AttentionStatistics.keys[g]). Minimises
    sum_h sum_t w_{h,t} |z_{h,t} - u_h z'_t|^2 by alternating least squares from a principal-component start.
    Returns coef and u, each (d/2, r)."""
    r = s.shape[0]
    eye = torch.eye(r, dtype=s.dtype)
    own = torch.stack([s[h, :, :, h] for h in range(r)])  # (r, d/2, r): S_h e_h, column h of S_h
    # start: top eigenvector of M_ab = (S_a[a, b] + S_b[a, b]) / 2 (covariances as the queries see them)
    mix = torch.stack(
        [torch.stack([(s[a, :, a, b] + s[b, :, a, b]) / 2 for b in range(r)], -1) for a in range(r)], 1
    )
    _, evecs = torch.linalg.eigh(mix)  # mix: (d/2, r, r)
    c = evecs[:, :, -1]  # (d/2, r), z' = c^H z

    def decoder(c):
        sc = torch.einsum("hiab,ib->hia", s, c)  # (r, d/2, r): S_h c
        num = torch.stack([sc[h, :, h] for h in range(r)], -1)  # (d/2, r): (S_h c)_h
        den = torch.einsum("ia,hia->ih", c.conj(), sc).real  # (d/2, r): c^H S_h c
        return num / den.clamp_min(1e-300)

    for _ in range(iterations):
        u = decoder(c)  # (d/2, r)
        a = torch.einsum("ih,hiab->iab", (u.abs() ** 2).to(s.dtype), s)  # (d/2, r, r)
        a = a + _RIDGE * torch.diagonal(a, dim1=1, dim2=2).real.mean(-1)[:, None, None] * eye
        b = torch.einsum("ih,hia->ia", u, own)  # (d/2, r)
        c = torch.linalg.solve(a, b)  # (d/2, r)
    coef = c.conj()  # z' = sum_h coef_h z_h
    # scale: the pooled key as strong as the heads it replaces; phase: sum_h coef_h real positive
    power_old = torch.stack([s[h, :, h, h].real for h in range(r)]).sum(0)  # (d/2,)
    power_new = torch.einsum("ia,hiab,ib->i", c.conj(), s, c).real  # (d/2,)
    phase = coef.sum(-1)
    unit = torch.where(phase.abs() > 0, phase / phase.abs(), torch.ones_like(phase))  # (d/2,)
    coef = coef * (unit.conj() * (power_old / power_new.clamp_min(1e-300)).sqrt())[:, None]
    return coef, decoder(coef.conj())


def fit_values(
    y: torch.Tensor, grams: torch.Tensor, reads: list[int], *, iterations: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled value head of a group: v' = P [v_h for h in group]; query head q reads D_q v' for v_{reads[q]}.

    y: (Q, r d, r d) value statistics of the group's Q query heads (AttentionStatistics.values[g]);
    grams: (Q, d, d) O_q^T O_q of their output columns; reads[q]: the group-local source head of query head q.
    Minimises sum_q tr(G_q (E_q - D_q P) Y_q (E_q - D_q P)^T), E_q selecting head reads[q]: P from the
    output-whitened principal components, D_q by least squares, then `iterations` rounds of alternating
    least squares (P by conjugate gradients). Returns P (d, r d) and D (Q, d, d).

    Outside the range of Y = sum_q Y_q (eigenvalues <= _RANGE_TOL x the largest: the text is silent) P is
    zero (minimum norm); D absorbs any invertible T (P -> T P, D_q -> D_q T^-1), so P is taken closest to mean
    pooling P_mean = [I/r ... I/r] in Y's metric, T = P_mean Y P^T (P Y P^T)^+, then W T P with W = C_mean^1/2
    C^-1/2 gives the pooled values the mean pool's covariance (C_mean = P_mean Y P_mean^T, C = T P Y P^T T^T);
    each D_q's ridge pulls it toward I. Copies of one head (an expanded checkpoint) give back the original."""
    nq, rd, d = y.shape[0], y.shape[1], grams.shape[1]
    r = rd // d
    roots = [_sym_sqrt(sum(grams[q] for q in range(nq) if reads[q] == h)) for h in range(r)]  # each (d, d)
    whiten = torch.block_diag(*roots)  # (r d, r d)
    _, evecs = torch.linalg.eigh(whiten @ y.sum(0) @ whiten.T)
    excited, y_inv = _range(y.sum(0))  # (r d, r d) each: the projection on Y's range, Y's pseudo-inverse
    p = evecs[:, -d:].flip(-1).T @ whiten @ excited  # (d, r d)
    select = torch.stack([torch.eye(rd, dtype=y.dtype)[reads[q] * d : (reads[q] + 1) * d] for q in range(nq)])

    def decoders(p):  # D_q = (E_q Y_q P^T + ridge I)(P Y_q P^T + ridge I)^-1: toward I where Y_q is silent
        cross = select @ y @ p.T  # (Q, d, d): E_q Y_q P^T
        gram = p @ y @ p.T  # (Q, d, d): P Y_q P^T
        ridge = _RIDGE * torch.diagonal(gram, dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(d)
        return torch.linalg.solve(gram + ridge, (cross + ridge).transpose(1, 2)).transpose(1, 2)  # (Q, d, d)

    for _ in range(iterations):
        dec = decoders(p)
        hess = dec.transpose(1, 2) @ grams @ dec  # (Q, d, d)
        rhs = (dec.transpose(1, 2) @ grams @ select @ y).sum(0)  # (d, r d)
        h_sum = hess.sum(0)  # (d, d), PSD: inverted with a relative ridge on the diagonal
        ridge = _RIDGE * torch.diagonal(h_sum).mean().clamp_min(1e-300)
        h_inv = torch.linalg.inv(h_sum + ridge * torch.eye(d, dtype=h_sum.dtype)) * nq  # (d, d)

        def op(x, hess=hess):  # the normal operator of P (symmetric positive definite)
            return (hess @ x @ y).sum(0)

        def precondition(x, h_inv=h_inv):  # inverse of the operator with every Y_q, H_q replaced by the mean
            return h_inv @ x @ y_inv

        # warm-started preconditioned conjugate gradients
        res = rhs - op(p)
        z = precondition(res)
        direction, rz = z, (res * z).sum()
        for _ in range(_CG_STEPS):
            step = op(direction)
            curvature = (direction * step).sum()
            if curvature <= 0:  # the statistics of few tokens can be slightly indefinite: stop, never diverge
                break
            alpha = rz / curvature
            p = p + alpha * direction
            res = res - alpha * step
            if (res * res).sum() <= _CG_TOL**2 * (rhs * rhs).sum():
                break
            z = precondition(res)
            rz_new = (res * z).sum()
            direction, rz = z + (rz_new / rz) * direction, rz_new
    p, total, mean_pool = p @ excited, y.sum(0), torch.eye(d, dtype=y.dtype).repeat(1, r) / r  # P_mean
    p = mean_pool @ total @ p.T @ torch.linalg.pinv(p @ total @ p.T, rtol=_RANGE_TOL, hermitian=True) @ p
    p = _sym_sqrt(mean_pool @ total @ mean_pool.T) @ torch.linalg.inv(_sym_sqrt(p @ total @ p.T)) @ p
    return p, decoders(p)


def _range(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the orthogonal projection on the range of the PSD matrix a, a's pseudo-inverse there): eigenvalues
    up to _RANGE_TOL x the largest count as zero."""
    evals, evecs = torch.linalg.eigh(a)
    kept = evals > _RANGE_TOL * evals.max().clamp_min(1e-300)
    basis = evecs[:, kept]  # (n, k)
    return basis @ basis.T, (basis / evals[kept]) @ basis.T


@torch.inference_mode()
def calibrated_pool_layer(
    *,
    weights: dict[str, torch.Tensor | None],
    stats: AttentionStatistics,
    pooling: Pooling,
) -> dict[str, torch.Tensor | None]:
    """Pool one attention layer's K/V heads, refitting Q and O (the math: docs/gqa.md).

    weights: "q_proj.weight" (Hq*d, C), "k_proj.weight"/"v_proj.weight" (H*d, C), "o_proj.weight" (C, Hq*d),
    and "q_proj.bias"/"k_proj.bias"/"v_proj.bias" ((out,) or None). Returns the same keys with K/V at G
    heads, dtypes as given."""
    geo, g_count, r = pooling.geometry, pooling.num_groups, pooling.heads_per_group
    d, half, hq, n = geo.head_dim, geo.head_dim // 2, geo.num_heads, geo.group_size
    dtype = weights["k_proj.weight"].dtype
    if r == 1:  # nothing to pool: the identity
        return dict(weights)
    wq = _augment(weights["q_proj.weight"], weights.get("q_proj.bias"))  # (Hq*d, C+1)
    wk = _augment(weights["k_proj.weight"], weights.get("k_proj.bias"))  # (H*d, C+1)
    wv = _augment(weights["v_proj.weight"], weights.get("v_proj.bias"))  # (H*d, C+1)
    wo = weights["o_proj.weight"].double()  # (C, Hq*d)
    ca = wq.shape[1]
    # complex view of the rotary pairs, row i + j * row (i + d/2) of every head: (Hq, d/2, C+1), (H, d/2, C+1)
    qc, kc = (torch.complex(*w.reshape(-1, 2, half, ca).unbind(1)) for w in (wq, wk))

    new_qc = qc.clone()  # (Hq, d/2, C+1)
    new_kc = torch.empty(g_count, half, ca, dtype=torch.complex128)  # (G, d/2, C+1)
    new_v = torch.empty(g_count * d, ca, dtype=torch.float64)  # (G*d, C+1)
    new_o = wo.clone()  # (C, Hq*d)
    for g, heads in enumerate(pooling.groups):
        coef, u = fit_keys(stats.keys[g].to(torch.complex128), iterations=KEY_ITERATIONS)  # (d/2, r) each
        new_kc[g] = torch.einsum("ih,hic->ic", coef, kc[heads])  # (d/2, C+1)
        for j, h in enumerate(heads):
            for hp in pooling.query_heads_of(h):
                new_qc[hp] = u[:, j].conj()[:, None] * qc[hp]  # Re(conj(q) z_h) ~ Re(conj(conj(u) q) z')

        qheads = [hp for h in heads for hp in pooling.query_heads_of(h)]  # the group's query heads, in order
        cols = torch.stack([wo[:, hp * d : (hp + 1) * d] for hp in qheads])  # (n*r, C, d)
        reads = [j for j in range(r) for _ in range(n)]
        p, dec = fit_values(
            stats.values[g].double(), cols.transpose(1, 2) @ cols, reads, iterations=VALUE_ITERATIONS
        )
        new_v[g * d : (g + 1) * d] = p @ wv.reshape(geo.num_kv_heads, d, ca)[heads].reshape(r * d, ca)
        for q_local, hp in enumerate(qheads):
            new_o[:, hp * d : (hp + 1) * d] = cols[q_local] @ dec[q_local]

    q_rows = torch.cat([new_qc.real, new_qc.imag], dim=1).reshape(hq * d, ca)  # (Hq*d, C+1)
    k_rows = torch.cat([new_kc.real, new_kc.imag], dim=1).reshape(g_count * d, ca)  # (G*d, C+1)
    out: dict[str, torch.Tensor | None] = {}
    for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", new_v)):
        out[f"{proj}.weight"], out[f"{proj}.bias"] = _split(rows, weights.get(f"{proj}.bias"), dtype)
    out["o_proj.weight"] = new_o.to(weights["o_proj.weight"].dtype).contiguous()
    return out


def pool_layer_on(
    device: torch.device, weights: dict, stats: AttentionStatistics, pooling: Pooling
) -> dict[str, torch.Tensor | None]:
    """`calibrated_pool_layer` on the calibration device, its result on the CPU. On a GPU the float64 solves
    run there (at the 8B shape they are most of the conversion's time on one CPU thread). On the CPU one
    thread fits small groups (r d <= 256: many small products, threads only add synchronisation), the
    command's threads larger ones."""
    if device.type != "cpu":
        with torch.device(device):  # the fit's own new tensors are made there too
            moved = {k: None if v is None else v.to(device) for k, v in weights.items()}
            on = AttentionStatistics(stats.keys.to(device), stats.values.to(device), stats.tokens)
            result = calibrated_pool_layer(weights=moved, stats=on, pooling=pooling)
        return {k: None if v is None else v.cpu() for k, v in result.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if stats.values.shape[-1] <= 256 else threads)
    try:
        return calibrated_pool_layer(weights=weights, stats=stats, pooling=pooling)
    finally:
        torch.set_num_threads(threads)


def calibrate(
    *,
    src_dir: Path,
    pooling: Pooling,
    calibration: CalibrationSpec = CalibrationSpec(),
    progress: bool = True,
    store: MutableMapping[int, dict[str, torch.Tensor | None]] | None = None,
) -> MutableMapping[int, dict[str, torch.Tensor | None]]:
    """Calibrated pooling of every layer: one layer-by-layer forward pass of the source over the calibration
    text of `calibration` (`layerwise.LayerwiseModel`: one decoder layer in memory at a time, on its `device`
    in its `forward_dtype`, windows of its `window`) collects each layer's AttentionStatistics; each layer is
    fitted as soon as the pass has finished it and its statistics are dropped (one layer's statistics in
    memory at a time). Returns `store` (default: a new dict, float32 tensors; `SpilledLayers` keeps them on
    disk) with the new attention tensors of every layer, keyed like `calibrated_pool_layer`'s output. Every
    layer is fitted on the source's own activations (one pass; docs/gqa.md says why not sequentially)."""
    c = calibration
    model = layerwise.LayerwiseModel(src_dir, device=c.device, forward_dtype=c.forward_dtype)
    ids = cal.source_ids(src_dir, c)
    out = {} if store is None else store

    def fit(layer: int, stats: AttentionStatistics) -> None:
        weights = model.attention_weights(layer)  # float32 on the CPU, as the fp32 model holds them
        with stages.stage("fit"):
            out[layer] = pool_layer_on(model.device, weights, stats, pooling)

    with torch.inference_mode():
        collect_attention_statistics(
            model, ids, pooling=pooling, window=c.window, progress=progress, done=fit
        )
    return out
