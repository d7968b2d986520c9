"""MLA conversion, one layer: the ranks (`MLAShape`, from a rank or a KV budget), the row permutation of
partial RoPE and the factorization of one attention layer into `llama_mla` tensors (`convert_layer`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.conversion import factorization as fac
from hf_attn.conversion import rope_selection as rs
from hf_attn.conversion import shared_rope as sr
from hf_attn.conversion.checkpoint import AttentionGeometry
from hf_attn.models.llama_mla.configuration_llama_mla import LlamaMLAConfig
from hf_attn.models.llama_mla.modeling_llama_mla import rope_dim_indices
from hf_attn.tooling.errors import UserError

DEFAULT_ROPE_SELECTION = "attention"
DEFAULT_FACTORIZATION = "attention"
DEFAULT_ROPE_SHARE = 0.5  # of a --kv-budget's numbers per token go to the RoPE keys (see default_rope_pairs)
# ... but with these selections at most this fraction of a head's d/2 frequency pairs (see default_rope_pairs)
MAX_ROPE_FRACTION = {"attention": 0.375}


# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class MLAShape:
    """Ranks of an MLA conversion; everything else derives from the source geometry."""

    geometry: AttentionGeometry
    rope_pairs: int  # r
    kv_lora_rank: int  # d_c
    shared_rope: bool = False  # the DeepSeek layout: one RoPE key (2r) per layer instead of Hkv

    @property
    def nope_dim(self) -> int:
        """d - 2r: the non-RoPE key dims of one head."""
        return self.geometry.head_dim - 2 * self.rope_pairs

    @property
    def num_key_rows(self) -> int:
        """Rows of the stacked k_nope block: Hkv (d - 2r)."""
        return self.geometry.num_kv_heads * self.nope_dim

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
    numbers = _budget_numbers(kv_budget, geometry)
    if numbers >= 2 * geometry.kv_dim:  # the whole source cache: the exact conversion fits
        return half
    cap = half if share is not None else math.ceil(MAX_ROPE_FRACTION.get(selection, 1.0) * half)
    share = DEFAULT_ROPE_SHARE if share is None else share
    per_pair = 2 * geometry.num_kv_heads
    r = min(round(share * numbers / per_pair), int(numbers * 7 / 8) // per_pair, cap)
    return max(1, min(half, r))


def _budget_numbers(kv_budget: float, geometry: AttentionGeometry) -> int:
    """Numbers per token and layer a KV budget allows (`specs.KVBudget`, validated there)."""
    from hf_attn.conversion.specs import KVBudget  # (specs reads this module's defaults)

    return KVBudget(kv_budget).numbers(geometry.kv_dim)


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
    if kv_lora_rank is not None and kv_budget is not None:
        raise UserError("Give either --kv-lora-rank or --kv-budget, not both.")
    shared = layout == "deepseek"
    if rope_pairs is None and shared:
        rope_pairs = sr.default_rope_pairs(geometry.head_dim // 2, geometry.kv_dim, kv_budget)
    if rope_pairs is None:
        rope_pairs = default_rope_pairs(geometry, kv_budget, selection=rope_selection)
    r = rope_pairs
    rs.check_rope_pairs(r, geometry.head_dim)
    full = MLAShape(geometry, r, 1).full_rank
    hkv = 1 if shared else geometry.num_kv_heads  # RoPE keys cached per token
    if kv_budget is not None:
        numbers = _budget_numbers(kv_budget, geometry)  # (validates the fraction)
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


# --------------------------------------------------------------------------------------------- one layer


def head_row_order(pairs: list[int], head_dim: int) -> tuple[list[int], list[int]]:
    """Head-local rows (contract): rope part [P, P + d/2] (2r rows, the model's `rope_dim_indices`), nope
    part the other d - 2r rows in ascending order ([C, C + d/2], C the dropped pairs)."""
    rope = rope_dim_indices([list(pairs)], head_dim)[0].tolist()  # (2r,)
    kept = set(rope)
    return rope, [j for j in range(head_dim) if j not in kept]


def layer_rows(pairs: list[list[int]], geometry: AttentionGeometry) -> dict[str, list[int]]:
    """Global row indices of one layer: "q" (Hq d, every query head permuted like its KV head), "k_rope"
    (Hkv 2r) and "k_nope" (Hkv (d - 2r)) into the source's q_proj / k_proj rows, head-major."""
    d, group = geometry.head_dim, geometry.group_size
    orders = [head_row_order(p, d) for p in pairs]
    q = [h * d + j for h in range(geometry.num_heads) for j in orders[h // group][0] + orders[h // group][1]]
    k_rope = [g * d + j for g, (rope, _) in enumerate(orders) for j in rope]
    k_nope = [g * d + j for g, (_, nope) in enumerate(orders) for j in nope]
    return {"q": q, "k_rope": k_rope, "k_nope": k_nope}


@dataclass
class LayerStatistics:
    """Calibration statistics of one layer (whatever the chosen options need)."""

    moment: torch.Tensor | None = None  # (C+1, C+1) float64, sum [x;1][x;1]^T
    shared_keys: torch.Tensor | None = None  # (Hkv, d/2, Hkv, Hkv) complex: sr.SharedKeyStatistics
    samples: list[torch.Tensor] | None = None  # inputs x of every sr-sampled token, each (n, C) float32

    def has(self, name: str) -> bool:
        return getattr(self, name) is not None


class SpilledLayerStatistics:
    """A layer's LayerStatistics in files of a scratch directory, one per statistic, read back on every
    access: the statistics of all layers are never in memory together (a 7B layer: a 134 MB moment,
    33.5 MB of shared-key sums for 32 KV heads, 134 MB of samples at 16,384 calibration tokens)."""

    FIELDS = ("moment", "shared_keys", "samples")

    def __init__(self, stats: LayerStatistics, directory: Path, layer: int) -> None:
        self.paths: dict[str, Path] = {}
        for name in self.FIELDS:
            value = getattr(stats, name)
            if value is None:
                continue
            if name == "samples":
                value = [torch.cat(value)]  # (N, C) float32, one tensor
            self.paths[name] = directory / f"{name}-{layer}.pt"
            torch.save(value, self.paths[name])

    def has(self, name: str) -> bool:
        return name in self.paths

    def _load(self, name: str):
        path = self.paths.get(name)
        return None if path is None else torch.load(path, weights_only=True)  # as it was saved

    moment = property(lambda self: self._load("moment"))
    shared_keys = property(lambda self: self._load("shared_keys"))
    samples = property(lambda self: self._load("samples"))


class _Moments(Mapping):
    """layer -> the input moment of `statistics[layer]`, read when asked for (never all at once)."""

    def __init__(self, statistics: dict) -> None:
        self.statistics = statistics

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.statistics[layer].moment

    def __iter__(self):
        return iter(self.statistics)

    def __len__(self) -> int:
        return len(self.statistics)


def mla_shapes(
    shape: MLAShape, *, qkv_bias: bool, o_bias: bool, latent_norm: bool = True
) -> dict[str, tuple[int, ...]]:
    """ "k_up_proj.weight" ... -> shape of one converted layer's attention tensors."""
    g = shape.geometry
    c, d, hkv, hq = g.hidden_size, g.head_dim, g.num_kv_heads, g.num_heads
    rope_rows = shape.rope_keys * 2 * shape.rope_pairs
    out = {
        "q_proj.weight": (hq * d, c),
        "k_rope_proj.weight": (rope_rows, c),
        "kv_down_proj.weight": (shape.kv_lora_rank, c),
        "k_up_proj.weight": (shape.num_key_rows, shape.kv_lora_rank),
        "v_up_proj.weight": (hkv * d, shape.kv_lora_rank),
        "o_proj.weight": (c, hq * d),
    }
    if qkv_bias:
        out.update(
            {
                "q_proj.bias": (hq * d,),
                "k_rope_proj.bias": (rope_rows,),
                "k_up_proj.bias": (shape.num_key_rows,),
                "v_up_proj.bias": (hkv * d,),
            }
        )
    if o_bias:
        out["o_proj.bias"] = (c,)
    if shape.shared_rope and latent_norm:  # the DeepSeek layout's latent RMSNorm
        out["latent_norm.weight"] = (shape.kv_lora_rank,)
    return out


@torch.inference_mode()
def convert_layer(
    *,
    weights: dict[str, torch.Tensor | None],
    pairs: list[list[int]],
    shape: MLAShape,
    factorization: str,
    statistics: LayerStatistics | None = None,
    query_fit: torch.Tensor | None = None,
    shared_key: sr.SharedKey | None = None,
    norm_eps: float | None = None,
    norm_refine_steps: int = 0,
) -> dict[str, torch.Tensor]:
    """One attention layer, source -> llama_mla tensors (keys as in `mla_shapes`; dtype of the source).

    weights: "q_proj.weight" (Hq d, C), "k_proj.weight" / "v_proj.weight" (Hkv d, C), "o_proj.weight"
    (C, Hq d) and the biases ((out,) or None). pairs: [Hkv][r] kept RoPE pairs of this layer.
    query_fit: (Hq, d/2) complex factors for the query rows of the dropped pairs (selection `attention`).
    DeepSeek layout (shape.shared_rope): `shared_key` (the fit on pairs[0], every head's pairs equal) and
    `norm_eps` (the latent RMSNorm's eps; the decoders are refitted on `statistics.samples`).
    """
    geo = shape.geometry
    dtype = weights["q_proj.weight"].dtype
    rows = layer_rows(pairs, geo)
    qkv_bias, o_bias = weights.get("q_proj.bias") is not None, weights.get("o_proj.bias") is not None
    w_q, b_q = weights["q_proj.weight"], weights.get("q_proj.bias")
    if query_fit is not None:
        half = geo.head_dim // 2
        dropped = [[i for i in range(half) if i not in set(p)] for p in pairs]
        w_q, b_q = rs.apply_query_fit(w_q, b_q, query_fit, dropped, geo.group_size)
    out: dict[str, torch.Tensor] = {}
    out["q_proj.weight"] = w_q[rows["q"]]
    out["k_rope_proj.weight"] = weights["k_proj.weight"][rows["k_rope"]]
    stack_w = torch.cat([weights["k_proj.weight"][rows["k_nope"]], weights["v_proj.weight"]])  # (W, C)
    stack_b = None
    if qkv_bias:
        out["q_proj.bias"] = b_q[rows["q"]]
        out["k_rope_proj.bias"] = weights["k_proj.bias"][rows["k_rope"]]
        stack_b = torch.cat([weights["k_proj.bias"][rows["k_nope"]], weights["v_proj.bias"]])  # (W,)

    low = _factorize(
        factorization,
        shape=shape,
        stack_w=stack_w,
        stack_b=stack_b,
        statistics=statistics,
        q=out["q_proj.weight"],
        q_bias=out.get("q_proj.bias"),
        w_o=weights["o_proj.weight"],
    )
    nk = shape.num_key_rows
    if shape.shared_rope:
        _deepseek_layer(
            out, low, stack_w, stack_b, shape, shared_key, statistics, norm_eps, norm_refine_steps
        )
        low = fac.LowRank(out.pop("kv_down_proj.weight"), out.pop("up"), out.pop("up_bias", None))
    out["kv_down_proj.weight"] = low.down.to(dtype).contiguous()
    out["k_up_proj.weight"] = low.up[:nk].to(dtype).contiguous()
    out["v_up_proj.weight"] = low.up[nk:].to(dtype).contiguous()
    if qkv_bias:
        assert low.up_bias is not None
        out["k_up_proj.bias"] = low.up_bias[:nk].to(dtype).contiguous()
        out["v_up_proj.bias"] = low.up_bias[nk:].to(dtype).contiguous()
    out["o_proj.weight"] = weights["o_proj.weight"]
    if o_bias:
        out["o_proj.bias"] = weights["o_proj.bias"]
    for key in [k for k in out if k.startswith(("q_proj.", "k_rope_proj.", "latent_norm."))]:
        out[key] = out[key].to(dtype).contiguous()
    expected = mla_shapes(shape, qkv_bias=qkv_bias, o_bias=o_bias, latent_norm=norm_eps is not None)
    assert set(out) == set(expected), (sorted(out), sorted(expected))
    for key, tensor in out.items():
        assert tuple(tensor.shape) == expected[key], (key, tuple(tensor.shape), expected[key])
    return out


def _factorize(
    factorization: str,
    *,
    shape: MLAShape,
    stack_w: torch.Tensor,
    stack_b: torch.Tensor | None,
    statistics: LayerStatistics | None,
    q: torch.Tensor,
    q_bias: torch.Tensor | None,
    w_o: torch.Tensor,
) -> fac.LowRank:
    """The low-rank factorization of one layer's stacked nope keys and values.

    Args:
        factorization: one of `fac.FACTORIZATIONS` (full rank whatever it is when `shape.is_full_rank`).
        shape: the layer's ranks.
        stack_w: (W, C) `[k_proj nope rows (all KV heads); v_proj]`; stack_b: (W,) or None, the same rows'
            biases.
        statistics: the calibration statistics (`activation` and `attention` read `statistics.moment`).
        q: (Hq d, C) the permuted query rows, rope first in each head; q_bias: (Hq d,) or None.
        w_o: (C, Hq d) o_proj.
    """
    geo = shape.geometry
    if shape.is_full_rank:
        return fac.full_rank(stack_w, stack_b)
    elif factorization == "weight-svd":
        return fac.weight_svd(stack_w, stack_b, shape.kv_lora_rank)
    elif factorization == "activation":
        assert statistics is not None and statistics.moment is not None, "activation needs calibration"
        return fac.activation_pca(
            stack_w, stack_b, shape.kv_lora_rank, moment=statistics.moment, num_key_rows=shape.num_key_rows
        )
    elif factorization == "attention":
        assert statistics is not None and statistics.moment is not None, "attention needs calibration"
        nk, rd = shape.num_key_rows, 2 * shape.rope_pairs
        q_nope = q.view(geo.num_heads, geo.head_dim, -1)[:, rd:]  # (Hq, d - 2r, C)
        qb_nope = None if q_bias is None else q_bias.view(geo.num_heads, geo.head_dim)[:, rd:]
        return fac.attention_pca(
            w_k=stack_w[:nk],
            b_k=None if stack_b is None else stack_b[:nk],
            w_v=stack_w[nk:],
            b_v=None if stack_b is None else stack_b[nk:],
            w_q=q_nope.reshape(-1, q_nope.shape[-1]),
            b_q=None if qb_nope is None else qb_nope.reshape(-1),
            w_o=w_o,
            moment=statistics.moment,
            num_kv_heads=geo.num_kv_heads,
            rank=shape.kv_lora_rank,
        )
    else:
        raise ValueError(
            f"Unknown --factorization {factorization!r}; choose one of {', '.join(fac.FACTORIZATIONS)}."
        )


def _deepseek_layer(out, low, stack_w, stack_b, shape, shared_key, statistics, norm_eps, refine=0) -> None:
    """The DeepSeek layout's two fits (conversion.shared_rope), in place on `out` (float64): the shared RoPE
    key (k_rope_proj (2r, C); the query rope rows scaled per group) and the latent norm (latent_norm.weight;
    the encoder rescaled and the decoders refitted, as "kv_down_proj.weight", "up", "up_bias")."""
    geo, r = shape.geometry, shape.rope_pairs
    hq, hkv, d, rd = geo.num_heads, geo.num_kv_heads, geo.head_dim, 2 * shape.rope_pairs
    q = out["q_proj.weight"].double().view(hq, d, -1)  # (Hq, d, C) rope-first rows per head
    k = out["k_rope_proj.weight"].double().view(hkv, rd, -1)  # (Hkv, 2r, C)
    qkv_bias = "q_proj.bias" in out
    if qkv_bias:  # biases as a last column, so the per-pair complex maps act on them too
        q = torch.cat([q, out["q_proj.bias"].double().view(hq, d, 1)], -1)  # (Hq, d, C+1)
        k = torch.cat([k, out["k_rope_proj.bias"].double().view(hkv, rd, 1)], -1)  # (Hkv, 2r, C+1)
    if r:
        assert shared_key is not None and len(shared_key.pairs) == r, "the DeepSeek layout needs a shared key"
        # (Hq, 2r, K) query rope rows and (2r, K) shared key rows
        q_rope, k_shared = sr.share_rope_rows(q_rope=q[:, :rd], k_rope=k, key=shared_key)
        q = torch.cat([q_rope, q[:, rd:]], 1)  # (Hq, d, K)
    else:
        k_shared = k.new_zeros(0, k.shape[-1])  # (0, K)
    out["q_proj.weight"] = q[..., : geo.hidden_size].reshape(hq * d, -1)
    out["k_rope_proj.weight"] = k_shared[:, : geo.hidden_size]
    if qkv_bias:
        out["q_proj.bias"] = q[..., -1].reshape(hq * d)
        out["k_rope_proj.bias"] = k_shared[:, -1]
    if norm_eps is None:  # no latent norm (an experiment's control; DeepSeek-V3 always has one)
        out["kv_down_proj.weight"], out["up"] = low.down, low.up
        if low.up_bias is not None:
            out["up_bias"] = low.up_bias
        return
    assert statistics is not None and statistics.samples, "the latent norm needs calibration samples"
    nk = shape.num_key_rows
    norm = sr.fit_latent_norm(
        down=low.down,
        w_k=stack_w[:nk],
        b_k=None if stack_b is None else stack_b[:nk],
        w_v=stack_w[nk:],
        b_v=None if stack_b is None else stack_b[nk:],
        samples=torch.cat(statistics.samples),
        eps=norm_eps,
        refine_steps=refine,
    )
    out["latent_norm.weight"] = norm.gain
    out["kv_down_proj.weight"] = norm.down
    out["up"] = torch.cat([norm.up_k, norm.up_v])
    if qkv_bias:
        out["up_bias"] = torch.cat([norm.bias_k, norm.bias_v])
