"""MHA/GQA -> MLA: a Llama / Mistral / Qwen2 checkpoint as the `llama_mla` model type (MHA2MLA, TransMLA).

    hf-attn convert mla --model SRC --output DST [--kv-lora-rank N | --kv-budget F] [--rope-pairs R]
        [--rope-selection high|uniform|2norm|attention] [--factorization weight-svd|activation|attention]
        [--layout per-head|deepseek] [--calibration-text FILE ... | --calibration-corpus NAME]
        [--calibration-tokens N] [--refine-steps 32] [--save-dtype float32|bfloat16] [--overwrite]

Per layer, each KV head keeps RoPE on r of its d/2 frequency pairs (`conversion.mla.rope_selection`) and
the stacked [k_nope; v] of all KV heads becomes up (down x), the cached latent of width d_c = kv_lora_rank
(`conversion.mla.factorization`): d_c + Hkv 2r numbers per token and layer; docs/mla.md has the construction
and the defaults (`--kv-budget 0.5`; `--rope-pairs d/2` alone is exact). `--layout deepseek`
(`conversion.mla.shared_rope`) writes DeepSeek-V2/V3's layout instead, one RoPE key per layer shared by all
heads and an RMSNorm on the cached latent (cache d_c + 2r), which `hf-attn export` writes as an exact
deepseek_v3 checkpoint. The command then refines every layer against the source (32 steps by default, the
recipe that measures best; `--refine-steps 0`: the closed form only)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint.io import add_record, open_source, save_streamed
from hf_attn.conversion.mla.calibration import Calibration
from hf_attn.conversion.mla.plan import MLAConversion, copy_model_code, plan_conversion
from hf_attn.conversion.specs import DEFAULT_MAX_SHARD_BYTES, CalibrationSpec, MLASpec, WriteSpec
from hf_attn.tooling.files import check_output

PROG = "hf-attn convert mla"


@torch.inference_mode()
def convert_to_mla(
    spec: MLASpec = MLASpec(),
    *,
    src: str | Path | None,
    dst: str | Path,
    calibration: CalibrationSpec = CalibrationSpec(),
    write: WriteSpec = WriteSpec(),
    calibration_pass: Calibration | None = None,
) -> Path:
    """Write `dst`: checkpoint `src` (None: the embedded SmolLM2) converted to `llama_mla` with the ranks and
    fits of `spec` (default: a KV budget of DEFAULT_KV_BUDGET; `MLASpec(rope_pairs=d/2)` alone or
    `kv_budget=1` is exact). Calibration (the source model's forward over `calibration`'s text, layer by
    layer on its device) runs only if the options need it, unless `calibration_pass` (an `mla.calibrate`
    result on the same source) is given. The closed form only: `conversion.pipeline.convert` refines it."""
    start = time.perf_counter()
    source = open_source(src, dst=dst, overwrite=write.overwrite, dtype=write.save_dtype)  # before slow work
    with stages.recording():  # the record's stage_seconds
        plan = plan_conversion(source, spec, calibration, calibration_pass=calibration_pass)
        return write_conversion(
            plan,
            dst,
            dtype=source.dtype,
            overwrite=write.overwrite,
            max_shard_bytes=write.max_shard_bytes,
            start=start,
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
        seconds = stages.snapshot()  # (none outside a recording)
        if seconds:
            record["stage_seconds"] = seconds
        return add_record(config, record)

    with stages.stage("write"):
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


def describe(r: dict) -> str:
    """One line on a `convert_to_mla` conversion record (for the command)."""
    s, numbers, a = r["settings"], r["kv_numbers_per_token_per_layer"], r.get("allocation")
    most = "<=" if a else "="  # per-layer ranks: the scalars are the largest layer's
    per_layer = (
        f", per layer ({a['method']}) r={a['layer_rope_pairs']} d_c={a['layer_kv_lora_ranks']}" if a else ""
    )
    return (
        f"MLA ({s['layout']} layout): r{most}{r['rope_pairs']} ({s['rope_selection']}), "
        f"d_c{most}{r['kv_lora_rank']} ({s['factorization']}), {numbers['mla']}/{numbers['source']} numbers "
        f"per token and layer ({100 * r['kv_fraction']:.1f}%){per_layer}"
    )
