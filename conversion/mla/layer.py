"""MLA conversion, one layer: the factorization of one attention layer into `llama_mla` tensors
(`convert_layer`, at the ranks of a `ranks.MLAShape`), and the calibration statistics it reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hf_attn.conversion.mla import factorization as fac
from hf_attn.conversion.mla import rope_selection as rs
from hf_attn.conversion.mla import shared_rope as sr
from hf_attn.conversion.mla.ranks import MLAShape
from hf_attn.conversion.specs import CALIBRATED_FACTORIZATIONS, FACTORIZATIONS


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
            if value is not None:  # the samples as one (N, C) float32 tensor
                self.paths[name] = directory / f"{name}-{layer}.pt"
                torch.save([torch.cat(value)] if name == "samples" else value, self.paths[name])

    def has(self, name: str) -> bool:
        return name in self.paths

    def _load(self, name: str):
        path = self.paths.get(name)
        return None if path is None else torch.load(path, weights_only=True)  # as it was saved

    moment = property(lambda self: self._load("moment"))
    shared_keys = property(lambda self: self._load("shared_keys"))
    samples = property(lambda self: self._load("samples"))


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
        out.update({"q_proj.bias": (hq * d,), "k_rope_proj.bias": (rope_rows,)})
        out.update({"k_up_proj.bias": (shape.num_key_rows,), "v_up_proj.bias": (hkv * d,)})
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
    rows = rs.layer_rows(pairs, geo)
    qkv_bias, o_bias = weights.get("q_proj.bias") is not None, weights.get("o_proj.bias") is not None
    w_q, b_q = weights["q_proj.weight"], weights.get("q_proj.bias")
    if query_fit is not None:
        w_q, b_q = rs.apply_query_fit(w_q, b_q, query_fit, pairs, geo.group_size)
    out = {"q_proj.weight": w_q[rows["q"]], "k_rope_proj.weight": weights["k_proj.weight"][rows["k_rope"]]}
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
    if shape.shared_rope:
        low = _deepseek_layer(
            out, low, stack_w, stack_b, shape, shared_key, statistics, norm_eps, norm_refine_steps
        )
    nk = shape.num_key_rows
    out.update({"kv_down_proj.weight": low.down, "k_up_proj.weight": low.up[:nk]})
    out["v_up_proj.weight"] = low.up[nk:]
    if qkv_bias:
        assert low.up_bias is not None
        out.update({"k_up_proj.bias": low.up_bias[:nk], "v_up_proj.bias": low.up_bias[nk:]})
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    out["o_proj.weight"] = weights["o_proj.weight"]
    if o_bias:
        out["o_proj.bias"] = weights["o_proj.bias"]
    shapes = {key: tuple(tensor.shape) for key, tensor in out.items()}
    expected = mla_shapes(shape, qkv_bias=qkv_bias, o_bias=o_bias, latent_norm=norm_eps is not None)
    assert shapes == expected, (shapes, expected)
    return out


def convert_layer_on(device: torch.device, **kwargs) -> dict[str, torch.Tensor]:
    """`convert_layer(**kwargs)` on the calibration device, its tensors on the CPU. On a GPU the float64
    factorizations run there (their inputs moved once: a spilled layer's statistics are read back once);
    on the CPU this is `convert_layer` itself."""
    if device.type == "cpu":
        return convert_layer(**kwargs)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    kwargs["weights"] = {k: to(w) for k, w in kwargs["weights"].items()}
    kwargs["query_fit"] = to(kwargs.get("query_fit"))
    stats, key = kwargs.get("statistics"), kwargs.get("shared_key")
    if stats is not None:
        samples = stats.samples
        kwargs["statistics"] = LayerStatistics(
            moment=to(stats.moment),
            shared_keys=to(stats.shared_keys),
            samples=None if samples is None else [to(x) for x in samples],
        )
    if key is not None:
        kwargs["shared_key"] = replace(key, coef=to(key.coef), scale=to(key.scale), residual=to(key.residual))
    with torch.device(device):  # the fit's own new tensors are made there too
        out = convert_layer(**kwargs)
    return {k: v.cpu() for k, v in out.items()}


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
        factorization: one of `FACTORIZATIONS` (full rank whatever it is when `shape.is_full_rank`).
        shape: the layer's ranks.
        stack_w: (W, C) `[k_proj nope rows (all KV heads); v_proj]`; stack_b: (W,) or None, the same rows'
            biases.
        statistics: the calibration statistics (`activation` and `attention` read `statistics.moment`).
        q: (Hq d, C) the permuted query rows, rope first in each head; q_bias: (Hq d,) or None.
        w_o: (C, Hq d) o_proj.
    """
    geo, rank, nk = shape.geometry, shape.kv_lora_rank, shape.num_key_rows
    if shape.is_full_rank:
        return fac.full_rank(stack_w, stack_b)
    if factorization == "weight-svd":
        return fac.weight_svd(stack_w, stack_b, rank)
    if factorization not in CALIBRATED_FACTORIZATIONS:
        raise ValueError(
            f"Unknown --factorization {factorization!r}; choose one of {', '.join(FACTORIZATIONS)}."
        )
    assert statistics is not None and statistics.moment is not None, f"{factorization} needs calibration"
    if factorization == "activation":
        return fac.activation_pca(stack_w, stack_b, rank, moment=statistics.moment, num_key_rows=nk)
    w_q, b_q = rs.nope_queries(q, q_bias, geo, shape.rope_pairs)  # (Hq (d - 2r), C), (Hq (d - 2r),)
    return fac.attention_pca(
        w_k=stack_w[:nk],
        b_k=None if stack_b is None else stack_b[:nk],
        w_v=stack_w[nk:],
        b_v=None if stack_b is None else stack_b[nk:],
        w_q=w_q,
        b_q=b_q,
        w_o=w_o,
        moment=statistics.moment,
        num_kv_heads=geo.num_kv_heads,
        rank=rank,
    )


def _deepseek_layer(
    out, low, stack_w, stack_b, shape, shared_key, statistics, norm_eps, refine=0
) -> fac.LowRank:
    """The DeepSeek layout's two fits (conversion.mla.shared_rope), in float64: the shared RoPE key, in place
    on `out` (k_rope_proj (2r, C); the query rope rows scaled per group), and the latent norm (its weight in
    `out`; the encoder rescaled and the decoders refitted: the LowRank returned)."""
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
        return low
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
    bias = torch.cat([norm.bias_k, norm.bias_v]) if qkv_bias else None
    return fac.LowRank(norm.down, torch.cat([norm.up_k, norm.up_v]), bias)
