"""MHA/GQA -> MLA: a Llama / Mistral / Qwen2 checkpoint as the `llama_mla` model type (MHA2MLA, TransMLA).

    python -m conversion.mla --model SRC --output DST [--kv-lora-rank N | --kv-budget F] [--rope-pairs R]
        [--rope-selection high|uniform|2norm|attention] [--factorization weight-svd|activation|attention]
        [--layout per-head|deepseek]
        [--calibration-text FILE ...] [--calibration-tokens N] [--save-dtype float32|bfloat16] [--overwrite]

Per layer: (1) partial RoPE: each KV head keeps RoPE on r of its d/2 frequency pairs
(`conversion.rope_selection`), its q/k rows permuted to [rope (2r) | nope (d - 2r)]; (2) joint low rank: the
stacked [k_nope; v] of all KV heads becomes up (down x) with the cached latent of width d_c = kv_lora_rank
(`conversion.factorization`); (3) q_proj keeps the source rows, o_proj and everything outside attention are
copied. The cache then holds d_c + Hkv 2r numbers per token and layer (`LlamaMLAConfig.cache_numbers`).
`--kv-budget F` picks d_c and r for at most F of the source's cache (default 0.5 when no rank option is
given); `--rope-pairs d/2` alone is exact. Calibration runs only when an option needs it. The construction is
in docs/mla.md, the measured curve in the README. `--layout deepseek` (`conversion.shared_rope`) writes
DeepSeek-V2/V3's layout instead: one RoPE key per layer shared by all heads on the pairs 0, s, ..., (r - 1) s
of every layer, and an RMSNorm on the cached latent (cache d_c + 2r); `hf-attn export` then writes it as an
exact deepseek_v3 checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion import allocation as alloc
from hf_attn.conversion import calibration as cal
from hf_attn.conversion import cli, layerwise
from hf_attn.conversion import factorization as fac
from hf_attn.conversion import rope_selection as rs
from hf_attn.conversion import shared_rope as sr
from hf_attn.conversion.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    AttentionGeometry,
    Source,
    TensorInfo,
    add_record,
    conversion_record,
    dtype_name,
    layer_attn_keys,
    names_in_file_order,
    open_source,
    parse_attn_key,
    read_tensor,
    save_streamed,
)
from hf_attn.models.llama_mla.configuration_llama_mla import LlamaMLAConfig
from hf_attn.models.llama_mla.modeling_llama_mla import rope_dim_indices
from hf_attn.tooling.files import check_output, checkpoint_hash, scratch_directory

PROG = "hf-attn convert mla"

DEFAULT_ROPE_SELECTION = "attention"
DEFAULT_FACTORIZATION = "attention"
DEFAULT_ROPE_SHARE = 0.5  # of a --kv-budget's numbers per token go to the RoPE keys (see default_rope_pairs)
# ... but with these selections at most this fraction of a head's d/2 frequency pairs (see default_rope_pairs)
MAX_ROPE_FRACTION = {"attention": 0.375}
DEFAULT_CALIBRATION_TOKENS = 8192
DEFAULT_KV_BUDGET = 0.5  # of the command, when no rank option is given (the knee of the README's curve)
_MLA_PROJ = ("q_proj", "k_rope_proj", "kv_down_proj", "latent_norm", "k_up_proj", "v_up_proj", "o_proj")


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
    MAX_ROPE_FRACTION of the d/2 pairs; docs/mla.md says why (the README's allocation sweep measures it)."""
    half = geometry.head_dim // 2
    if kv_budget is None:
        return half
    numbers = int(kv_budget * 2 * geometry.kv_dim + 1e-9)
    if numbers >= 2 * geometry.kv_dim:  # the whole source cache: the exact conversion fits
        return half
    cap = half if share is not None else math.ceil(MAX_ROPE_FRACTION.get(selection, 1.0) * half)
    share = DEFAULT_ROPE_SHARE if share is None else share
    per_pair = 2 * geometry.num_kv_heads
    r = min(round(share * numbers / per_pair), int(numbers * 7 / 8) // per_pair, cap)
    return max(1, min(half, r))


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
        raise ValueError("Give either --kv-lora-rank or --kv-budget, not both.")
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
        if not 0 < kv_budget <= 1:
            raise ValueError(
                f"--kv-budget must be a fraction in (0, 1] of the source's KV cache, got {kv_budget}."
            )
        numbers = int(kv_budget * 2 * geometry.kv_dim + 1e-9)
        rank = min(numbers - hkv * 2 * r, full)
        if rank < 1:
            raise ValueError(
                f"--kv-budget {kv_budget} allows {numbers} numbers per token and layer (source: "
                f"{2 * geometry.kv_dim}), but {r} RoPE pairs on {hkv} KV heads already take {hkv * 2 * r} "
                f"and the latent needs at least 1; lower --rope-pairs (at most "
                f"{(numbers - 1) // (2 * hkv)}) or raise --kv-budget."
            )
        return MLAShape(geometry, r, rank, shared)
    rank = full if kv_lora_rank is None else kv_lora_rank
    if not isinstance(rank, int) or not 1 <= rank <= full:
        raise ValueError(
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

    if shape.is_full_rank:
        low = fac.full_rank(stack_w, stack_b)
    elif factorization == "weight-svd":
        low = fac.weight_svd(stack_w, stack_b, shape.kv_lora_rank)
    elif factorization == "activation":
        assert statistics is not None and statistics.moment is not None, "activation needs calibration"
        low = fac.activation_pca(
            stack_w, stack_b, shape.kv_lora_rank, moment=statistics.moment, num_key_rows=shape.num_key_rows
        )
    elif factorization == "attention":
        assert statistics is not None and statistics.moment is not None, "attention needs calibration"
        nk, rd = shape.num_key_rows, 2 * shape.rope_pairs
        q_nope = out["q_proj.weight"].view(geo.num_heads, geo.head_dim, -1)[:, rd:]  # (Hq, d - 2r, C)
        qb_nope = None if b_q is None else out["q_proj.bias"].view(geo.num_heads, geo.head_dim)[:, rd:]
        low = fac.attention_pca(
            w_k=stack_w[:nk],
            b_k=None if stack_b is None else stack_b[:nk],
            w_v=stack_w[nk:],
            b_v=None if stack_b is None else stack_b[nk:],
            w_q=q_nope.reshape(-1, q_nope.shape[-1]),
            b_q=None if qb_nope is None else qb_nope.reshape(-1),
            w_o=weights["o_proj.weight"],
            moment=statistics.moment,
            num_kv_heads=geo.num_kv_heads,
            rank=shape.kv_lora_rank,
        )
    else:
        raise ValueError(
            f"Unknown --factorization {factorization!r}; choose one of {', '.join(fac.FACTORIZATIONS)}."
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
    if norm_eps is None:  # no latent norm (a control of eval/mla_layouts.py; DeepSeek-V3 always has one)
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


# --------------------------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """What one pass of the source over calibration text gives: per-layer input moments, the pair scores
    of the calibrated selections (selection -> layer -> (Hkv, d/2)), the `attention` query fit (layer ->
    (Hq, d/2) complex) and the record of the corpus."""

    statistics: dict[int, LayerStatistics]
    pair_scores: dict[str, dict[int, torch.Tensor]]
    query_fit: dict[int, torch.Tensor] | None
    record: dict
    scratch: object = None  # the scratch directory of the spilled statistics (removed with the Calibration)


def calibrate(
    *,
    src_dir: Path,
    geometry: AttentionGeometry,
    moments: bool = True,
    pair_norms: bool = True,
    attention_pairs: bool = True,
    files: list[Path] | None = None,
    tokens: int = DEFAULT_CALIBRATION_TOKENS,
    window: int = cal.DEFAULT_WINDOW,
    shared_keys: bool = False,
    sample_stride: int = 0,
    device: str = "cpu",
    forward_dtype: str = "float32",
    scratch_dir: Path | None = None,
) -> Calibration:
    """One forward pass of the source over `tokens` calibration tokens (windows of `window`), layer by layer
    (`layerwise.LayerwiseModel`: one decoder layer in memory at a time, on `device` in `forward_dtype`).
    The DeepSeek layout also needs `shared_keys` (sr.SharedKeyStatistics) and the inputs of every
    `sample_stride`-th token (0: none) for its latent-norm refit. The statistics are spilled to `scratch_dir`
    (kept, so a pickled Calibration stays readable in a later process) or, if None, to a temporary directory
    removed with the Calibration."""
    from transformers import AutoTokenizer

    model = layerwise.LayerwiseModel(src_dir, device=device, forward_dtype=forward_dtype)
    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    ids = cal.calibration_ids(tokenizer, files, tokens)
    layers = list(model.model.layers)
    stats = {i: LayerStatistics() for i in range(geometry.num_layers)}
    heads = dict(num_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim)
    norms = rs.PairNormScores(**heads) if pair_norms else None
    scores = rs.AttentionPairStats(**heads) if attention_pairs else None
    shared = sr.SharedKeyStatistics(**heads) if shared_keys else None
    windows = [_sliding_window(model.config, i) for i in range(geometry.num_layers)]
    # a layer's statistics go to a scratch directory as soon as they cover every calibration token (with the
    # layer-by-layer model: when the pass leaves the layer), so one layer's are in memory at a time
    spill = moments or shared is not None or sample_stride > 0
    scratch = None
    if spill and scratch_dir is None:
        scratch = scratch_directory("hf-attn-mla-statistics-")
    spill_dir = Path(scratch.name) if scratch is not None else scratch_dir
    if spill and scratch_dir is not None:
        spill_dir.mkdir(parents=True, exist_ok=True)
    seen = dict.fromkeys(range(geometry.num_layers), 0)
    total = int(ids.numel())

    def finish(idx: int) -> None:
        if shared is not None:
            stats[idx].shared_keys = shared.sums.pop(idx, None)
        if spill:
            stats[idx] = SpilledLayerStatistics(stats[idx], spill_dir, idx)

    def accumulate(idx: int, x: torch.Tensor, position_embeddings) -> None:
        x = x.reshape(-1, x.shape[-1])  # (T, C)
        if moments:
            m = cal.augmented_moment(x)  # (C+1, C+1)
            stats[idx].moment = m if stats[idx].moment is None else stats[idx].moment + m
        if sample_stride:
            stats[idx].samples = (stats[idx].samples or []) + [x[::sample_stride].float().clone()]
        attn = layers[idx].self_attn
        weights = (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias)
        for rotated in (shared, scores):  # the statistics that need the RoPE tables and the window
            if rotated is not None:
                rotated.add(idx, x, *position_embeddings, *weights, window=windows[idx])
        if norms is not None:
            norms.add(idx, x, *weights)
        seen[idx] += x.shape[0]
        if seen[idx] == total:
            finish(idx)

    cal.for_each_attention_input(model, ids, accumulate, window=window)
    del model
    for i in range(geometry.num_layers):  # (none left when every window reports its tokens)
        if isinstance(stats[i], LayerStatistics):
            finish(i)
    record = {
        **cal.corpus_record(files, tokens),
        "window": window,
        **layerwise.forward_record(device, forward_dtype),
    }
    pair_scores = {}
    if norms is not None:
        pair_scores["2norm"] = norms.scores()
    query_fit = None
    if scores is not None:
        pair_scores["attention"] = {i: scores.pair_scores(i) for i in range(geometry.num_layers)}
        query_fit = {i: scores.query_fit(i) for i in range(geometry.num_layers)}
    return Calibration(stats, pair_scores, query_fit, record, scratch=scratch)


def _sliding_window(config, layer: int) -> int | None:
    """The source's sliding-window size for `layer`, or None for full causal attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


# --------------------------------------------------------------------------------------------- checkpoint


def _mla_name(layer: int, key: str) -> str:
    return f"model.layers.{layer}.self_attn.{key}"


def _check_biases(index: dict[str, TensorInfo], geometry: AttentionGeometry) -> tuple[bool, bool]:
    """(qkv_bias, o_bias) from the tensors present; ValueError if q/k/v disagree or layers differ."""
    seen = set()
    for layer in range(geometry.num_layers):
        names = layer_attn_keys(layer)
        qkv = {p: names[f"{p}.bias"] in index for p in ("q_proj", "k_proj", "v_proj")}
        if len(set(qkv.values())) != 1:
            raise ValueError(
                f"Layer {layer} has biases on {[p for p, b in qkv.items() if b]} only; llama_mla supports "
                "biases on all of q/k/v (Qwen2, Llama attention_bias) or none."
            )
        seen.add((qkv["q_proj"], names["o_proj.bias"] in index))
    if len(seen) != 1:
        raise ValueError("Layers disagree on which attention projections have biases; unsupported layout.")
    return seen.pop()


def mla_config(
    src_dir: Path,
    *,
    shape: MLAShape,
    pairs: list[list[list[int]]] | None,
    qkv_bias: bool,
    o_bias: bool,
    latent_norm: bool = True,
    layer_ranks: tuple[list[int], list[int]] | None = None,
) -> dict:
    """(shape.shared_rope: the DeepSeek layout, `pairs` [num_layers][1][r], rope_layout "shared" and the
    latent norm.)"""
    """config.json of the converted checkpoint: the source's (normalised by its config class) plus the MLA
    fields, validated by LlamaMLAConfig; `auto_map` and `architectures` point at the llama_mla classes."""
    from transformers import AutoConfig

    from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

    source = AutoConfig.from_pretrained(src_dir)
    fields = {
        k: v
        for k, v in source.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", "auto_map")
    }
    if shape.shared_rope:
        fields.update(rope_layout="shared", latent_norm=latent_norm)
    if layer_ranks is not None:  # (layer_rope_pairs, layer_kv_lora_ranks): ragged (conversion.allocation)
        fields.update(layer_rope_pairs=layer_ranks[0], layer_kv_lora_ranks=layer_ranks[1])
    config = LlamaMLAConfig(
        **fields,
        kv_lora_rank=shape.kv_lora_rank,
        rope_pairs=shape.rope_pairs,
        rope_pair_indices=pairs,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        source_model_type=source.model_type,
    )
    out = config.to_dict()
    out["architectures"] = [LlamaMLAForCausalLM.__name__]
    name = lambda cls: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"  # noqa: E731
    out["auto_map"] = {"AutoConfig": name(LlamaMLAConfig), "AutoModelForCausalLM": name(LlamaMLAForCausalLM)}
    return out


def copy_model_code(directory: Path) -> list[str]:
    """Copy the llama_mla configuration/modeling files (and their relative imports) for trust_remote_code."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

    copied = []
    for cls in (LlamaMLAConfig, LlamaMLAForCausalLM):
        module_file = Path(sys.modules[cls.__module__].__file__)
        for path in [module_file, *map(Path, get_relative_import_files(module_file))]:
            if path.name not in copied:
                shutil.copy(path, directory / path.name)
                copied.append(path.name)
    return copied


# --------------------------------------------------------------------------------------------- conversion


@dataclass
class MLAConversion:
    """A planned conversion: everything decided (ranks, pairs, calibration), nothing written yet."""

    src_dir: Path
    index: dict[str, TensorInfo]
    shape: MLAShape
    selection: str
    factorization: str  # "full-rank" when the latent keeps everything
    pairs: list[list[list[int]]]  # [layer][Hkv][r]
    qkv_bias: bool
    o_bias: bool
    kv_budget: float | None
    calibration: Calibration | None
    layout: str = "per-head"
    rope_stride: int | None = None  # DeepSeek layout: the kept pairs are 0, s, ..., (r - 1) s
    shared_keys: dict[int, sr.SharedKey] | None = None  # DeepSeek layout: layer -> fitted shared key
    norm_eps: float | None = None  # DeepSeek layout: the latent norm's eps (the source's rms_norm_eps)
    norm_refine_steps: int = 0  # DeepSeek layout: L-BFGS steps on the encoder through the norm (sr._refine)
    layer_shapes: list[MLAShape] | None = None  # per-layer ranks (conversion.allocation); None: `shape`
    allocation: dict | None = None  # the allocation's record (per-layer lists); None: uniform

    def layer_shape(self, layer: int) -> MLAShape:
        """The ranks of layer `layer`: its own (`--allocation greedy`) or the shared `shape`."""
        return self.shape if self.layer_shapes is None else self.layer_shapes[layer]

    def query_fit(self, layer: int) -> torch.Tensor | None:
        """The `attention` selection's query refit of the dropped pairs of `layer` (None otherwise)."""
        if self.selection != "attention" or self.calibration is None:
            return None
        return self.calibration.query_fit[layer]

    def record(self) -> dict:
        s = self.shape
        return conversion_record(
            kind="mla",
            source=self.src_dir,
            source_hash=checkpoint_hash(self.src_dir),
            settings={
                "kv_budget": self.kv_budget,
                "rope_selection": self.selection,
                "factorization": self.factorization,
                "layout": self.layout,
                **self._forward_settings(),
            },
            kv_lora_rank=s.kv_lora_rank,
            rope_pairs=s.rope_pairs,
            query_fit=self.selection == "attention",
            kv_numbers_per_token_per_layer={"source": s.source_cache_numbers, "mla": self._mean_numbers()},
            kv_fraction=self._mean_numbers() / s.source_cache_numbers,
            **({} if self.allocation is None else {"allocation": self.allocation}),
            calibration=None if self.calibration is None else self.calibration.record,
            **self._deepseek_record(),
        )

    def _forward_settings(self) -> dict:
        """device / forward_dtype of the calibration forward (None: no calibration ran)."""
        record = {} if self.calibration is None else self.calibration.record
        return {key: record.get(key) for key in ("device", "forward_dtype")}

    def _mean_numbers(self) -> int | float:
        """Numbers cached per token and layer (the mean over layers when they differ)."""
        if self.layer_shapes is None:
            return self.shape.cache_numbers
        total, layers = sum(s.cache_numbers for s in self.layer_shapes), len(self.layer_shapes)
        return total // layers if total % layers == 0 else total / layers

    def _deepseek_record(self) -> dict:
        if self.layout != "deepseek":
            return {}
        residual = [float(k.residual.mean()) if len(k.pairs) else 0.0 for k in self.shared_keys.values()]
        return {
            "rope_pair_stride": self.rope_stride,
            "rope_pairs_kept": self.pairs[0][0],
            "latent_norm": self.norm_eps is not None,
            "shared_key_residual_per_layer": [round(v, 6) for v in residual],
        }

    def config(self, dtype: torch.dtype | None = None) -> dict:
        """config.json without the record (see `record`)."""
        pairs = None if self.selection == "high" and self.layout == "per-head" else self.pairs
        if self.layout == "deepseek":
            pairs = [[layer[0]] for layer in self.pairs]  # [num_layers][1][r]: one shared RoPE key
        out = mla_config(
            self.src_dir,
            shape=self.shape,
            pairs=pairs,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
            latent_norm=self.norm_eps is not None,
            layer_ranks=None
            if self.layer_shapes is None
            else ([s.rope_pairs for s in self.layer_shapes], [s.kv_lora_rank for s in self.layer_shapes]),
        )
        if dtype is not None:
            out["dtype"] = dtype_name(dtype)
            out.pop("torch_dtype", None)
        return out

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The converted tensors in source file order; one layer's attention in memory at a time."""
        index = self.index
        names = names_in_file_order(index)
        num_layers = self.shape.geometry.num_layers
        done: set[int] = set()
        for name in tqdm(names, desc="mla", unit="tensor"):
            parsed = parse_attn_key(name)
            if parsed is None:
                tensor = read_tensor(index[name])
                yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                continue
            layer = parsed[0]
            if layer in done:
                continue
            done.add(layer)
            weights = {
                k: read_tensor(index[n]) if n in index else None for k, n in layer_attn_keys(layer).items()
            }
            new = convert_layer(
                weights={k: (w.double() if w is not None else None) for k, w in weights.items()},
                pairs=self.pairs[layer],
                shape=self.layer_shape(layer),
                factorization=self.factorization,
                statistics=None if self.calibration is None else self.calibration.statistics[layer],
                query_fit=self.query_fit(layer),
                shared_key=None if self.shared_keys is None else self.shared_keys[layer],
                norm_eps=self.norm_eps,
                norm_refine_steps=self.norm_refine_steps,
            )
            out_dtype = dtype or weights["q_proj.weight"].dtype
            for key in sorted(new, key=lambda k: (_MLA_PROJ.index(k.split(".")[0]), k)):
                yield _mla_name(layer, key), new[key].to(out_dtype).contiguous()
        assert done == set(range(num_layers)), sorted(set(range(num_layers)) - done)


def plan_conversion(
    *,
    src: str | Path | Source | None,
    kv_lora_rank: int | None = None,
    kv_budget: float | None = None,
    rope_pairs: int | None = None,
    rope_selection: str = DEFAULT_ROPE_SELECTION,
    factorization: str = DEFAULT_FACTORIZATION,
    calibration_files: list[str | Path] | None = None,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    calibration_window: int = cal.DEFAULT_WINDOW,
    calibration: Calibration | None = None,
    layout: str = "per-head",
    device: str = "cpu",
    forward_dtype: str = "float32",
    allocation: str | None = None,
    allocation_normalization: str = alloc.DEFAULT_NORMALIZATION,
) -> MLAConversion:
    """Validate everything, calibrate if the options need it (or reuse `calibration`), choose the pairs.
    layout "deepseek": one RoPE key per layer shared by all heads on the pairs 0, s, ..., (r-1) s of every
    layer, and a latent RMSNorm (conversion.shared_rope); selections `attention` (s by its pair scores, and
    its query refit of the dropped pairs) or `high` (s = 1).
    allocation (conversion.allocation): "uniform", "greedy" or "greedy-ranks"; None: "greedy" where it applies
    (a --kv-budget without --rope-pairs / --kv-lora-rank, the per-head layout, the `attention` selection and
    factorization), else "uniform"."""
    if layout not in sr.LAYOUTS:
        raise ValueError(f"Unknown --layout {layout!r}; choose one of {', '.join(sr.LAYOUTS)}.")
    if layout == "deepseek" and rope_selection not in sr.DEEPSEEK_SELECTIONS:
        raise ValueError(
            f"--rope-selection {rope_selection} picks pairs per KV head; --layout deepseek keeps the same "
            f"progression 0, s, 2s, ... in every layer: use --rope-selection "
            f"{' or '.join(sr.DEEPSEEK_SELECTIONS)}."
        )
    if rope_selection not in rs.SELECTIONS:
        raise ValueError(
            f"Unknown --rope-selection {rope_selection!r}; choose one of {', '.join(rs.SELECTIONS)}."
        )
    if factorization not in fac.FACTORIZATIONS:
        raise ValueError(
            f"Unknown --factorization {factorization!r}; choose one of {', '.join(fac.FACTORIZATIONS)}."
        )
    if allocation is None:
        allocation = alloc.default_allocation(
            kv_budget=kv_budget,
            given_ranks=rope_pairs is not None or kv_lora_rank is not None,
            layout=layout,
            selection=rope_selection,
            factorization=factorization,
        )
    _check_allocation(allocation, layout=layout, selection=rope_selection, factorization=factorization)
    source = src if isinstance(src, Source) else open_source(src)
    src_dir, geometry, index, config = source.dir, source.geometry, source.index, source.config
    if geometry.head_dim % 2:
        raise ValueError(f"head_dim {geometry.head_dim} is odd; RoPE pairs need an even head_dim.")
    qkv_bias, o_bias = _check_biases(index, geometry)
    if allocation != "uniform" and rope_pairs is None and kv_budget is not None and layout == "per-head":
        rope_pairs = alloc.default_rope_pairs(geometry, kv_budget, default_rope_pairs)
    shape = plan_shape(
        geometry,
        kv_lora_rank=kv_lora_rank,
        kv_budget=kv_budget,
        rope_pairs=rope_pairs,
        rope_selection=rope_selection,
        layout=layout,
    )
    selection = "high" if shape.rope_pairs in (0, geometry.head_dim // 2) else rope_selection  # no choice
    if shape.is_full_rank:
        factorization = "full-rank"
    need_moments = factorization in fac.CALIBRATED_FACTORIZATIONS
    need_scores = selection in rs.CALIBRATED_SELECTIONS
    deepseek = layout == "deepseek"  # needs the shared-key statistics and input samples: always calibrates
    if deepseek and calibration is not None and not _has_deepseek_statistics(calibration, need_moments):
        raise ValueError(
            "The given calibration lacks what --layout deepseek needs; calibrate with shared_keys=True, "
            "sample_stride > 0 (and moments / attention_pairs for the chosen options)."
        )
    if selection == "attention" and calibration is None and calibration_window <= rs.QUERY_STRIDE:
        raise ValueError(  # one query per window: zero score variance, a 0/0 query fit (NaN or ~1e12 weights)
            f"--calibration-window {calibration_window} is too short for --rope-selection attention, whose "
            f"statistics use every {rs.QUERY_STRIDE}th query of a window; use a window > {rs.QUERY_STRIDE}."
        )
    if (need_moments or need_scores or deepseek) and calibration is None:
        calibration = calibrate(
            src_dir=src_dir,
            geometry=geometry,
            moments=need_moments,
            pair_norms=selection == "2norm",
            attention_pairs=selection == "attention",
            files=None if calibration_files is None else [Path(f) for f in calibration_files],
            tokens=calibration_tokens,
            window=calibration_window,
            shared_keys=deepseek and shape.rope_pairs > 0,
            sample_stride=sr.SAMPLE_STRIDE if deepseek else 0,
            device=device,
            forward_dtype=forward_dtype,
        )
    elif not (need_moments or need_scores or deepseek):
        calibration = None
    if deepseek:
        return _plan_deepseek(
            src_dir, index, shape, selection, factorization, qkv_bias, o_bias, kv_budget, calibration, config
        )
    pairs = rs.select_rope_pairs(
        selection,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        rope_pairs=shape.rope_pairs,
        scores=None if calibration is None else calibration.pair_scores.get(selection),
    )
    plan = MLAConversion(
        src_dir, index, shape, selection, factorization, pairs, qkv_bias, o_bias, kv_budget, calibration
    )
    if allocation != "uniform" and not shape.is_full_rank:
        plan = _allocate(plan, allocation_normalization, allocate_latent=allocation == "greedy-ranks")
    return plan


def _check_allocation(allocation: str, *, layout: str, selection: str, factorization: str) -> None:
    """ValueError unless `--allocation` can run with these options."""
    if allocation not in alloc.ALLOCATIONS:
        choices = ", ".join(alloc.ALLOCATIONS)
        raise ValueError(f"Unknown --allocation {allocation!r}; choose one of {choices}.")
    if allocation == "uniform":
        return
    if layout == "deepseek":
        raise ValueError(
            f"--allocation {allocation} gives layers different ranks, but the DeepSeek layout (and "
            "deepseek_v3) has one kv_lora_rank and one qk_rope_head_dim for every layer; "
            "use --allocation uniform."
        )
    if selection != "attention" or factorization != "attention":
        raise ValueError(
            f"--allocation greedy reads the `attention` selection's pair scores and the `attention` "
            f"factorization's spectrum, got --rope-selection {selection} --factorization {factorization}; "
            "use both `attention` (the defaults) or --allocation uniform."
        )


def _allocate(
    plan: MLAConversion, normalization: str, *, allocate_rope: bool = True, allocate_latent: bool = True
) -> MLAConversion:
    """`plan` with per-layer ranks (conversion.allocation) under the same total cache."""
    geo, s = plan.shape.geometry, plan.shape
    cal_ = plan.calibration

    def read_layer(i: int) -> dict[str, torch.Tensor | None]:
        names = layer_attn_keys(i)
        return {k: read_tensor(plan.index[n]).double() if n in plan.index else None for k, n in names.items()}

    chosen, record = alloc.plan_allocation(
        geometry=geo,
        read_layer=read_layer,
        pair_scores=cal_.pair_scores["attention"],
        query_fit=cal_.query_fit,
        moments=_Moments(cal_.statistics),  # read layer by layer
        rope_pairs=s.rope_pairs,
        kv_lora_rank=s.kv_lora_rank,
        normalization=normalization,
        allocate_rope=allocate_rope,
        allocate_latent=allocate_latent,
    )
    shapes = [MLAShape(geo, r, c) for r, c in zip(chosen.rope_pairs, chosen.kv_lora_ranks)]
    assert sum(x.cache_numbers for x in shapes) <= geo.num_layers * s.cache_numbers, "over the budget"
    widest = MLAShape(geo, max(chosen.rope_pairs), max(chosen.kv_lora_ranks))
    return dataclasses.replace(plan, shape=widest, pairs=chosen.pairs, layer_shapes=shapes, allocation=record)


def _has_deepseek_statistics(calibration: Calibration, need_moments: bool) -> bool:
    first = calibration.statistics[0]
    return first.has("samples") and (first.has("moment") or not need_moments)


def _plan_deepseek(
    src_dir, index, shape, selection, factorization, qkv_bias, o_bias, kv_budget, calibration, config
) -> MLAConversion:
    """The DeepSeek layout's pairs (one progression for every layer and head) and shared-key fits."""
    geo = shape.geometry
    half, r = geo.head_dim // 2, shape.rope_pairs
    scores = None
    if selection == "attention":
        per_layer = calibration.pair_scores.get("attention")
        if per_layer is None:
            raise ValueError(
                "The given calibration lacks the attention pair scores; calibrate attention_pairs."
            )
        scores = sum(per_layer[i].double().sum(0) for i in range(geo.num_layers))  # (d/2,)
    stride = sr.choose_stride(scores, half=half, rope_pairs=r)
    kept = sr.progression_pairs(r, stride)
    pairs = [[list(kept) for _ in range(geo.num_kv_heads)] for _ in range(geo.num_layers)]
    if r and not calibration.statistics[0].has("shared_keys"):
        raise ValueError("The given calibration lacks the shared-key statistics; calibrate shared_keys=True.")
    keys = {i: sr.fit_shared_key(calibration.statistics[i].shared_keys, kept) for i in range(geo.num_layers)}
    eps = float(config.get("rms_norm_eps", 1e-6))
    return MLAConversion(
        src_dir,
        index,
        shape,
        selection,
        factorization,
        pairs,
        qkv_bias,
        o_bias,
        kv_budget,
        calibration,
        layout="deepseek",
        rope_stride=stride,
        shared_keys=keys,
        norm_eps=eps,
        norm_refine_steps=sr.NORM_REFINE_STEPS,
    )


@torch.inference_mode()
def convert_to_mla(
    *,
    src: str | Path | None,
    dst: str | Path,
    kv_lora_rank: int | None = None,
    kv_budget: float | None = None,
    rope_pairs: int | None = None,
    rope_selection: str = DEFAULT_ROPE_SELECTION,
    factorization: str = DEFAULT_FACTORIZATION,
    calibration_files: list[str | Path] | None = None,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    calibration_window: int = cal.DEFAULT_WINDOW,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    layout: str = "per-head",
    device: str = "cpu",
    forward_dtype: str = "float32",
    allocation: str | None = None,
) -> Path:
    """Write `dst`: checkpoint `src` (None: the embedded SmolLM2) converted to `llama_mla`.
    `layout`: "per-head" (a RoPE key per KV head on its own pairs) or "deepseek" (see `plan_conversion`).

    Ranks: `kv_lora_rank` (d_c) or `kv_budget` (cache fraction of the source, picks d_c and, if
    `rope_pairs` is None, r); neither: full rank. `rope_pairs` None: every pair (or the budget's choice).
    Calibration (source model forward over `calibration_tokens` of `calibration_files`, default the five
    Austen novels other than Persuasion) runs only if the selection or factorization needs it, layer by
    layer on `device` in `forward_dtype` (`layerwise.ForwardSettings`).
    """
    start = time.perf_counter()
    layerwise.resolve_forward(device, forward_dtype)  # fails before any slow work
    source = open_source(src, dst=dst, overwrite=overwrite, dtype=dtype)  # fails before any slow calibration
    plan = plan_conversion(
        src=source,
        kv_lora_rank=kv_lora_rank,
        kv_budget=kv_budget,
        rope_pairs=rope_pairs,
        rope_selection=rope_selection,
        factorization=factorization,
        calibration_files=calibration_files,
        calibration_tokens=calibration_tokens,
        calibration_window=calibration_window,
        layout=layout,
        device=device,
        forward_dtype=forward_dtype,
        allocation=allocation,
    )
    return write_conversion(
        plan, dst, dtype=source.dtype, overwrite=overwrite, max_shard_bytes=max_shard_bytes, start=start
    )


def write_conversion(
    plan: MLAConversion,
    dst: str | Path,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    start: float | None = None,
) -> Path:
    """Write a planned conversion atomically: weights, config.json (+ record), side files, model code.
    The record's `seconds` counts from `start` (perf_counter; default: now)."""
    start = time.perf_counter() if start is None else start
    dst = check_output(plan.src_dir, dst, overwrite=overwrite)
    config, record = plan.config(dtype), plan.record()
    record["dtype"] = config.get("dtype")

    def final_config() -> dict:  # once the weights are written: `seconds` counts them
        record["seconds"] = round(time.perf_counter() - start, 2)
        return add_record(config, record)

    save_streamed(
        src_dir=plan.src_dir,
        dst=dst,
        tensors=plan.tensors(dtype),
        config=final_config,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        extra_files=copy_model_code,
    )
    return dst


def describe(out: Path) -> str:
    """One line on the checkpoint `convert_to_mla` wrote to `out` (for the command)."""
    r = cli.last_record(out)
    s, numbers = r["settings"], r["kv_numbers_per_token_per_layer"]
    most = "<=" if "allocation" in r else "="  # per-layer ranks: the scalars are the largest layer's
    return (
        f"MLA ({s['layout']} layout): r{most}{r['rope_pairs']} ({s['rope_selection']}), "
        f"d_c{most}{r['kv_lora_rank']} "
        f"({s['factorization']}), {numbers['mla']}/{numbers['source']} numbers per token and layer "
        f"({100 * r['kv_fraction']:.1f}%)"
        + (_describe_allocation(r["allocation"]) if "allocation" in r else "")
    )


def _describe_allocation(a: dict) -> str:
    return f", per layer ({a['method']}) r={a['layer_rope_pairs']} d_c={a['layer_kv_lora_ranks']}"


def main(argv: list[str] | None = None) -> int:
    parser = cli.converter_parser(PROG, __doc__, output_help="converted checkpoint dir")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--kv-lora-rank", type=int, default=None, help="d_c, width of the cached latent")
    ranks.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help=f"cache fraction of the source's, picks d_c and r (default {DEFAULT_KV_BUDGET} without ranks)",
    )
    parser.add_argument("--rope-pairs", type=int, default=None, help="r, RoPE pairs kept per KV head")
    parser.add_argument("--rope-selection", choices=rs.SELECTIONS, default=DEFAULT_ROPE_SELECTION)
    parser.add_argument("--factorization", choices=fac.FACTORIZATIONS, default=DEFAULT_FACTORIZATION)
    parser.add_argument(
        "--layout",
        choices=sr.LAYOUTS,
        default="per-head",
        help="per-head: a RoPE key per KV head; deepseek: one shared RoPE key + latent norm (DeepSeek MLA)",
    )
    parser.add_argument(
        "--allocation",
        choices=alloc.ALLOCATIONS,
        default=None,
        help="uniform: the same r and d_c in every layer; greedy: RoPE pairs per layer from the calibration; "
        "greedy-ranks: also the latent rank per layer (conversion.allocation); the same total cache "
        "(default: greedy with --kv-budget and the attention selection / factorization, else uniform)",
    )
    cli.add_calibration_arguments(parser, default_tokens=DEFAULT_CALIBRATION_TOKENS)
    cli.add_refine_arguments(parser)
    cli.add_write_arguments(parser)
    args = parser.parse_args(argv)
    if args.kv_lora_rank is None and args.kv_budget is None and args.rope_pairs is None:
        args.kv_budget = DEFAULT_KV_BUDGET
    return cli.run(
        parser.prog,
        convert_to_mla,
        args,
        describe=describe,
        kv_lora_rank=args.kv_lora_rank,
        kv_budget=args.kv_budget,
        rope_pairs=args.rope_pairs,
        rope_selection=args.rope_selection,
        factorization=args.factorization,
        layout=args.layout,
        allocation=args.allocation,
        **cli.calibration_options(args),
    )


if __name__ == "__main__":
    sys.exit(main())
