"""MLA conversion, calibration: one layer-by-layer pass of the source over calibration text collects what the
chosen options need (input moments, RoPE pair scores, the query fit, the DeepSeek layout's shared-key sums and
input samples), spilled to a scratch directory one layer at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.mla import rope_selection as rs
from hf_attn.conversion.mla import shared_rope as sr
from hf_attn.conversion.mla.layer import LayerStatistics, SpilledLayerStatistics
from hf_attn.conversion.specs import CalibrationSpec
from hf_attn.tooling.files import scratch_directory


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
    calibration: CalibrationSpec = CalibrationSpec(),
    shared_keys: bool = False,
    sample_stride: int = 0,
    scratch_dir: Path | None = None,
) -> Calibration:
    """One forward pass of the source over the calibration text, tokens and windows of `calibration`, layer
    by layer (`layerwise.LayerwiseModel`: one decoder layer in memory at a time, on its `device` in its
    `forward_dtype`). The DeepSeek layout also needs `shared_keys` (sr.SharedKeyStatistics) and the inputs of
    every `sample_stride`-th token (0: none) for its latent-norm refit. The statistics are spilled to
    `scratch_dir` (kept, so a pickled Calibration stays readable in a later process) or, if None, to a
    temporary directory removed with the Calibration."""
    c = calibration
    model = layerwise.LayerwiseModel(src_dir, device=c.device, forward_dtype=c.forward_dtype)
    ids = cal.source_ids(src_dir, c)
    layers = list(model.model.layers)
    stats = {i: LayerStatistics() for i in range(geometry.num_layers)}
    heads = dict(num_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim)
    norms = rs.PairNormScores(**heads) if pair_norms else None
    scores = rs.AttentionPairStats(**heads) if attention_pairs else None
    shared = sr.SharedKeyStatistics(**heads) if shared_keys else None
    sliding = [layerwise.is_sliding_layer(model.config, i) for i in range(geometry.num_layers)]
    windows = [model.config.sliding_window if s else None for s in sliding]  # None: full causal attention
    # a layer's statistics go to a scratch directory as soon as they cover every calibration token (with the
    # layer-by-layer model: when the pass leaves the layer), so one layer's are in memory at a time
    spill = moments or shared is not None or sample_stride > 0
    scratch = scratch_directory("hf-attn-mla-statistics-") if spill and scratch_dir is None else None
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

    model.for_each_attention_input(ids, accumulate, window=c.window)
    del model
    for i in range(geometry.num_layers):  # (none left when every window reports its tokens)
        if isinstance(stats[i], LayerStatistics):
            finish(i)
    record = {**cal.calibration_record(c, c.tokens), **layerwise.forward_record(c.device, c.forward_dtype)}
    pair_scores, query_fit = {} if norms is None else {"2norm": norms.scores()}, None
    if scores is not None:
        pair_scores["attention"] = {i: scores.pair_scores(i) for i in range(geometry.num_layers)}
        query_fit = {i: scores.query_fit(i) for i in range(geometry.num_layers)}
    return Calibration(stats, pair_scores, query_fit, record, scratch=scratch)
