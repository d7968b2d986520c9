"""The ranks of an MLA conversion: r (RoPE pairs per KV head) and d_c (kv_lora_rank) from a rank or a
`--kv-budget` (`MLAShape`, `plan_shape`, `default_rope_pairs`; `spec_shape`: those of an `MLASpec`, for both
layouts), and per layer where the calibration says the budget matters (`--allocation`).

`--allocation uniform` gives every layer the same r and d_c. The greedy allocations (`plan_allocation`) keep
the uniform plan's total (sum over layers of d_c,i + Hkv 2 r_i <= the budget's numbers times the number of
layers, so the whole cache is never larger) and move ranks across layers (`greedy_allocate`):

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
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.export.engine_dims import conversion_ranks
from hf_attn.conversion.mla import factorization as fac
from hf_attn.conversion.mla import rope_selection as rs
from hf_attn.conversion.specs import DEFAULT_ROPE_SELECTION, KVBudget, MLASpec
from hf_attn.models.llama_mla.configuration_llama_mla import LlamaMLAConfig
from hf_attn.tooling.errors import UserError, user_input

# greedy allocations: the RoPE keys' share of a --kv-budget when r is not given (uniform: 0.5, capped)
GREEDY_ROPE_SHARE = 0.4
NORMALIZATIONS = ("relative", "raw")
DEFAULT_NORMALIZATION = "relative"
DEFAULT_ROPE_SHARE = 0.5  # of a --kv-budget's numbers per token go to the RoPE keys (see default_rope_pairs)
# ... but with these selections at most this fraction of a head's d/2 frequency pairs (see default_rope_pairs)
MAX_ROPE_FRACTION = {"attention": 0.375}
# the DeepSeek layout (one shared RoPE key per layer): r at most this fraction of the d/2 pairs ...
SHARED_MAX_ROPE_FRACTION = 0.5
SHARED_ROPE_SHARE = 1 / 6  # ... and of a --kv-budget's numbers (one key: 2r numbers, not Hkv 2r)


@dataclass(frozen=True)
class MLAShape:
    """Ranks of an MLA conversion; everything else derives from the source geometry."""

    geometry: AttentionGeometry
    rope_pairs: int  # r
    kv_lora_rank: int  # d_c
    shared_rope: bool = False  # the DeepSeek layout: one RoPE key (2r) per layer instead of Hkv

    @property
    def num_key_rows(self) -> int:
        """Rows of the stacked k_nope block: Hkv (d - 2r), d - 2r the non-RoPE key dims of one head."""
        return self.geometry.num_kv_heads * (self.geometry.head_dim - 2 * self.rope_pairs)

    @property
    def full_rank(self) -> int:
        """Width of the stacked [k_nope; v]: Hkv (d - 2r) + Hkv d, the largest useful kv_lora_rank."""
        g = self.geometry
        return LlamaMLAConfig.full_kv_lora_rank(g.num_kv_heads, g.head_dim, self.rope_pairs)

    @property
    def is_full_rank(self) -> bool:
        return self.kv_lora_rank == self.full_rank

    @property
    def rope_keys(self) -> int:
        """RoPE keys cached per token and layer: Hkv (per-head layout) or 1 (shared, DeepSeek layout)."""
        return 1 if self.shared_rope else self.geometry.num_kv_heads

    @property
    def cache_numbers(self) -> int:
        """Numbers cached per token and layer: d_c + Hkv 2r (DeepSeek layout: d_c + 2r)."""
        return LlamaMLAConfig.cache_numbers(self.kv_lora_rank, self.rope_keys, self.rope_pairs)

    @property
    def source_cache_numbers(self) -> int:
        """The source's: 2 Hkv d."""
        return 2 * self.geometry.kv_dim

    @property
    def kv_fraction(self) -> float:
        return self.cache_numbers / self.source_cache_numbers


def default_rope_pairs(
    geometry: AttentionGeometry,
    kv_budget: float | None,
    share: float | None = None,
    *,
    selection: str = DEFAULT_ROPE_SELECTION,
) -> int:
    """r when --rope-pairs is not given: every pair without a budget; with one, the RoPE keys take `share`
    of the budget's numbers, rounded to whole pairs per KV head, at least one, and leaving at least 1/8 of
    the budget to the latent.

    The default (`share=None`) is DEFAULT_ROPE_SHARE, capped for the `attention` selection at
    MAX_ROPE_FRACTION of the d/2 pairs; docs/mla.md says why (docs/results/mla-allocation.md measures it)."""
    half = geometry.head_dim // 2
    if kv_budget is None:
        return half
    numbers = KVBudget(kv_budget).numbers(geometry.kv_dim)
    if numbers >= 2 * geometry.kv_dim:  # the whole source cache: the exact conversion fits
        return half
    cap = half if share is not None else math.ceil(MAX_ROPE_FRACTION.get(selection, 1.0) * half)
    share = DEFAULT_ROPE_SHARE if share is None else share
    per_pair = 2 * geometry.num_kv_heads
    r = min(round(share * numbers / per_pair), int(numbers * 7 / 8) // per_pair, cap)
    return max(1, min(half, r))


def shared_rope_pairs(half: int, kv_dim: int, kv_budget: float | None) -> int:
    """r of the DeepSeek layout when --rope-pairs is not given: every pair without a budget or with the whole
    source cache; else SHARED_ROPE_SHARE of the budget's numbers (2r of them), at most
    SHARED_MAX_ROPE_FRACTION of the pairs, at least 1."""
    if kv_budget is None:
        return half
    numbers = KVBudget(kv_budget).numbers(kv_dim)
    if numbers >= KVBudget.source_numbers(kv_dim):
        return half
    shared = round(SHARED_ROPE_SHARE * numbers / 2)
    return max(1, min(shared, int(SHARED_MAX_ROPE_FRACTION * half), numbers // 4))


def plan_shape(
    geometry: AttentionGeometry,
    *,
    kv_lora_rank: int | None = None,
    kv_budget: float | None = None,
    rope_pairs: int | None = None,
    rope_selection: str = DEFAULT_ROPE_SELECTION,
    layout: str = "per-head",
) -> MLAShape:
    """Validate / derive (r, d_c). Neither rank nor budget: full rank (exact with r = d/2)."""
    shared, half, r = layout == "deepseek", geometry.head_dim // 2, rope_pairs
    if r is None and shared:
        r = shared_rope_pairs(half, geometry.kv_dim, kv_budget)
    elif r is None:
        r = default_rope_pairs(geometry, kv_budget, selection=rope_selection)
    if not isinstance(r, int) or not 0 <= r <= half:
        raise ValueError(
            f"--rope-pairs must be an integer in [0, head_dim / 2 = {half}] (head_dim {geometry.head_dim}), "
            f"got {r!r}."
        )
    full = MLAShape(geometry, r, 1).full_rank
    hkv = 1 if shared else geometry.num_kv_heads  # RoPE keys cached per token
    if kv_budget is not None:
        numbers = KVBudget(kv_budget).numbers(geometry.kv_dim)  # (validates the fraction)
        rank = min(numbers - hkv * 2 * r, full)
        if rank < 1:
            fits = (numbers - 1) // (2 * hkv)  # RoPE pairs that leave the latent one number
            least = (hkv * 2 * r + 1) / (2 * geometry.kv_dim)  # the smallest budget with these r pairs
            fix = f"raise --kv-budget to at least {least:.4g}"
            if fits >= 0:
                fix = f"lower --rope-pairs (at most {fits}) or {fix}"
            raise UserError(
                f"--kv-budget {kv_budget} allows {numbers} numbers per token and layer (source: "
                f"{2 * geometry.kv_dim}), but {r} RoPE pairs on {hkv} KV heads already take {hkv * 2 * r} "
                f"and the latent needs at least 1; {fix}"
            )
        return MLAShape(geometry, r, rank, shared)
    rank = full if kv_lora_rank is None else kv_lora_rank
    if not isinstance(rank, int) or not 1 <= rank <= full:
        raise UserError(
            f"--kv-lora-rank must be in [1, {full}] = Hkv*(d-2r) + Hkv*d = "
            f"{geometry.num_kv_heads}*{geometry.head_dim - 2 * r} + "
            f"{geometry.num_kv_heads}*{geometry.head_dim} for --rope-pairs {r}, "
            f"got {rank!r}; a larger latent cannot help."
        )
    return MLAShape(geometry, r, rank, shared)


def spec_shape(spec: MLASpec, geometry: AttentionGeometry) -> MLAShape:
    """The ranks (r, d_c) of `spec` on the source's geometry: from --engine-dims, the budget (its greedy
    allocation places fewer RoPE pairs) or the given ranks; UserError where they do not fit."""
    kv_lora_rank, rope_pairs = spec.kv_lora_rank, spec.rope_pairs
    budget = None if spec.budget is None else spec.budget.fraction
    with user_input():
        if spec.engine_dims is not None:  # d_c and r whose export has exactly a size vLLM's MLA backends take
            kv_lora_rank, rope_pairs = conversion_ranks(
                spec.engine_dims, head_dim=geometry.head_dim, num_kv_heads=geometry.num_kv_heads
            )
        greedy = spec.allocation_method != "uniform" and spec.layout == "per-head"
        if greedy and rope_pairs is None and budget is not None:
            # r (the mean over layers): GREEDY_ROPE_SHARE of the budget, capped like the uniform rule; placed
            # where they count, fewer pairs suffice (docs/research/mla-allocation.md measures it)
            capped = default_rope_pairs(geometry, budget)
            rope_pairs = min(default_rope_pairs(geometry, budget, GREEDY_ROPE_SHARE), capped)
        return plan_shape(
            geometry,
            kv_lora_rank=kv_lora_rank,
            kv_budget=budget,
            rope_pairs=rope_pairs,
            rope_selection=spec.rope_selection,
            layout=spec.layout,
        )


@dataclass(frozen=True)
class Allocation:
    """Per-layer ranks: r_i RoPE pairs per KV head and d_c,i latent width, and the kept pairs."""

    rope_pairs: list[int]  # [L]
    kv_lora_ranks: list[int]  # [L]
    pairs: list[list[list[int]]]  # [L][Hkv][r_i]


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
    spectra: list[torch.Tensor], *, total_rank: int, normalization: str = DEFAULT_NORMALIZATION
) -> list[int]:
    """d_c,i per layer with sum d_c,i <= total_rank, each in [1, len(spectra[i])]: the greedy optimum of
    the summed (normalised) truncation errors. spectra[i]: (W_i,) descending eigenvalues of layer i."""
    gains = [relative_gains(ev, normalization)[1:] for ev in spectra]
    return greedy_allocate(gains, minimum=[1] * len(spectra), budget=total_rank)


def plan_allocation(
    *,
    geometry,
    read_layer,
    pair_scores: dict[int, torch.Tensor],
    query_fit: dict[int, torch.Tensor] | None,
    moment,
    rope_pairs: int,
    kv_lora_rank: int,
    allocate_latent: bool = True,
) -> tuple[Allocation, dict]:
    """Greedy per-layer (r_i, d_c,i) with the totals of the uniform plan (r, d_c) in every layer.

    read_layer(i) -> the source's float64 attention weights of layer i ("q_proj.weight", ... as in
    `mla.convert_layer`); moment(i) -> its calibration input moment (read when asked for, never all at
    once); pair_scores / query_fit: the calibration's `attention` pair scores and query refit per layer.
    Returns the allocation and its record (per-layer lists, the normalisation and, with `allocate_latent`,
    each layer's relative metric error at its rank: without it no spectrum is computed, d_c being every
    layer's)."""
    L, d = geometry.num_layers, geometry.head_dim
    scores = [pair_scores[i] for i in range(L)]
    if 0 < rope_pairs < d // 2:
        r_layers = allocate_pairs(scores, total_pairs=L * rope_pairs)
    else:
        r_layers = [rope_pairs] * L
    pairs = [rs.top_pairs(scores[i], r_layers[i]) for i in range(L)]
    method = "greedy-ranks" if allocate_latent else "greedy"
    record = {"method": method, "normalization": DEFAULT_NORMALIZATION}
    if not allocate_latent:  # d_c in every layer, at most the rows of its [k_nope; v] stack: no spectrum
        ranks = [min(kv_lora_rank, geometry.num_kv_heads * (2 * d - 2 * r)) for r in r_layers]
        record.update(layer_rope_pairs=r_layers, layer_kv_lora_ranks=ranks)
        return Allocation(r_layers, ranks, pairs), record
    spectra = []
    for i in tqdm(range(L), desc="allocation", unit="layer"):
        # the inputs prepared as `layer.convert_layer` prepares the `attention` factorization: query refit
        # of the dropped pairs, rows permuted to [rope | nope]
        weights, rows = read_layer(i), rs.layer_rows(pairs[i], geometry)
        w_q, b_q = weights["q_proj.weight"], weights.get("q_proj.bias")
        if query_fit is not None:
            w_q, b_q = rs.apply_query_fit(w_q, b_q, query_fit[i], pairs[i], geometry.group_size)
        b_q = None if b_q is None else b_q[rows["q"]]
        w_q, b_q = rs.nope_queries(w_q[rows["q"]], b_q, geometry, r_layers[i])
        spectrum = fac.attention_spectrum(
            w_k=weights["k_proj.weight"][rows["k_nope"]],
            w_v=weights["v_proj.weight"],
            b_v=weights.get("v_proj.bias"),
            w_q=w_q,
            b_q=b_q,
            w_o=weights["o_proj.weight"],
            moment=moment(i),
            num_kv_heads=geometry.num_kv_heads,
        )
        spectra.append(spectrum)
    ranks = allocate_ranks(spectra, total_rank=L * kv_lora_rank)
    kept = [float(1 - ev[:c].sum() / ev.sum().clamp_min(1e-300)) for ev, c in zip(spectra, ranks)]
    record.update(layer_rope_pairs=r_layers, layer_kv_lora_ranks=ranks)
    record["layer_relative_metric_error"] = [round(e, 6) for e in kept]
    return Allocation(r_layers, ranks, pairs), record
