"""Per-layer ranks for MLA conversion: spend one `--kv-budget` where the calibration says it matters.

`--allocation uniform` gives every layer the same r (RoPE pairs per KV head) and d_c (kv_lora_rank).
The greedy allocations keep the uniform plan's total (sum over layers of d_c,i + Hkv 2 r_i <= the budget's
numbers times the number of layers, so the whole cache is never larger) and move ranks across layers:

1. RoPE pairs (`greedy` and `greedy-ranks`). The `attention` selection scores every (layer, KV head, pair)
   by the attention-score error its loss of rotation leaves after the query refit
   (`rope_selection.AttentionPairStats`): one more pair in layer i gains the sum over its KV heads of their
   next-best pair's score. The scores of all layers are in the same unit (squared logits, summed over the
   same calibration queries), so they are compared as they are; each layer's gains do not increase with
   r, so taking the largest gains first is optimal for the summed score kept. The total number of pairs
   is the uniform plan's r times the layers, r from GREEDY_ROPE_SHARE of the budget when not given.
2. Latent ranks (`greedy-ranks` only; `greedy` keeps d_c in every layer). `factorization.attention_spectrum`
   gives the eigenvalues of the metric that the `attention` factorization truncates: rank c leaves the sum
   of the eigenvalues after the c-th as error, so the gain of the c-th dimension is its eigenvalue
   (non-increasing: greedy is optimal). Layers are made comparable by dividing each layer's eigenvalues by
   their sum, the layer's attention energy in that metric (its error at rank 0): the allocation minimises
   the sum of the layers' relative errors (`normalization="raw"`: the absolute errors).
   docs/research/mla-allocation.md measures both against `greedy`: moving latent rank did not pay on SmolLM2.

Pure functions on tensors (`greedy_allocate`, `allocate_pairs`, `allocate_ranks`) and one planner
(`plan_allocation`) that reads a conversion's weights and calibration.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

ALLOCATIONS = ("uniform", "greedy", "greedy-ranks")
# greedy allocations: the RoPE keys' share of a --kv-budget when r is not given (uniform: 0.5, capped)
GREEDY_ROPE_SHARE = 0.4
NORMALIZATIONS = ("relative", "raw")
DEFAULT_NORMALIZATION = "relative"


@dataclass(frozen=True)
class Allocation:
    """Per-layer ranks: r_i RoPE pairs per KV head and d_c,i latent width, and the kept pairs."""

    rope_pairs: list[int]  # [L]
    kv_lora_ranks: list[int]  # [L]
    pairs: list[list[list[int]]]  # [L][Hkv][r_i]

    def cache_numbers(self, num_rope_keys: int) -> list[int]:
        """Numbers cached per token in each layer: d_c,i + Hr 2 r_i."""
        return [c + num_rope_keys * 2 * r for c, r in zip(self.kv_lora_ranks, self.rope_pairs)]


def greedy_allocate(gains: list[torch.Tensor], *, minimum: list[int], budget: int) -> list[int]:
    """Units per layer maximising the summed gain: layer i gets minimum[i] + k_i units, where unit j of layer
    i (after its minimum) gains gains[i][j] (non-increasing in j) and sum k_i <= budget - sum minimum.

    With non-increasing gains the largest `budget - sum minimum` gains overall are optimal (an exchange
    argument); ties go to the lower layer. ValueError if the minimums alone exceed the budget."""
    free = budget - sum(minimum)
    if free < 0:
        raise ValueError(f"the per-layer minimums {minimum} need {sum(minimum)} units, more than {budget}.")
    for i, g in enumerate(gains):
        if len(g) > 1 and bool((g[1:] > g[:-1] + 1e-12 * g.abs().max()).any()):
            raise ValueError(f"gains of layer {i} must be non-increasing for the greedy allocation.")
    heap = [(-float(g[0]), i, 0) for i, g in enumerate(gains) if len(g)]
    heapq.heapify(heap)
    taken = [0] * len(gains)
    while free > 0 and heap:
        _, i, j = heapq.heappop(heap)
        taken[i] += 1
        free -= 1
        if j + 1 < len(gains[i]):
            heapq.heappush(heap, (-float(gains[i][j + 1]), i, j + 1))
    return [m + k for m, k in zip(minimum, taken)]


def allocate_pairs(scores: list[torch.Tensor], *, total_pairs: int, minimum: int = 1) -> list[int]:
    """r_i per layer (same r for every KV head of a layer) with sum r_i = total_pairs (or every pair when
    fewer). scores[i]: (Hkv, d/2) the `attention` selection's pair scores of layer i (larger = keep)."""
    gains = []
    for s in scores:
        ranked = torch.sort(s.double(), dim=1, descending=True).values  # (Hkv, d/2), per head best first
        gains.append(ranked.sum(0)[minimum:])  # (d/2 - minimum,): gain of the (minimum + j + 1)-th pair
    return greedy_allocate(gains, minimum=[minimum] * len(scores), budget=total_pairs)


def relative_gains(eigenvalues: torch.Tensor, normalization: str = DEFAULT_NORMALIZATION) -> torch.Tensor:
    """Gains of the latent dims of one layer: its eigenvalues (descending), divided by their sum for
    `relative`, as they are for `raw`."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"Unknown normalization {normalization!r}; choose one of {', '.join(NORMALIZATIONS)}."
        )
    ev = eigenvalues.double()
    if normalization == "raw":
        return ev
    return ev / ev.sum().clamp_min(1e-300)


def allocate_ranks(
    spectra: list[torch.Tensor],
    *,
    total_rank: int,
    normalization: str = DEFAULT_NORMALIZATION,
    minimum: int = 1,
) -> list[int]:
    """d_c,i per layer with sum d_c,i <= total_rank, each in [minimum, len(spectra[i])]: the greedy optimum
    of the summed (normalised) truncation errors. spectra[i]: (W_i,) descending eigenvalues of layer i."""
    gains = [relative_gains(ev, normalization)[minimum:] for ev in spectra]
    return greedy_allocate(gains, minimum=[minimum] * len(spectra), budget=total_rank)


# --------------------------------------------------------------------------------------------- planner


def default_allocation(
    *, kv_budget: float | None, given_ranks: bool, layout: str, selection: str, factorization: str
) -> str:
    """`greedy` where it applies and the user left the ranks to the budget (per-head layout, `attention`
    selection and factorization, no --rope-pairs / --kv-lora-rank); `uniform` otherwise. `greedy` is at
    least as good as `uniform` at every budget measured (docs/research/mla-allocation.md)."""
    ok = kv_budget is not None and not given_ranks and layout == "per-head"
    return "greedy" if ok and selection == "attention" and factorization == "attention" else "uniform"


def default_rope_pairs(geometry, kv_budget: float, uniform_rule) -> int:
    """r (the mean over layers) for `greedy` when --rope-pairs is not given: GREEDY_ROPE_SHARE of the
    budget's numbers, capped like the uniform rule (`uniform_rule` = mla.default_rope_pairs). Placing the
    pairs where they count makes fewer of them suffice (docs/research/mla-allocation.md measures it)."""
    shared = uniform_rule(geometry, kv_budget, GREEDY_ROPE_SHARE)
    return min(shared, uniform_rule(geometry, kv_budget))


def layer_spectrum(*, weights: dict, pairs: list[list[int]], geometry, query_fit) -> tuple:
    """(stack inputs of `fac.attention_spectrum`) for one layer at its kept `pairs`, prepared exactly as
    `mla.convert_layer` prepares the `attention` factorization (query refit of the dropped pairs, rows
    permuted to [rope | nope])."""
    from hf_attn.conversion import rope_selection as rs
    from hf_attn.conversion.mla import layer_rows

    geo = geometry
    rows = layer_rows(pairs, geo)
    w_q, b_q = weights["q_proj.weight"], weights.get("q_proj.bias")
    if query_fit is not None:
        half = geo.head_dim // 2
        dropped = [[i for i in range(half) if i not in set(p)] for p in pairs]
        w_q, b_q = rs.apply_query_fit(w_q, b_q, query_fit, dropped, geo.group_size)
    rd = 2 * len(pairs[0])
    q = w_q[rows["q"]].view(geo.num_heads, geo.head_dim, -1)[:, rd:]  # (Hq, d - 2r, C)
    qb = None if b_q is None else b_q[rows["q"]].view(geo.num_heads, geo.head_dim)[:, rd:]  # (Hq, d - 2r)
    return dict(
        w_k=weights["k_proj.weight"][rows["k_nope"]],
        w_v=weights["v_proj.weight"],
        b_v=weights.get("v_proj.bias"),
        w_q=q.reshape(-1, q.shape[-1]),
        b_q=None if qb is None else qb.reshape(-1),
        w_o=weights["o_proj.weight"],
        num_kv_heads=geo.num_kv_heads,
    )


def plan_allocation(
    *,
    geometry,
    read_layer,
    pair_scores: dict[int, torch.Tensor],
    query_fit: dict[int, torch.Tensor] | None,
    moments: dict[int, torch.Tensor],
    rope_pairs: int,
    kv_lora_rank: int,
    normalization: str = DEFAULT_NORMALIZATION,
    allocate_rope: bool = True,
    allocate_latent: bool = True,
    min_pairs: int = 1,
    progress: bool = True,
) -> tuple[Allocation, dict]:
    """Greedy per-layer (r_i, d_c,i) with the totals of the uniform plan (r, d_c) in every layer.

    read_layer(i) -> the source's float64 attention weights of layer i ("q_proj.weight", ... as in
    `mla.convert_layer`); pair_scores / query_fit / moments: the calibration's `attention` pair scores,
    query refit and input moments per layer. Returns the allocation and its record (per-layer lists, the
    normalisation and each layer's relative metric error at its rank)."""
    from tqdm.auto import tqdm

    from hf_attn.conversion import factorization as fac
    from hf_attn.conversion import rope_selection as rs

    L, d = geometry.num_layers, geometry.head_dim
    scores = [pair_scores[i] for i in range(L)]
    if allocate_rope and 0 < rope_pairs < d // 2:
        r_layers = allocate_pairs(scores, total_pairs=L * rope_pairs, minimum=min(min_pairs, rope_pairs))
    else:
        r_layers = [rope_pairs] * L
    pairs = [rs.top_pairs(scores[i], r_layers[i]) for i in range(L)]
    spectra = []
    for i in tqdm(range(L), desc="allocation", unit="layer", disable=not progress):
        inputs = layer_spectrum(
            weights=read_layer(i),
            pairs=pairs[i],
            geometry=geometry,
            query_fit=None if query_fit is None else query_fit[i],
        )
        spectra.append(fac.attention_spectrum(**inputs, moment=moments[i]))
    if allocate_latent:
        ranks = allocate_ranks(spectra, total_rank=L * kv_lora_rank, normalization=normalization)
    else:
        ranks = [min(kv_lora_rank, len(ev)) for ev in spectra]
    kept = [float(1 - ev[:c].sum() / ev.sum().clamp_min(1e-300)) for ev, c in zip(spectra, ranks)]
    record = {
        "method": "greedy-ranks" if allocate_latent else "greedy",
        "normalization": normalization,
        "layer_rope_pairs": r_layers,
        "layer_kv_lora_ranks": ranks,
        "layer_relative_metric_error": [round(e, 6) for e in kept],
    }
    return Allocation(r_layers, ranks, pairs), record
