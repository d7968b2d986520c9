"""MLA conversion, planning: validate the options, calibrate when they need it, choose the RoPE pairs and the
per-layer ranks (`plan_conversion`), and the planned conversion (`MLAConversion`): its config.json, its
record and its tensors streamed layer by layer."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint import io as ckpt
from hf_attn.conversion.mla import ranks as alloc
from hf_attn.conversion.mla import rope_selection as rs
from hf_attn.conversion.mla import shared_rope as sr
from hf_attn.conversion.mla.calibration import Calibration, calibrate
from hf_attn.conversion.mla.layer import convert_layer_on
from hf_attn.conversion.mla.ranks import MLAShape
from hf_attn.conversion.specs import (
    CALIBRATED_FACTORIZATIONS,
    CALIBRATED_SELECTIONS,
    DEFAULT_CALIBRATION_TOKENS,
    CalibrationSpec,
    MLASpec,
)
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import checkpoint_hash

_MLA_PROJ = ("q_proj", "k_rope_proj", "kv_down_proj", "latent_norm", "k_up_proj", "v_up_proj", "o_proj")


def _check_biases(index: dict[str, ckpt.TensorInfo], geometry: ckpt.AttentionGeometry) -> tuple[bool, bool]:
    """(qkv_bias, o_bias) from the tensors present; ValueError if q/k/v disagree or layers differ."""
    seen = set()
    for layer in range(geometry.num_layers):
        names = ckpt.layer_attn_keys(layer)
        qkv = {p: names[f"{p}.bias"] in index for p in ("q_proj", "k_proj", "v_proj")}
        if len(set(qkv.values())) != 1:
            raise UserError(
                f"Layer {layer} has biases on {[p for p, b in qkv.items() if b]} only; llama_mla supports "
                "biases on all of q/k/v (Qwen2, Llama attention_bias) or none."
            )
        seen.add((qkv["q_proj"], names["o_proj.bias"] in index))
    if len(seen) != 1:
        raise UserError("Layers disagree on which attention projections have biases; unsupported layout.")
    return seen.pop()


def copy_model_code(directory: Path) -> list[str]:
    """Copy the llama_mla configuration/modeling files (and their relative imports) for trust_remote_code."""
    from transformers.dynamic_module_utils import get_relative_import_files

    copied = []
    for cls in (LlamaMLAConfig, LlamaMLAForCausalLM):
        module_file = Path(sys.modules[cls.__module__].__file__)
        for path in [module_file, *map(Path, get_relative_import_files(module_file))]:
            if path.name not in copied:
                shutil.copy(path, directory / path.name)
                copied.append(path.name)
    return copied


@dataclass
class MLAConversion:
    """A planned conversion: everything decided (ranks, pairs, calibration), nothing written yet."""

    src_dir: Path
    index: dict[str, ckpt.TensorInfo]
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
    norm_refine_steps: int = 0  # DeepSeek layout: L-BFGS steps through the norm (sr.fit_latent_norm)
    layer_shapes: list[MLAShape] | None = None  # per-layer ranks (conversion.mla.ranks); None: `shape`
    allocation: dict | None = None  # the allocation's record (per-layer lists); None: uniform

    @property
    def calibration_record(self) -> dict:
        """The calibration pass's record ({} without one)."""
        return {} if self.calibration is None else self.calibration.record

    @property
    def fit_device(self) -> torch.device:
        """Where the layer fits run: the calibration pass's device (the CPU without one)."""
        return torch.device(self.calibration_record.get("device", "cpu"))

    def query_fit(self, layer: int) -> torch.Tensor | None:
        """The `attention` selection's query refit of the dropped pairs of `layer` (None otherwise)."""
        if self.selection != "attention" or self.calibration is None:
            return None
        return self.calibration.query_fit[layer]

    def record(self) -> dict:
        s, shapes = self.shape, self.layer_shapes or [self.shape]
        # numbers cached per token and layer (the mean over layers when they differ)
        total, layers = sum(x.cache_numbers for x in shapes), len(shapes)
        mean = total // layers if total % layers == 0 else total / layers
        return ckpt.conversion_record(
            kind="mla",
            source=self.src_dir,
            source_hash=checkpoint_hash(self.src_dir),
            settings={
                "kv_budget": self.kv_budget,
                "rope_selection": self.selection,
                "factorization": self.factorization,
                "layout": self.layout,
                # device / forward_dtype of the calibration forward (None: no calibration ran)
                **{key: self.calibration_record.get(key) for key in ("device", "forward_dtype")},
            },
            kv_lora_rank=s.kv_lora_rank,
            rope_pairs=s.rope_pairs,
            query_fit=self.selection == "attention",
            kv_numbers_per_token_per_layer={"source": s.source_cache_numbers, "mla": mean},
            kv_fraction=mean / s.source_cache_numbers,
            **({} if self.allocation is None else {"allocation": self.allocation}),
            calibration=None if self.calibration is None else self.calibration.record,
            **self._deepseek_record(),
        )

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
        """config.json without the record (see `record`): the source's (normalised by its config class) plus
        the MLA fields, validated by LlamaMLAConfig; `auto_map` and `architectures` point at the llama_mla
        classes. The DeepSeek layout: `rope_pair_indices` [num_layers][1][r] (one shared RoPE key),
        rope_layout "shared" and the latent norm; per-layer ranks: the ragged `layer_*` lists."""
        from transformers import AutoConfig

        source = AutoConfig.from_pretrained(self.src_dir)
        drop = ("model_type", "architectures", "transformers_version", "auto_map")
        fields = {k: v for k, v in source.to_dict().items() if k not in drop}
        pairs = None if self.selection == "high" and self.layout == "per-head" else self.pairs
        if self.layout == "deepseek":
            pairs = [[layer[0]] for layer in self.pairs]
            fields.update(rope_layout="shared", latent_norm=self.norm_eps is not None)
        if self.layer_shapes is not None:
            fields.update(
                layer_rope_pairs=[s.rope_pairs for s in self.layer_shapes],
                layer_kv_lora_ranks=[s.kv_lora_rank for s in self.layer_shapes],
            )
        out = LlamaMLAConfig(
            **fields,
            kv_lora_rank=self.shape.kv_lora_rank,
            rope_pairs=self.shape.rope_pairs,
            rope_pair_indices=pairs,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
            source_model_type=source.model_type,
        ).to_dict()
        out["architectures"] = [LlamaMLAForCausalLM.__name__]
        auto = {"AutoConfig": LlamaMLAConfig, "AutoModelForCausalLM": LlamaMLAForCausalLM}
        out["auto_map"] = {k: f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for k, c in auto.items()}
        if dtype is not None:
            out["dtype"] = ckpt.dtype_name(dtype)
            out.pop("torch_dtype", None)
        return out

    def read_layer(self, layer: int) -> dict[str, torch.Tensor | None]:
        """The source's float64 attention weights of `layer` ("q_proj.weight", ...; None where absent)."""
        names, index = ckpt.layer_attn_keys(layer), self.index
        return {k: ckpt.read_tensor(index[n]).double() if n in index else None for k, n in names.items()}

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The converted tensors in source file order; one layer's attention in memory at a time."""
        index = self.index
        num_layers = self.shape.geometry.num_layers
        done: set[int] = set()
        for name in tqdm(ckpt.names_in_file_order(index), desc="mla", unit="tensor"):
            parsed = ckpt.parse_attn_key(name)
            if parsed is None:
                tensor = ckpt.read_tensor(index[name])
                yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                continue
            layer = parsed[0]
            if layer in done:
                continue
            done.add(layer)
            weights = self.read_layer(layer)
            with stages.stage("fit"):
                new = convert_layer_on(
                    self.fit_device,
                    weights=weights,
                    pairs=self.pairs[layer],
                    shape=self.shape if self.layer_shapes is None else self.layer_shapes[layer],
                    factorization=self.factorization,
                    statistics=None if self.calibration is None else self.calibration.statistics[layer],
                    query_fit=self.query_fit(layer),
                    shared_key=None if self.shared_keys is None else self.shared_keys[layer],
                    norm_eps=self.norm_eps,
                    norm_refine_steps=self.norm_refine_steps,
                )
            out_dtype = dtype or index[ckpt.layer_attn_keys(layer)["q_proj.weight"]].dtype
            for key in sorted(new, key=lambda k: (_MLA_PROJ.index(k.split(".")[0]), k)):
                yield f"model.layers.{layer}.self_attn.{key}", new[key].to(out_dtype).contiguous()
        assert done == set(range(num_layers)), sorted(set(range(num_layers)) - done)


def plan_conversion(
    source: str | Path | ckpt.Source | None,
    spec: MLASpec = MLASpec(),
    calibration: CalibrationSpec = CalibrationSpec(),
    *,
    calibration_pass: Calibration | None = None,
) -> MLAConversion:
    """Check `spec` against the source, calibrate if its options need it (on `calibration`'s text, or reuse
    `calibration_pass`, a `calibration.calibrate` result), choose the pairs and the per-layer ranks (the
    DeepSeek layout: conversion.mla.shared_rope; the allocation: conversion.mla.ranks)."""
    source = source if isinstance(source, ckpt.Source) else ckpt.open_source(source)
    geometry = source.geometry
    if geometry.head_dim % 2:
        raise UserError(f"head_dim {geometry.head_dim} is odd; RoPE pairs need an even head_dim.")
    qkv_bias, o_bias = _check_biases(source.index, geometry)
    shape = check_spec(spec, calibration if calibration_pass is None else None, geometry)
    selection = _selection(spec, shape)
    factorization = "full-rank" if shape.is_full_rank else spec.factorization
    calibration_pass = _calibration_pass(
        source, shape, spec, selection, factorization, calibration, calibration_pass
    )
    budget = None if spec.budget is None else spec.budget.fraction
    with stages.stage("fit"):
        pairs, deepseek = _choose_pairs(spec, shape, selection, calibration_pass, source.config)
        fields = (source.dir, source.index, shape, selection, factorization, pairs, qkv_bias, o_bias, budget)
        plan = MLAConversion(*fields, calibration_pass, **deepseek)
        if spec.layout == "per-head" and spec.allocation_method != "uniform" and not shape.is_full_rank:
            plan = _allocate(plan, allocate_latent=spec.allocation_method == "greedy-ranks")
    return plan


def _selection(spec: MLASpec, shape: MLAShape) -> str:
    """The RoPE selection: "high" where r leaves no choice (no pair or every pair), else the spec's."""
    return "high" if shape.rope_pairs in (0, shape.geometry.head_dim // 2) else spec.rope_selection


def check_spec(
    spec: MLASpec, calibration: CalibrationSpec | None, geometry: ckpt.AttentionGeometry
) -> MLAShape:
    """The ranks of `spec` on a source of `geometry` (`ranks.spec_shape`), checked with the calibration text's
    size (None: a calibration pass is given) before any work: UserError naming the first bad option."""
    shape = alloc.spec_shape(spec, geometry)
    if calibration is None:
        return shape
    # too short a text for the `attention` statistics (one query per window): singular, a failed or ~1e12 fit
    if "attention" in (spec.factorization, spec.rope_selection) and calibration.tokens <= rs.QUERY_STRIDE:
        raise UserError(
            f"--calibration-tokens {calibration.tokens} is too few for --factorization / --rope-selection "
            f"attention, whose statistics use one query in {rs.QUERY_STRIDE} of a window: give at least "
            f"{rs.QUERY_STRIDE + 1} (the default is {DEFAULT_CALIBRATION_TOKENS})"
        )
    if _selection(spec, shape) == "attention" and calibration.window <= rs.QUERY_STRIDE:
        raise UserError(
            f"--calibration-window {calibration.window} is too short for --rope-selection attention, whose "
            f"statistics use every {rs.QUERY_STRIDE}th query of a window; use a window > {rs.QUERY_STRIDE}."
        )
    return shape


def _calibration_pass(
    source, shape, spec, selection, factorization, calibration, given
) -> Calibration | None:
    """The calibration the options need (`given`, else a new pass over `calibration`'s text), or None."""
    need_moments = factorization in CALIBRATED_FACTORIZATIONS
    deepseek = spec.layout == "deepseek"  # needs the shared-key statistics and input samples: calibrates
    if not (need_moments or selection in CALIBRATED_SELECTIONS or deepseek):
        return None
    if given is not None:
        first = given.statistics[0]
        if deepseek and not (first.has("samples") and (first.has("moment") or not need_moments)):
            raise UserError(
                "The given calibration lacks what --layout deepseek needs; calibrate with shared_keys=True, "
                "sample_stride > 0 (and moments / attention_pairs for the chosen options)."
            )
        return given
    return calibrate(
        src_dir=source.dir,
        geometry=source.geometry,
        moments=need_moments,
        pair_norms=selection == "2norm",
        attention_pairs=selection == "attention",
        calibration=calibration,
        shared_keys=deepseek and shape.rope_pairs > 0,
        sample_stride=sr.SAMPLE_STRIDE if deepseek else 0,
    )


def _choose_pairs(spec, shape, selection, calibration, config) -> tuple[list[list[list[int]]], dict]:
    """The kept pairs [layer][Hkv][r] and the layout's other MLAConversion fields: none for per-head; for
    DeepSeek's, one progression of pairs for every layer and head, the shared-key fits and the latent norm."""
    geo, r = shape.geometry, shape.rope_pairs
    if spec.layout != "deepseek":
        scores = None if calibration is None else calibration.pair_scores.get(selection)
        return rs.select_rope_pairs(selection, geo, r, scores), {}
    scores = None
    if selection == "attention":
        per_layer = calibration.pair_scores.get("attention")
        if per_layer is None:
            raise ValueError(
                "The given calibration lacks the attention pair scores; calibrate attention_pairs."
            )
        scores = sum(per_layer[i].double().sum(0) for i in range(geo.num_layers))  # (d/2,)
    stride = sr.choose_stride(scores, half=geo.head_dim // 2, rope_pairs=r)
    kept = sr.progression_pairs(r, stride)
    pairs = [[list(kept) for _ in range(geo.num_kv_heads)] for _ in range(geo.num_layers)]
    if r and not calibration.statistics[0].has("shared_keys"):
        raise ValueError("The given calibration lacks the shared-key statistics; calibrate shared_keys=True.")
    keys = {i: sr.fit_shared_key(calibration.statistics[i].shared_keys, kept) for i in range(geo.num_layers)}
    return pairs, dict(
        layout="deepseek",
        rope_stride=stride,
        shared_keys=keys,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        norm_refine_steps=sr.NORM_REFINE_STEPS,
    )


def _allocate(plan: MLAConversion, *, allocate_latent: bool) -> MLAConversion:
    """`plan` with per-layer ranks (conversion.mla.ranks) under the same total cache."""
    geo, s, statistics = plan.shape.geometry, plan.shape, plan.calibration.statistics
    chosen, record = alloc.plan_allocation(
        geometry=geo,
        read_layer=plan.read_layer,
        pair_scores=plan.calibration.pair_scores["attention"],
        query_fit=plan.calibration.query_fit,
        moment=lambda i: statistics[i].moment,  # read layer by layer
        rope_pairs=s.rope_pairs,
        kv_lora_rank=s.kv_lora_rank,
        allocate_latent=allocate_latent,
    )
    shapes = [MLAShape(geo, r, c) for r, c in zip(chosen.rope_pairs, chosen.kv_lora_ranks)]
    assert sum(x.cache_numbers for x in shapes) <= geo.num_layers * s.cache_numbers, "over the budget"
    widest = MLAShape(geo, max(chosen.rope_pairs), max(chosen.kv_lora_ranks))
    return replace(plan, shape=widest, pairs=chosen.pairs, layer_shapes=shapes, allocation=record)
