"""Converter plumbing shared by every converter (GQA pooling, GQA expansion, MLA, healing): the prologue
(`open_source` -> `Source`; `check_supported` and `AttentionGeometry`: what a converter may rely on), the one
reader of a checkpoint's weights (`tensor_index` / `iter_tensors` / `read_tensor`: `hf_attn.tooling.weights`),
the streamed writer (`save_streamed`) and everything that is not weights: side files, config.json and the
records of every step so far in `config.json["hf_attn"]["history"]` (one schema: `conversion_record`).

Writers are meant to be used inside `hf_attn.tooling.files.atomic_directory`, so a failure leaves no output.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.conversion.checkpoint.shards import INDEX_FILE, ShardedWriter
from hf_attn.conversion.specs import DEFAULT_MAX_SHARD_BYTES
from hf_attn.models.llama_mla.configuration_llama_mla import SOURCE_MODEL_TYPES
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import TENSOR_SUFFIXES, atomic_directory, check_output
from hf_attn.tooling.loading import (
    CONFIG_NAME,
    check_head_counts,
    checkpoint_weights,
    dtype_name,
    parse_dtype,
    read_config,
    resolve_model,
)
from hf_attn.tooling.weights import NAMED_FILE_KEY, TensorInfo, names_in_file_order, read_tensor, tensor_index

# A converter rewrites weights and config itself; every other file (not a TENSOR_SUFFIXES one) is a side file.
_NOT_SIDE_FILES = (CONFIG_NAME, INDEX_FILE, "pytorch_model.bin.index.json")


def write_config(directory: str | os.PathLike, config: dict) -> Path:
    path = Path(directory) / CONFIG_NAME
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


# Llama-family relatives whose math the converters do not cover: model_type -> the feature the refusal names.
UNCOVERED_MODEL_TYPES = {
    "qwen3": "q_norm/k_norm (per-head query/key RMSNorm)",
    "qwen3_moe": "q_norm/k_norm (per-head query/key RMSNorm) and a sparse MoE MLP",
    "olmo2": "q_norm/k_norm (query/key RMSNorm over all heads)",
    "olmo3": "q_norm/k_norm (query/key RMSNorm over all heads)",
    "olmo": "non-parametric LayerNorm and clip_qkv",
    "gemma": "scaled embeddings (x sqrt(hidden_size)) and the (1 + weight) RMSNorm",
    "gemma2": "attention and final logit soft-capping, scaled embeddings and the (1 + weight) RMSNorm",
    "gemma3": "q_norm/k_norm, scaled embeddings and the (1 + weight) RMSNorm",
    "phi3": "fused qkv_proj (query, key and value in one tensor)",
    "phi": "partial rotary, LayerNorm with bias and parallel attention/MLP",
    "stablelm": "partial rotary and LayerNorm",
    "gpt_neox": "fused query_key_value, partial rotary and LayerNorm",
    "cohere": "LayerNorm, parallel attention/MLP and logit_scale",
    "granite": "attention/embedding/residual multipliers and logits_scaling",
    "mixtral": "a sparse MoE MLP (llama_mla is dense)",
    "qwen2_moe": "a sparse MoE MLP (llama_mla is dense)",
    "deepseek_v3": "it already uses multi-head latent attention",
}
# Config fields whose truthy value means math the converters do not cover: field -> the feature.
_UNCOVERED_FIELDS = {
    "qk_norm": "qk_norm (a normalisation after the query/key projections)",
    "use_qk_norm": "use_qk_norm (a normalisation after the query/key projections)",
    "qk_layernorm": "qk_layernorm (a normalisation after the query/key projections)",
    "quantization_config": "quantization_config (quantized weights)",
    "attn_logit_softcapping": "attn_logit_softcapping (attention logit soft-capping)",
    "final_logit_softcapping": "final_logit_softcapping (output logit soft-capping)",
    "clip_qkv": "clip_qkv (clamped query/key/value activations)",
    "use_parallel_residual": "use_parallel_residual (parallel attention/MLP)",
    "num_local_experts": "num_local_experts (a sparse MoE MLP)",
}


def check_supported(config: dict) -> AttentionGeometry:
    """Its geometry, or UserError (naming the feature) unless this is a Llama-family checkpoint whose math
    every converter covers: model_type llama / mistral / qwen2, no norm or quantizer after the projections,
    RoPE on every pair, valid head arithmetic. The one support check of expand, gqa, mla and export."""
    model_type = config.get("model_type")
    fix = f"supported model types: {', '.join(SOURCE_MODEL_TYPES)} (see docs/variant-matrix.md)."
    if model_type in UNCOVERED_MODEL_TYPES:
        raise UserError(
            f"{model_type}: {UNCOVERED_MODEL_TYPES[model_type]} is not covered by the conversion math; {fix}"
        )
    if model_type not in SOURCE_MODEL_TYPES:
        raise UserError(f"Unsupported model_type {model_type!r}; {fix}")
    flags = [feature for k, feature in _UNCOVERED_FIELDS.items() if config.get(k)]
    if flags:
        raise UserError(
            f"Unsupported {model_type} checkpoint: {'; '.join(flags)} set in config.json, not covered by the "
            "conversion math (a norm or quantizer after the key projection breaks linear pooling); use a "
            "plain unquantized checkpoint."
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UserError(
            f"Unsupported partial_rotary_factor={partial} (partial rotary: RoPE on part of each head) is not "
            "covered by the conversion math, which assumes RoPE on every pair; use a full-RoPE source."
        )
    return AttentionGeometry.from_config(config)  # validates the head arithmetic


@dataclass(frozen=True)
class AttentionGeometry:
    """Attention shape of a Llama-family config; everything else derives from these five numbers."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict) -> AttentionGeometry:
        names = ("num_attention_heads", "hidden_size", "num_hidden_layers")
        bad = [k for k in names if not isinstance(config.get(k), int) or config[k] < 1]
        if bad:
            raise UserError(f"config.json has no positive integer {', '.join(bad)}; repair it")
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        check_head_counts(num_heads, num_kv_heads)
        return cls(config["num_hidden_layers"], config["hidden_size"], num_heads, num_kv_heads, head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attn_key(layer: int, proj: str, kind: str = "weight") -> str:
    """Name of an attention tensor: attn_key(3, "k_proj") -> "model.layers.3.self_attn.k_proj.weight"."""
    assert proj in ATTENTION_PROJECTIONS and kind in ("weight", "bias"), (proj, kind)
    return f"model.layers.{layer}.self_attn.{proj}.{kind}"


def layer_attn_keys(layer: int) -> dict[str, str]:
    """ "q_proj.weight", "q_proj.bias", ... -> the checkpoint names of one layer's attention tensors."""
    return {f"{p}.{k}": attn_key(layer, p, k) for p in ATTENTION_PROJECTIONS for k in ("weight", "bias")}


def parse_attn_key(name: str) -> tuple[int, str, str] | None:
    """Inverse of `attn_key`: (layer, proj, kind), or None for any other tensor."""
    parts = name.split(".")
    if len(parts) != 6 or not name.startswith("model.layers.") or parts[3] != "self_attn":
        return None
    return (int(parts[2]), parts[4], parts[5]) if parts[2].isdigit() else None


def iter_tensors(
    model_dir: str | os.PathLike, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time in file order (or in the order of `names`)."""
    index = tensor_index(model_dir)
    names = names_in_file_order(index) if names is None else names
    for name in names:
        if name not in index:
            raise KeyError(f"Tensor {name!r} is missing from the checkpoint {model_dir}.")
        yield name, read_tensor(index[name])


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy everything that is not weights or config.json (tokenizer, generation config, chat template...)."""
    src, dst = Path(src), Path(dst)
    files = [p for p in sorted(src.iterdir()) if p.is_file() and not p.name.startswith(".")]
    copied = [p.name for p in files if p.name not in _NOT_SIDE_FILES and p.suffix not in TENSOR_SUFFIXES]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied


RECORD_KINDS = ("gqa", "mla", "expand", "heal", "export", "refine")


def conversion_record(
    *, kind: str, source: str | os.PathLike, source_hash: str, settings: dict, **results
) -> dict:
    """One entry of `config.json["hf_attn"]["history"]`, the same schema for every step: `kind` (which
    command: one of RECORD_KINDS), `source` (the input checkpoint's path), `source_hash` (its
    `checkpoint_hash`), `settings` (the options it ran with) and then the step's own results."""
    if kind not in RECORD_KINDS:
        raise ValueError(f"Unknown record kind {kind!r}; choose one of {', '.join(RECORD_KINDS)}")
    record = {"kind": kind, "source": str(source), "source_hash": source_hash, "settings": dict(settings)}
    return {**record, **results}


def add_record(config: dict, record: dict) -> dict:
    """Copy of `config` with `record` appended to `config["hf_attn"]["history"]` (each record once; a
    `last` key that older checkpoints carry beside it is dropped)."""
    out = copy.deepcopy(config)
    section = {k: v for k, v in (out.get("hf_attn") or {}).items() if k != "last"}
    section["history"] = [*section.get("history", []), copy.deepcopy(record)]
    return {**out, "hf_attn": section}


def latest_record(config: dict) -> dict:
    """The newest conversion record of a checkpoint's `config` ({} when hf-attn never wrote it)."""
    history = (config.get("hf_attn") or {}).get("history") or []
    return history[-1] if history else {}


def expected_attention_shapes(geometry: AttentionGeometry) -> dict[tuple[str, str], tuple[int, ...]]:
    """(proj, kind) -> shape of the attention tensors of one layer of a Llama-family checkpoint."""
    q, kv, c = geometry.num_heads * geometry.head_dim, geometry.kv_dim, geometry.hidden_size
    weights = {(p, "weight"): s for p, s in zip(ATTENTION_PROJECTIONS, [(q, c), (kv, c), (kv, c), (c, q)])}
    return weights | {(p, "bias"): s[:1] for (p, _), s in weights.items()}  # a bias: (out,)


def check_attention_tensors(index: dict[str, TensorInfo], geometry: AttentionGeometry) -> None:
    """UserError unless every layer has q/k/v/o weights (and any biases) of the shapes the config implies."""
    shapes = expected_attention_shapes(geometry)
    keys = (attn_key(layer, proj) for layer in range(geometry.num_layers) for proj in ATTENTION_PROJECTIONS)
    missing = [key for key in keys if key not in index]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise UserError(f"Missing weights in the checkpoint: {', '.join(missing[:5])}{more}.")
    norms = [n for n in index if ".self_attn." in n and ("q_norm" in n or "k_norm" in n)]
    if norms:
        raise UserError(f"Unsupported checkpoint: query/key norms ({norms[0]}, ...) break linear pooling.")
    for name, info in index.items():
        parsed = parse_attn_key(name)
        if parsed is None:
            continue
        layer, proj, kind = parsed
        if proj not in ATTENTION_PROJECTIONS:
            continue  # not a projection (an old rotary buffer...): `loading.checkpoint_weights` judges it
        want = shapes.get((proj, kind))
        if want is None or layer >= geometry.num_layers:
            raise UserError(f"Unexpected attention tensor {name} {list(info.shape)} for this config.")
        if info.shape != want:
            raise UserError(
                f"{name} has shape {list(info.shape)}, but config.json implies {list(want)} "
                f"({geometry.num_heads} query / {geometry.num_kv_heads} KV heads of dim {geometry.head_dim}, "
                f"hidden {geometry.hidden_size}); the weights do not match the config."
            )


@dataclass(frozen=True)
class Source:
    """A resolved, validated source checkpoint: what every converter reads before it converts."""

    dir: Path
    config: dict  # config.json as read
    geometry: AttentionGeometry
    index: dict[str, TensorInfo]  # every tensor, from the headers (`tensor_index`)
    dtype: torch.dtype | None  # cast of the written floating weights; None keeps the source's


def open_source(
    src: str | os.PathLike | None,
    *,
    dst: str | os.PathLike | None = None,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
) -> Source:
    """The converters' prologue: resolve `src` (None: the embedded SmolLM2), read and check config.json
    (`check_supported`) and the attention tensors (`check_attention_tensors`), parse `dtype`, (when `dst`
    is given) refuse an output that is the source or exists without `overwrite`, and last `checked_index`."""
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    src_dir = resolve_model(src)
    config = read_config(src_dir)
    geometry = check_supported(config)
    index = tensor_index(src_dir)
    check_attention_tensors(index, geometry)
    if dst is not None:
        check_output(src_dir, dst, overwrite=overwrite)
    return Source(src_dir, config, geometry, checked_index(src_dir, index), dtype)


def checked_index(src_dir: Path, index: dict[str, TensorInfo] | None = None) -> dict[str, TensorInfo]:
    """The source's `tensor_index` (read if not given) once the source passed `loading.checkpoint_weights`
    (it would load completely, every weight finite; each tensor read once), less what transformers drops on
    load (old `rotary_emb.inv_freq` buffers): what a converter may read and write. The last check of a
    converter's prologue: it reads every weight."""
    dropped = checkpoint_weights(src_dir).dropped
    index = tensor_index(src_dir) if index is None else index
    return {name: info for name, info in index.items() if name not in dropped}


def save_streamed(
    *,
    src_dir: str | os.PathLike,
    dst: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict | Callable[[], dict],
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Callable[[Path], object] | None = None,
) -> Path:
    """Write a complete checkpoint atomically: `tensors` streamed into shards (floating ones cast to `dtype`
    if given), `config` as config.json (a callable is called once the weights are written), the side files
    of `src_dir`, then `extra_files(directory)` if given. Returns the final directory."""
    dst = check_output(src_dir, dst, overwrite=overwrite)
    with atomic_directory(dst, overwrite=overwrite, kind="checkpoint") as tmp:
        with ShardedWriter(tmp, max_shard_bytes=max_shard_bytes) as writer:
            for name, tensor in tensors:
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                writer.add(name, tensor)
                del tensor  # let it go before the next one is read
        out = config() if callable(config) else config
        out = {k: v for k, v in out.items() if k != NAMED_FILE_KEY}  # names a file of the source
        if dtype is not None:
            out = {**out, "dtype": dtype_name(dtype)}
            out.pop("torch_dtype", None)
        write_config(tmp, out)
        copy_side_files(src_dir, tmp)
        if extra_files is not None:
            extra_files(tmp)
    return dst
