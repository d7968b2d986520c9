"""Which source KV heads pool together: the query-head grouping of `hf-attn convert gqa --grouping search`.

Shapes: H source KV heads, Hq query heads, n = Hq / H query heads per KV head, d = head_dim, G groups of
r = H / G heads, C hidden size, L layers.

Which heads share a pooled KV head is free: permuting the source's KV heads in head blocks (k_proj / v_proj
rows, d at a time) together with their query heads (q_proj rows and o_proj columns, n d at a time) leaves the
model's function unchanged, and after the permutation the contiguous groups of `conversion.gqa` pool the
chosen heads. So a grouping is a per-layer order of the H heads (`order`, groups = consecutive r-blocks),
and the written checkpoint is plain: permuted q_proj rows / o_proj columns, pooled k_proj / v_proj rows.

The search scores a candidate group by the relative residual of its pooled fit on calibration statistics
(`group_cost`): the key error in the attention-weighted metric of `pool.fit_keys` plus the value error in the
output metric of `pool.fit_values`, each divided by the group's total (for method "mean": the mean pool's
residual; for "calibrated": the fitted pool's). Then, per layer, `choose_groups` takes the partition into G
equal groups with the smallest total cost.

The statistics come from one fp32 pass with a single group over all H heads (`pool.collect_attention_
statistics` with G = 1: per layer H^2 (d/2) H^2 complex + Hq (H d)^2 float64 numbers); any group's
statistics are sub-blocks of them (`slice_statistics`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.checkpoint.io import AttentionGeometry, TensorInfo, layer_attn_keys, read_tensor
from hf_attn.conversion.gqa import pooling as pool
from hf_attn.conversion.specs import CalibrationSpec

_MAX_PARTITIONS = 20_000  # exhaustive search up to this many partitions of the H heads into G groups


def _blocks(tensor: torch.Tensor, order: list[int], block: int, dim: int) -> torch.Tensor:
    """Reorder `tensor` along `dim` in blocks of `block`: new block j = old block order[j]."""
    index = torch.tensor([b * block + i for b in order for i in range(block)], dtype=torch.long)
    return tensor.index_select(dim, index).contiguous()


def permute_layer(
    weights: dict[str, torch.Tensor | None], order: list[int], geometry: AttentionGeometry
) -> dict[str, torch.Tensor | None]:
    """One layer's attention tensors with the source KV heads in `order` (the function is unchanged).

    k/v rows (H*d, C) in blocks of d; q rows (Hq*d, C) in blocks of n*d (the query heads of a KV head);
    o columns (C, Hq*d) in blocks of n*d; biases like their rows."""
    d, n = geometry.head_dim, geometry.group_size
    assert sorted(order) == list(range(geometry.num_kv_heads)), order
    out: dict[str, torch.Tensor | None] = {}
    for name, tensor in weights.items():
        if tensor is None:
            out[name] = None
        elif name.startswith("o_proj."):
            out[name] = _blocks(tensor, order, n * d, dim=1)  # (C, Hq*d)
        elif name.startswith("q_proj."):
            out[name] = _blocks(tensor, order, n * d, dim=0)  # (Hq*d, C) or (Hq*d,)
        else:
            out[name] = _blocks(tensor, order, d, dim=0)  # (H*d, C) or (H*d,)
    return out


def slice_statistics(
    full: pool.AttentionStatistics, groups: list[list[int]], geometry: AttentionGeometry
) -> pool.AttentionStatistics:
    """The statistics of pooling `groups` (after `permute_layer`, as contiguous groups) from one-group ones.

    full.keys (1, H, d/2, H, H), full.values (1, Hq, H d, H d)
      -> keys (G, r, d/2, r, r), values (G, n r, r d, r d)."""
    d, n = geometry.head_dim, geometry.group_size
    keys, values = [], []
    for heads in groups:
        idx = torch.tensor(heads, dtype=torch.long)
        k = full.keys[0].index_select(0, idx).index_select(2, idx).index_select(3, idx)  # (r, d/2, r, r)
        qh = torch.tensor([hp for h in heads for hp in range(h * n, (h + 1) * n)], dtype=torch.long)
        dims = torch.tensor([h * d + i for h in heads for i in range(d)], dtype=torch.long)
        v = full.values[0].index_select(0, qh).index_select(1, dims).index_select(2, dims)  # (n r, r d, r d)
        keys.append(k)
        values.append(v)
    return pool.AttentionStatistics(keys=torch.stack(keys), values=torch.stack(values), tokens=full.tokens)


def key_residual(s: torch.Tensor, coef: torch.Tensor, u: torch.Tensor) -> tuple[float, float]:
    """Residual and total of a pooled key: sum_h sum_i sum_t w |z_h - u_h z'|^2 with z' = coef . z.

    s (r, d/2, r, r) complex group statistics; coef, u (d/2, r). Returns (residual, sum_h S_h[h, h])."""
    r = s.shape[0]
    eye = torch.eye(r, dtype=s.dtype)
    # a: (r, d/2, r), the functional a_h with a_h . z = z_h - u_h z'
    a = eye[:, None, :] - u.T[:, :, None] * coef[None]
    res = torch.einsum("hia,hiab,hib->", a, s, a.conj()).real
    total = sum(s[h, :, h, h].real.sum() for h in range(r))
    return res.item(), total.item()


def value_residual(
    y: torch.Tensor, grams: torch.Tensor, reads: list[int], p: torch.Tensor, dec: torch.Tensor
) -> tuple[float, float]:
    """sum_q tr(G_q (E_q - D_q P) Y_q (E_q - D_q P)^T) and its value at P = 0; shapes as `pool.fit_values`."""
    nq, rd, d = y.shape[0], y.shape[1], grams.shape[1]
    select = torch.stack([torch.eye(rd, dtype=y.dtype)[reads[q] * d : (reads[q] + 1) * d] for q in range(nq)])
    err = select - dec @ p  # (Q, d, r d)
    res = torch.einsum("qab,qbc,qdc,qad->", grams, err, y, err)
    total = torch.einsum("qab,qbc,qdc,qad->", grams, select, y, select)
    return res.item(), total.item()


def group_cost(
    stats: pool.AttentionStatistics, o_weight: torch.Tensor, geometry: AttentionGeometry, *, method: str
) -> float:
    """Relative key + value residual of pooling one group; stats holds that group only (G = 1 slice).

    o_weight (C, n r d): the group's o_proj columns (its query heads, in order)."""
    s = stats.keys[0].to(torch.complex128)  # (r, d/2, r, r)
    y = stats.values[0].double()  # (n r, r d, r d)
    r, half, d, n = s.shape[0], s.shape[1], geometry.head_dim, geometry.group_size
    cols = o_weight.double().reshape(o_weight.shape[0], n * r, d).permute(1, 0, 2)  # (n r, C, d)
    grams = cols.transpose(1, 2) @ cols  # (n r, d, d)
    reads = [j for j in range(r) for _ in range(n)]
    if method == "mean":
        coef = torch.full((half, r), 1.0 / r, dtype=torch.complex128)
        u = torch.ones(half, r, dtype=torch.complex128)
        p = torch.cat([torch.eye(d, dtype=torch.float64) / r] * r, dim=1)  # (d, r d)
        dec = torch.eye(d, dtype=torch.float64).expand(n * r, d, d)
    else:
        coef, u = pool.fit_keys(s, iterations=10)
        p, dec = pool.fit_values(y, grams, reads, iterations=0)
    kr, kt = key_residual(s, coef, u)
    vr, vt = value_residual(y, grams, reads, p, dec)
    return kr / max(kt, 1e-300) + vr / max(vt, 1e-300)


def _partitions(heads: list[int], r: int):
    """Every partition of `heads` into groups of r (each group's smallest head first, groups in order)."""
    if not heads:
        yield []
        return
    first, rest = heads[0], heads[1:]
    for others in itertools.combinations(rest, r - 1):
        group = [first, *others]
        remaining = [h for h in rest if h not in others]
        for tail in _partitions(remaining, r):
            yield [group, *tail]


def partition_count(num_heads: int, num_groups: int) -> int:
    r = num_heads // num_groups
    return math.factorial(num_heads) // (math.factorial(r) ** num_groups * math.factorial(num_groups))


def choose_groups(
    num_heads: int, num_groups: int, cost: Callable[[tuple[int, ...]], float]
) -> list[list[int]]:
    """The partition of range(num_heads) into num_groups equal groups with the least sum of cost(group).

    Exhaustive up to _MAX_PARTITIONS partitions (every group's cost computed once); beyond, a balanced greedy
    clustering on pair costs (seed each group with the cheapest remaining pair, add the head that adds the
    least pair cost) followed by improving swaps of two heads between groups under the group cost."""
    r = num_heads // num_groups
    if r == 1 or num_groups == 1:
        return [list(range(g * r, (g + 1) * r)) for g in range(num_groups)]
    cached = functools.cache(cost)  # every group's cost computed once

    def group(g) -> float:
        return cached(tuple(sorted(g)))

    if partition_count(num_heads, num_groups) <= _MAX_PARTITIONS:
        best = min(_partitions(list(range(num_heads)), r), key=lambda parts: sum(group(g) for g in parts))
        return [sorted(g) for g in best]
    pair = {(a, b): group((a, b)) for a, b in itertools.combinations(range(num_heads), 2)}
    left, groups = set(range(num_heads)), []
    for _ in range(num_groups):
        a, b = min(((a, b) for a, b in pair if a in left and b in left), key=lambda ab: pair[ab])
        members = [a, b]
        left -= {a, b}
        while len(members) < r:
            h = min(left, key=lambda h: sum(group((h, m)) for m in members))
            members.append(h)
            left.remove(h)
        groups.append(members)
    improved = True
    while improved:
        improved = False
        for gi, gj in itertools.combinations(range(num_groups), 2):
            for a in list(groups[gi]):
                for b in list(groups[gj]):
                    ni = [h for h in groups[gi] if h != a] + [b]
                    nj = [h for h in groups[gj] if h != b] + [a]
                    if group(ni) + group(nj) < group(groups[gi]) + group(groups[gj]) - 1e-12:
                        groups[gi], groups[gj], improved = ni, nj, True
                        break
                if improved:
                    break
    return sorted(sorted(g) for g in groups)


def search_and_pool(
    *,
    src_dir: Path,
    index: dict[str, TensorInfo],
    pooling: pool.Pooling,
    method: str,
    calibration: CalibrationSpec = CalibrationSpec(),
    progress: bool = True,
) -> tuple[dict[int, dict[str, torch.Tensor | None]], list[list[list[int]]]]:
    """Per layer, the searched grouping and the new attention tensors (keyed like
    `pool.calibrated_pool_layer`).

    One layer-by-layer pass over the text of `calibration` (`layerwise.LayerwiseModel`, on its `device` in its
    `forward_dtype`, windows of its `window`) collects one-group statistics (memory: (H d)^2-sized moments
    per layer, for all layers); each layer's grouping is chosen by `choose_groups` on `group_cost`; the
    layer is permuted and pooled contiguously: method "mean" pools the checkpoint's own tensors (its dtype,
    bit for bit the mean of the chosen heads), "calibrated" fits on the sliced statistics. Returns (tensors
    per layer, groups per layer)."""
    geo, c = pooling.geometry, calibration
    ids = cal.source_ids(src_dir, c)
    model = layerwise.LayerwiseModel(src_dir, device=c.device, forward_dtype=c.forward_dtype)
    with torch.inference_mode():  # one group of all H heads
        stats = pool.collect_attention_statistics(
            model, ids, pooling=pool.Pooling(geo, 1), window=c.window, progress=progress
        )
    d, n = geo.head_dim, geo.group_size
    out, chosen = {}, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for layer in tqdm(range(geo.num_layers), desc="group+fit", unit="layer", disable=not progress):
            full = stats.pop(layer)
            weights = model.attention_weights(layer)  # float32, as the fp32 model holds them
            wo = weights["o_proj.weight"]

            def cost(heads, full=full, wo=wo):
                sub = slice_statistics(full, [list(heads)], geo)
                cols = torch.cat([wo[:, h * n * d : (h + 1) * n * d] for h in heads], dim=1)  # (C, n r d)
                sub_geo = AttentionGeometry(geo.num_layers, geo.hidden_size, n * len(heads), len(heads), d)
                return group_cost(sub, cols, sub_geo, method=method)

            groups = choose_groups(geo.num_kv_heads, pooling.num_groups, cost)
            chosen.append(groups)
            order = [h for group in groups for h in group]  # the head order that makes `groups` contiguous
            if method == "mean":
                own = {
                    k: read_tensor(index[f]) if f in index else None
                    for k, f in layer_attn_keys(layer).items()
                }
                out[layer] = permute_layer(own, order, geo)
                for k in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
                    if out[layer][k] is not None:
                        out[layer][k] = pool.mean_pool_heads(out[layer][k], pooling=pooling)
            else:
                permuted, sliced = permute_layer(weights, order, geo), slice_statistics(full, groups, geo)
                out[layer] = pool.pool_layer_on(model.device, permuted, sliced, pooling)
    finally:
        torch.set_num_threads(threads)
    return out, chosen
