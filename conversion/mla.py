"""MHA/GQA -> MLA: a Llama / Mistral / Qwen2 checkpoint as the `llama_mla` model type (MHA2MLA, TransMLA).

    hf-attn convert mla --model SRC --output DST [--kv-lora-rank N | --kv-budget F] [--rope-pairs R]
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
in docs/mla.md, the measured curve in docs/research/. `--layout deepseek` (`conversion.shared_rope`) writes
DeepSeek-V2/V3's layout instead: one RoPE key per layer shared by all heads on the pairs 0, s, ..., (r - 1) s
of every layer, and an RMSNorm on the cached latent (cache d_c + 2r); `hf-attn export` then writes it as an
exact deepseek_v3 checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hf_attn.conversion import allocation as alloc
from hf_attn.conversion import calibration as cal
from hf_attn.conversion import cli, layerwise
from hf_attn.conversion import factorization as fac
from hf_attn.conversion import rope_selection as rs
from hf_attn.conversion import shared_rope as sr
from hf_attn.conversion.checkpoint import DEFAULT_MAX_SHARD_BYTES, add_record, open_source, save_streamed
from hf_attn.conversion.engine_dims import conversion_ranks
from hf_attn.conversion.mla_calibration import DEFAULT_CALIBRATION_TOKENS, Calibration, calibrate
from hf_attn.conversion.mla_layer import (
    DEFAULT_FACTORIZATION,
    DEFAULT_ROPE_SELECTION,
    DEFAULT_ROPE_SHARE,
    MAX_ROPE_FRACTION,
    LayerStatistics,
    MLAShape,
    SpilledLayerStatistics,
    convert_layer,
    default_rope_pairs,
    head_row_order,
    layer_rows,
    mla_shapes,
    plan_shape,
)
from hf_attn.conversion.mla_plan import MLAConversion, copy_model_code, mla_config, plan_conversion
from hf_attn.tooling.errors import UserError, check_number, user_input
from hf_attn.tooling.files import check_output

__all__ = [  # the public names of the MLA conversion, wherever they live
    "DEFAULT_CALIBRATION_TOKENS",
    "DEFAULT_FACTORIZATION",
    "DEFAULT_KV_BUDGET",
    "DEFAULT_ROPE_SELECTION",
    "DEFAULT_ROPE_SHARE",
    "MAX_ROPE_FRACTION",
    "Calibration",
    "LayerStatistics",
    "MLAConversion",
    "MLAShape",
    "SpilledLayerStatistics",
    "alloc",
    "cal",
    "calibrate",
    "convert_layer",
    "convert_to_mla",
    "copy_model_code",
    "default_rope_pairs",
    "describe",
    "fac",
    "head_row_order",
    "layer_rows",
    "main",
    "mla_config",
    "mla_shapes",
    "plan_conversion",
    "plan_shape",
    "rs",
    "sr",
    "write_conversion",
]

PROG = "hf-attn convert mla"
DEFAULT_KV_BUDGET = 0.5  # of the command, when no rank option is given (the knee of the README's curve)


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
    engine_dims: str | None = None,
) -> Path:
    """Write `dst`: checkpoint `src` (None: the embedded SmolLM2) converted to `llama_mla`.
    `layout`: "per-head" (a RoPE key per KV head on its own pairs) or "deepseek" (see `plan_conversion`).

    Ranks: `kv_lora_rank` (d_c) or `kv_budget` (cache fraction of the source, picks d_c and, if
    `rope_pairs` is None, r); neither: full rank (the command `hf-attn convert mla` uses
    DEFAULT_KV_BUDGET when no rank option is given). `rope_pairs` None: every pair (or the budget's
    choice). Calibration (source model forward over `calibration_tokens` of `calibration_files`, default
    `calibration.default_calibration_files()`: the `mix` of the five novels other than Persuasion and five
    Python documentation sections) runs only if the options need it, layer by layer on `device` in
    `forward_dtype` (`layerwise.ForwardSettings`).
    """
    start = time.perf_counter()
    with user_input():
        layerwise.resolve_forward(device, forward_dtype)  # fails before any slow work
    source = open_source(src, dst=dst, overwrite=overwrite, dtype=dtype)  # fails before any slow calibration
    if engine_dims is not None:  # d_c and r whose export has exactly a size vLLM's MLA backends take
        if layout != "deepseek" or (kv_lora_rank, kv_budget, rope_pairs) != (None, None, None):
            raise UserError(
                "--engine-dims sets d_c and r of --layout deepseek: drop --kv-lora-rank, --kv-budget "
                "and --rope-pairs, and give --layout deepseek"
            )
        with user_input():
            g = source.geometry
            kv_lora_rank, rope_pairs = conversion_ranks(
                engine_dims, head_dim=g.head_dim, num_kv_heads=g.num_kv_heads
            )
    check_options(
        source.geometry,
        kv_lora_rank=kv_lora_rank,
        kv_budget=kv_budget,
        rope_pairs=rope_pairs,
        rope_selection=rope_selection,
        factorization=factorization,
        layout=layout,
        calibration_tokens=calibration_tokens,
    )
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


def check_options(
    geometry,
    *,
    kv_lora_rank: int | None,
    kv_budget: float | None,
    rope_pairs: int | None,
    rope_selection: str,
    factorization: str,
    layout: str,
    calibration_tokens: int,
) -> None:
    """The MLA options checked against the source's geometry before any work: UserError naming the first
    bad one (a budget that is not a fraction in (0, 1], ranks that do not fit, too few calibration tokens
    for the attention statistics)."""
    if kv_budget is not None and not (isinstance(kv_budget, (int, float)) and 0 < kv_budget <= 1):
        raise UserError(f"--kv-budget must be a fraction in (0, 1] of the source's KV cache, got {kv_budget}")
    check_number("--calibration-tokens", calibration_tokens, minimum=1, inclusive=True, integer=True)
    with user_input():  # the ranks fit the source (--kv-lora-rank, --rope-pairs: rope_selection's check)
        plan_shape(
            geometry,
            kv_lora_rank=kv_lora_rank,
            kv_budget=kv_budget,
            rope_pairs=rope_pairs,
            rope_selection=rope_selection,
            layout=layout,
        )
    if "attention" in (factorization, rope_selection) and calibration_tokens <= rs.QUERY_STRIDE:
        raise UserError(  # one query per window: a singular attention statistic (LinAlgError in the fit)
            f"--calibration-tokens {calibration_tokens} is too few for --factorization / --rope-selection "
            f"attention, whose statistics use one query in {rs.QUERY_STRIDE} of a window: give at least "
            f"{rs.QUERY_STRIDE + 1} (the default is {DEFAULT_CALIBRATION_TOKENS})"
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
    ranks.add_argument(
        "--engine-dims",
        choices=("576", "512", "320"),
        default=None,
        help="--layout deepseek: d_c = size - 64 and 32 shared RoPE pairs, so that `hf-attn export "
        "--engine-dims SIZE` needs no padding (sizes vLLM's MLA backends take: conversion/engine_dims.py)",
    )
    ranks.add_argument(
        "--kv-lora-rank",
        type=int,
        default=None,
        help="d_c, width of the cached latent (default: the budget's)",
    )
    ranks.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help=f"cache fraction of the source's, picks d_c and r (default {DEFAULT_KV_BUDGET} without ranks)",
    )
    parser.add_argument(
        "--rope-pairs", type=int, default=None, help="r, RoPE pairs kept per KV head (default: the budget's)"
    )
    parser.add_argument(
        "--rope-selection",
        choices=rs.SELECTIONS,
        default=DEFAULT_ROPE_SELECTION,
        help="which RoPE pairs each KV head keeps",
    )
    parser.add_argument(
        "--factorization",
        choices=fac.FACTORIZATIONS,
        default=DEFAULT_FACTORIZATION,
        help="how the joint low-rank latent is fitted",
    )
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
    if (
        args.kv_lora_rank is None
        and args.kv_budget is None
        and args.rope_pairs is None
        and not args.engine_dims
    ):
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
        engine_dims=args.engine_dims,
        **cli.calibration_options(args),
    )


if __name__ == "__main__":
    sys.exit(main())
