"""MHA/GQA -> GQA/MQA: pool H key/value heads into G groups (Ainslie et al. 2023), or a calibrated variant.

    hf-attn convert gqa --model SRC --num-kv-heads G --output DST [--method calibrated|mean]
        [--grouping contiguous|search] [--calibration-text FILE ... | --calibration-corpus NAME]
        [--calibration-tokens N] [--refine-steps 32] [--save-dtype float32|bfloat16] [--overwrite]

The command's defaults are the recipe that measures best: calibrated pooling, then 32 steps of layer-local
refinement (`--refine-steps 0`: the closed form only); `--method mean --refine-steps 0` is the GQA paper's.
The fits are in `conversion.gqa.pooling`; this module writes the pooled checkpoint, tensor by tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.checkpoint.io import (
    TensorInfo,
    add_record,
    conversion_record,
    dtype_name,
    expected_attention_shapes,
    names_in_file_order,
    open_source,
    parse_attn_key,
    read_tensor,
    save_streamed,
)
from hf_attn.conversion.checkpoint.shards import SpilledLayers
from hf_attn.conversion.gqa import grouping as grp
from hf_attn.conversion.gqa.pooling import Pooling, calibrate, check_pooling, mean_pool_heads
from hf_attn.conversion.specs import CalibrationSpec, GQASpec, WriteSpec
from hf_attn.tooling.files import checkpoint_hash, scratch_directory

PROG = "hf-attn convert gqa"


def _pooled_tensors(
    index: dict[str, TensorInfo],
    pooling: Pooling,
    calibrated: dict[int, dict[str, torch.Tensor | None]] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The converted checkpoint's tensors in source file order, one at a time: mean-pooled K/V read and
    pooled tensor by tensor, or (calibrated) the precomputed attention tensors in the source's dtype."""
    shapes = expected_attention_shapes(dataclasses.replace(pooling.geometry, num_kv_heads=pooling.num_groups))
    for name in tqdm(names_in_file_order(index), desc="write", unit="tensor"):
        parsed = parse_attn_key(name)
        if parsed is None:
            yield name, read_tensor(index[name])
            continue
        layer, proj, kind = parsed
        if calibrated is not None and calibrated[layer].get(f"{proj}.{kind}") is not None:
            tensor = calibrated[layer][f"{proj}.{kind}"].to(index[name].dtype)
        else:
            tensor = read_tensor(index[name])
            if proj in ("k_proj", "v_proj"):
                tensor = mean_pool_heads(tensor, pooling=pooling)
        assert tuple(tensor.shape) == shapes[proj, kind], (name, tuple(tensor.shape))
        yield name, tensor
        del tensor  # hold one tensor at a time


def _gqa_record(spec: GQASpec, source, pooling: Pooling) -> dict:
    """The conversion record before calibration (`_calibrate_layers` adds what it ran on)."""
    config = source.config
    return conversion_record(
        kind="gqa",
        source=source.dir,
        source_hash=checkpoint_hash(source.dir),
        settings={**dataclasses.asdict(spec), "device": None, "forward_dtype": None},
        num_key_value_heads={"from": source.geometry.num_kv_heads, "to": spec.num_kv_heads},
        groups=pooling.groups,
        calibration=None,
        dtype=dtype_name(source.dtype) if source.dtype else config.get("dtype", config.get("torch_dtype")),
    )


def _calibrate_layers(
    spec: GQASpec,
    source,
    pooling: Pooling,
    calibration: CalibrationSpec,
    record: dict,
    spill: Callable[[], Path],
) -> MutableMapping | None:
    """The calibrated attention tensors of every layer (None: mean pooling reads and pools tensor by
    tensor); fills the record's calibration. spill(): a scratch directory for the fitted layers."""
    searched = spec.grouping == "search" and pooling.heads_per_group > 1 and pooling.num_groups > 1
    if not searched and not (spec.method == "calibrated" and pooling.heads_per_group > 1):
        return None  # (one group, or one head per group: every grouping is the same; G == H: the identity)
    c = calibration
    if searched:
        layers, record["groups"] = grp.search_and_pool(
            src_dir=source.dir, index=source.index, pooling=pooling, method=spec.method, calibration=c
        )  # groups: per layer, the source KV heads of each group (q_proj rows / o_proj columns permuted)
    else:
        layers = calibrate(
            src_dir=source.dir, pooling=pooling, calibration=c, store=SpilledLayers(spill(), source.index)
        )
    record["settings"].update(layerwise.forward_record(c.device, c.forward_dtype))
    record["calibration"] = cal.calibration_record(c, c.tokens)
    return layers


def convert_gqa(
    spec: GQASpec,
    *,
    src: str | Path | None,
    dst: str | Path,
    calibration: CalibrationSpec = CalibrationSpec(),
    write: WriteSpec = WriteSpec(),
) -> Path:
    """Write `dst`: checkpoint `src` (None: the embedded SmolLM2) with its KV heads pooled into
    `spec.num_kv_heads` groups by `spec.method` (calibrated: fitted on `calibration`'s text, layer by layer on
    its device; mean: the GQA paper's), grouped by `spec.grouping` ("contiguous", or "search": per layer the
    grouping whose pooled fit loses least on the calibration text, `conversion.gqa.grouping`). The closed form
    only: `conversion.pipeline.convert` refines it."""
    source = open_source(src, dst=dst, overwrite=write.overwrite, dtype=write.save_dtype)  # before slow work
    pooling = check_pooling(source.geometry, spec.num_kv_heads)
    record = _gqa_record(spec, source, pooling)
    with contextlib.ExitStack() as stack, stages.recording():  # the record's stage_seconds
        parent = Path(dst).resolve().parent  # the fitted layers wait beside dst, one file per layer

        def spill() -> Path:
            where = parent if parent.is_dir() else None
            return Path(stack.enter_context(scratch_directory(".hf-attn-gqa-fit-", dir=where)))

        layers = _calibrate_layers(spec, source, pooling, calibration, record, spill)

        def config() -> dict:  # once the weights are written: the stages include the write
            record["stage_seconds"] = stages.snapshot()
            return add_record({**source.config, "num_key_value_heads": spec.num_kv_heads}, record)

        with stages.stage("write"):
            return save_streamed(
                src_dir=source.dir,
                dst=dst,
                tensors=_pooled_tensors(source.index, pooling, layers),
                config=config,
                overwrite=write.overwrite,
                dtype=source.dtype,
                max_shard_bytes=write.max_shard_bytes,
            )


def describe(record: dict) -> str:
    """One line on a `convert_gqa` conversion record (for the command)."""
    heads = record["num_key_value_heads"]
    return f"pooled {heads['from']} -> {heads['to']} KV heads ({record['settings']['method']})"
