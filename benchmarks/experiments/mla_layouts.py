"""MLA layouts compared: per-head RoPE keys vs the DeepSeek layout (conversion.mla --layout deepseek).

    python -m benchmarks.experiments.mla_layouts [--budgets 0.75 0.5 0.3 0.25] [--heal-budgets 0.5 0.3]
        [--heal-steps 30]
        [--point LAYOUT:BUDGET:R ...] [--output-dir results/mla_layouts] [--max-tokens 8192]

Protocol (as the MLA curve's): SmolLM2 converted once per (layout, budget) with the converter's defaults
(`conversion.mla.plan_conversion` + `write_conversion`, the code of `hf-attn convert mla`), one calibration
pass shared by every point (8,192 tokens of the five Austen novels other than *Persuasion*, cached in
`OUTPUT_DIR/calibration-N.pt`); each checkpoint scored by the shared runner
(`benchmarks/experiments/runner.py`: fp32,
the first `--max-tokens` tokens of *Persuasion* in disjoint 1,024-token windows). Healing (`--heal-budgets`):
`hf-attn heal` with the study's recipe (512-token sequences, batch 1, lr 1e-4, all parameters, the five other
novels) for a fixed number of optimizer steps (`--heal-steps`, the same for both layouts), then scored again.
`--point deepseek:0.5:12` adds a point with r given (`deepseek:0.5:-:heal`: default r, healed).
Writes `layouts.json` and `layouts.md` (resumable: finished rows are kept in `OUTPUT_DIR/rows/`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.experiments.runner import Point, Scoring, cached_calibration, calibration_spec, run_grid
from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.io import AttentionGeometry, read_config
from hf_attn.conversion.mla import shared_rope as sr
from hf_attn.conversion.specs import MLASpec
from hf_attn.tooling.tables import cell, markdown_table

HEAL = {"seq_len": 512, "batch_size": 1, "lr": 1e-4, "trainable": "all"}


def run(
    *,
    model: str | None,
    output_dir: Path,
    points: list[tuple[str, float, int | None, bool]],
    heal_steps: int,
    max_tokens: int,
    context_length: int = 1024,
    calibration_tokens: int = 8192,
) -> dict:
    """Measure every (layout, budget, rope_pairs or None, heal) point the row store lacks."""
    scoring = Scoring.load(model, max_tokens=max_tokens, context_length=context_length)
    src_dir = scoring.model_dir
    geometry = AttentionGeometry.from_config(read_config(src_dir))
    heal = {"steps": heal_steps, **HEAL}
    protocol = {**scoring.protocol, "calibration_tokens": calibration_tokens, "heal": heal}
    calibration = []

    def calibrated():
        if not calibration:
            calibration.append(
                cached_calibration(
                    output_dir / f"calibration-{calibration_tokens}.pt",
                    lambda scratch: mla.calibrate(
                        src_dir=src_dir,
                        geometry=geometry,
                        pair_norms=False,
                        calibration=calibration_spec(calibration_tokens),
                        shared_keys=True,
                        sample_stride=sr.SAMPLE_STRIDE,
                        scratch_dir=scratch,  # kept: the pickled calibration reads them later
                    ),
                )
            )
        return calibration[0]

    def measure(p: Point) -> dict:
        s = p.settings
        plan = _plan(src_dir, s["layout"], s["kv_budget"], s["rope_pairs_given"], calibrated())

        def healed(path: Path, work: Path) -> dict:
            return {"after": scoring.score(_heal(path, work / "healed", heal))}

        scores = scoring.score_plan(plan, output_dir, then=healed if s["heal"] else None)
        shape = plan.shape
        row = {
            "rope_pairs": shape.rope_pairs,
            "rope_stride": plan.rope_stride,
            "kv_lora_rank": shape.kv_lora_rank,
            "cache_numbers": shape.cache_numbers,
            "kv_fraction": round(shape.kv_fraction, 4),
            "perplexity": scores["perplexity"],
            "healed_perplexity": scores["after"]["perplexity"] if s["heal"] else None,
            "convert_seconds": scores["convert_seconds"],
        }
        if s["layout"].startswith("deepseek"):
            row["shared_key_residual_mean"] = plan.record()["shared_key_residual_per_layer"]
        return row

    grid = [
        Point(_key(*p), {"layout": p[0], "kv_budget": p[1], "rope_pairs_given": p[2], "heal": p[3]})
        for p in points
    ]
    return run_grid(
        output_dir,
        "layouts",
        grid,
        measure,
        key=lambda p: scoring.row_key(calibration_tokens, heal if p.settings["heal"] else None, p.name),
        table=markdown,
        protocol=protocol,
        log=lambda r: (
            f"{r['layout']} {r['kv_budget']}: r={r['rope_pairs']} d_c={r['kv_lora_rank']} "
            f"({100 * r['kv_fraction']:.1f}%): ppl {r['perplexity']:.2f}"
            + ("" if r["healed_perplexity"] is None else f" -> healed {r['healed_perplexity']:.2f}")
        ),
    )


def _heal(path: Path, output: Path, heal: dict) -> Path:
    from hf_attn.conversion.training.data import HealSettings
    from hf_attn.conversion.training.heal import heal as run_heal

    settings = HealSettings(
        model=str(path),
        output=str(output),
        max_steps=heal["steps"],
        seq_len=heal["seq_len"],
        batch_size=heal["batch_size"],
        lr=heal["lr"],
        trainable=heal["trainable"],
        eval_tokens=0,
    )
    run_heal(settings, progress=False)
    return output


def markdown(record: dict) -> str:
    """One row per point: layout, budget, ranks, KV fraction, perplexity before and after healing."""
    header = ["layout", "KV budget", "r", "stride", "d_c", "KV fraction", "perplexity", "healed"]
    rows = [
        [r["layout"], f"{r['kv_budget']:g}", r["rope_pairs"], cell(r["rope_stride"]), r["kv_lora_rank"],
         f"{r['kv_fraction']:.3f}", cell(r["perplexity"], ".2f"), cell(r["healed_perplexity"], ".2f")]
        for r in record["rows"]
    ]  # fmt: skip
    return markdown_table(header, rows, align="lrrrrrrr") + "\n"


def _plan(src_dir, layout: str, budget: float, rope_pairs: int | None, calibration) -> mla.MLAConversion:
    """`per-head-progression`: the per-head layout on the DeepSeek layout's pairs (same r, same progression,
    the same query refit of the dropped pairs), so that comparing the two isolates the shared key and the
    latent norm."""
    if layout == "deepseek-refined":  # the encoder refined through the norm (an experiment)
        plan = mla.plan_conversion(
            src_dir,
            MLASpec(kv_budget=budget, rope_pairs=rope_pairs, layout="deepseek"),
            calibration_pass=calibration,
        )
        plan.norm_refine_steps = 15
        return plan
    if layout == "deepseek-no-refine":  # the latent norm with the least-squares decoders only
        plan = mla.plan_conversion(
            src_dir,
            MLASpec(kv_budget=budget, rope_pairs=rope_pairs, layout="deepseek"),
            calibration_pass=calibration,
        )
        plan.norm_refine_steps = 0
        return plan
    if layout == "deepseek-no-norm":  # the DeepSeek layout without its latent norm (not exportable)
        plan = mla.plan_conversion(
            src_dir,
            MLASpec(kv_budget=budget, rope_pairs=rope_pairs, layout="deepseek"),
            calibration_pass=calibration,
        )
        plan.norm_eps = None
        return plan
    if layout != "per-head-progression":
        spec = MLASpec(kv_budget=budget, rope_pairs=rope_pairs, layout=layout, allocation="uniform")
        return mla.plan_conversion(src_dir, spec, calibration_pass=calibration)  # one r, d_c in all layers
    ds = mla.plan_conversion(
        src_dir,
        MLASpec(kv_budget=budget, rope_pairs=rope_pairs, layout="deepseek"),
        calibration_pass=calibration,
    )
    plan = mla.plan_conversion(
        src_dir, MLASpec(kv_budget=budget, rope_pairs=ds.shape.rope_pairs), calibration_pass=calibration
    )
    plan.pairs, plan.rope_stride = ds.pairs, ds.rope_stride
    return plan


def _key(layout: str, budget: float, rope_pairs: int | None, healed: bool) -> str:
    return f"{layout}:{budget}:{rope_pairs}:{'healed' if healed else 'free'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments.mla_layouts", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--output-dir", default="results/mla_layouts")
    p.add_argument("--layouts", nargs="+", default=["per-head", "deepseek"])
    p.add_argument("--budgets", nargs="*", type=float, default=[0.75, 0.5, 0.3, 0.25])
    p.add_argument("--heal-budgets", nargs="*", type=float, default=[0.5, 0.3])
    p.add_argument("--heal-steps", type=int, default=30)
    p.add_argument("--point", nargs="*", default=[], help="LAYOUT:BUDGET[:R|-][:heal], after the grid")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--calibration-tokens", type=int, default=8192)
    args = p.parse_args(argv)
    points = []
    for b in args.budgets:
        for layout in args.layouts:
            points.append((layout, b, None, b in args.heal_budgets))
    for spec in args.point:  # LAYOUT:BUDGET[:R|-][:heal]
        layout, budget, *rest = spec.split(":")
        r = None if not rest or rest[0] in ("", "-") else int(rest[0])
        points.append((layout, float(budget), r, rest[1:] == ["heal"]))
    run(
        model=args.model,
        output_dir=Path(args.output_dir),
        points=points,
        heal_steps=args.heal_steps,
        max_tokens=args.max_tokens,
        calibration_tokens=args.calibration_tokens,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
