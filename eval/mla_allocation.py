"""Uniform vs greedy per-layer allocation of the MLA KV budget (conversion.allocation), on one calibration.

    python -m eval.mla_allocation [--model SRC] [--budgets 0.5,0.3] [--variants uniform,greedy]
        [--max-tokens 8192] [--context-length 1024] [--calibration-tokens 8192] [--calibration-cache FILE]
        [--output results/mla_allocation.json]

Protocol: as `eval.mla_curve` (one fp32 calibration pass shared by every conversion; each conversion written
by the converter, loaded in fp32 and scored on the first `--max-tokens` tokens of *Persuasion* in disjoint
windows of `--context-length`). Variants: the converter's `--allocation` values (`uniform`, `greedy`: RoPE
pairs per layer, `greedy-ranks`: RoPE pairs and latent ranks per layer). Appends one JSON line per conversion
to `--output` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint import open_source
from hf_attn.eval.mla_curve import calibration_files, evaluate_checkpoint
from hf_attn.tooling import loading
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.files import scratch_directory
from hf_attn.tooling.loading import resolve_model

PROG = "hf-attn allocation"
VARIANTS = ("uniform", "greedy", "greedy-ranks")


def plan_variant(src_dir: Path, budget: float, variant: str, calibration, rope_pairs: int | None = None):
    return mla.plan_conversion(
        src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, allocation=variant
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--budgets", default="0.75,0.5,0.375,0.3,0.25,0.125")
    parser.add_argument("--variants", default="uniform,greedy")
    parser.add_argument("--rope-pairs", type=int, default=None, help="override the budget's default r")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--calibration-tokens", type=int, default=mla.DEFAULT_CALIBRATION_TOKENS)
    parser.add_argument("--calibration-cache", type=Path, default=None, help="torch.save'd calibration")
    parser.add_argument("--output", type=Path, default=Path("results/mla_allocation.json"))
    args = parser.parse_args(argv)
    src_dir = Path(resolve_model(args.model))
    geometry = open_source(src_dir).geometry
    ids = tokenize(loading.load_tokenizer(str(src_dir)), load_corpus())[: args.max_tokens]
    cache = args.calibration_cache
    if cache is not None and cache.exists():
        calibration = torch.load(cache, weights_only=False)
    else:
        start = time.perf_counter()
        calibration = mla.calibrate(
            src_dir=src_dir,
            geometry=geometry,
            files=calibration_files(),
            tokens=args.calibration_tokens,
            scratch_dir=None if cache is None else cache.with_suffix(".statistics"),  # kept beside the cache
        )
        print(f"calibration: {time.perf_counter() - start:.0f} s", flush=True)
        if cache is not None:
            torch.save(calibration, cache)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for budget in (float(b) for b in args.budgets.split(",")):
        for variant in args.variants.split(","):
            start = time.perf_counter()
            plan = plan_variant(src_dir, budget, variant, calibration, args.rope_pairs)
            with scratch_directory("mla_alloc_") as scratch:
                tmp = Path(scratch)
                path = mla.write_conversion(plan, tmp / "ckpt", start=start)
                result = evaluate_checkpoint(path, ids, args.context_length)
            shapes = plan.layer_shapes or [plan.shape] * geometry.num_layers
            numbers = sum(s.cache_numbers for s in shapes)
            row = {
                "budget": budget,
                "variant": variant,
                "rope_pairs_override": args.rope_pairs,
                "tokens": int(ids.numel()),
                "context_length": args.context_length,
                "kv_fraction": numbers / (geometry.num_layers * 2 * geometry.kv_dim),
                "layer_rope_pairs": [s.rope_pairs for s in shapes],
                "layer_kv_lora_ranks": [s.kv_lora_rank for s in shapes],
                "seconds": round(time.perf_counter() - start, 1),
                **result,
            }
            with args.output.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{budget:.3f} {variant:14s} frac {row['kv_fraction']:.4f} ppl {row['perplexity']:.2f} "
                f"r {row['layer_rope_pairs']} d_c {row['layer_kv_lora_ranks']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
