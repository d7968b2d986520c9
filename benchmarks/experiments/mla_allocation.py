"""Uniform vs greedy per-layer allocation of the MLA KV budget (conversion.mla.ranks), on one calibration.

    python -m benchmarks.experiments.mla_allocation [--model SRC] [--budgets 0.5,0.3]
        [--variants uniform,greedy]
        [--max-tokens 8192] [--context-length 1024] [--calibration-tokens 8192] [--calibration-cache FILE]
        [--output-dir results/mla_allocation]
 Protocol: as the MLA curve's (one fp32 calibration pass shared by every conversion; each conversion written
by the converter and scored by the shared runner, `benchmarks/experiments/runner.py`). Variants: the
converter's `--allocation` values (`uniform`, `greedy`: RoPE pairs per layer, `greedy-ranks`: RoPE pairs and
latent
ranks per layer). Writes `allocation.json` and `allocation.md`; finished rows are kept in `rows/`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.experiments.runner import Point, Scoring, cached_calibration, calibration_spec, run_grid
from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.io import open_source
from hf_attn.conversion.specs import DEFAULT_CALIBRATION_TOKENS, MLASpec
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.experiments.mla_allocation"
VARIANTS = ("uniform", "greedy", "greedy-ranks")


def plan_variant(src_dir: Path, budget: float, variant: str, calibration, rope_pairs: int | None = None):
    return mla.plan_conversion(
        src_dir,
        MLASpec(kv_budget=budget, rope_pairs=rope_pairs, allocation=variant),
        calibration_pass=calibration,
    )


def markdown(record: dict) -> str:
    """One row per (budget, variant): the KV fraction reached, perplexity, the per-layer RoPE pairs."""
    header = ["KV budget", "allocation", "KV fraction", "perplexity", "RoPE pairs per layer"]
    rows = [
        [f"{r['budget']:g}", r["variant"], f"{r['kv_fraction']:.4f}", f"{r['perplexity']:.2f}",
         " ".join(map(str, r["layer_rope_pairs"]))]
        for r in record["rows"]
    ]  # fmt: skip
    return markdown_table(header, rows, align="llrrl") + "\n"


def run(
    *,
    model: str | None,
    output_dir: Path,
    budgets: list[float],
    variants: list[str],
    rope_pairs: int | None = None,
    max_tokens: int = 8192,
    context_length: int = 1024,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    calibration_cache: Path | None = None,
) -> dict:
    scoring = Scoring.load(model, max_tokens=max_tokens, context_length=context_length)
    src_dir = scoring.model_dir
    geometry = open_source(src_dir).geometry
    calibration = []

    def calibrated():
        if not calibration:
            make = lambda scratch: mla.calibrate(  # noqa: E731
                src_dir=src_dir,
                geometry=geometry,
                calibration=calibration_spec(calibration_tokens),
                scratch_dir=scratch,
            )
            calibration.append(cached_calibration(calibration_cache, make))
        return calibration[0]

    def measure(p: Point) -> dict:
        s = p.settings
        plan = plan_variant(src_dir, s["budget"], s["variant"], calibrated(), s["rope_pairs_override"])
        shapes = plan.layer_shapes or [plan.shape] * geometry.num_layers
        numbers = sum(x.cache_numbers for x in shapes)
        return {
            "kv_fraction": numbers / (geometry.num_layers * 2 * geometry.kv_dim),
            "layer_rope_pairs": [x.rope_pairs for x in shapes],
            "layer_kv_lora_ranks": [x.kv_lora_rank for x in shapes],
            **scoring.score_plan(plan, output_dir),
        }

    points = [
        Point(f"{b:g}-{v}", {"budget": b, "variant": v, "rope_pairs_override": rope_pairs})
        for b in budgets
        for v in variants
    ]
    return run_grid(
        output_dir,
        "allocation",
        points,
        measure,
        key=lambda p: scoring.row_key(calibration_tokens, p.settings),
        table=markdown,
        protocol={**scoring.protocol, "calibration_tokens": calibration_tokens},
        log=lambda r: (
            f"{r['budget']:.3f} {r['variant']:14s} frac {r['kv_fraction']:.4f} "
            f"ppl {r['perplexity']:.2f} r {r['layer_rope_pairs']} d_c {r['layer_kv_lora_ranks']}"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--budgets", default="0.75,0.5,0.375,0.3,0.25,0.125")
    parser.add_argument("--variants", default="uniform,greedy")
    parser.add_argument("--rope-pairs", type=int, default=None, help="override the budget's default r")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS)
    parser.add_argument("--calibration-cache", type=Path, default=None, help="torch.save'd calibration")
    parser.add_argument("--output-dir", type=Path, default=Path("results/mla_allocation"))
    args = parser.parse_args(argv)
    run(
        model=args.model,
        output_dir=args.output_dir,
        budgets=[float(b) for b in args.budgets.split(",")],
        variants=args.variants.split(","),
        rope_pairs=args.rope_pairs,
        max_tokens=args.max_tokens,
        context_length=args.context_length,
        calibration_tokens=args.calibration_tokens,
        calibration_cache=args.calibration_cache,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
