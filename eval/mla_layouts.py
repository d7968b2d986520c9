"""MLA layouts compared: per-head RoPE keys vs the DeepSeek layout (conversion.mla --layout deepseek).

    python -m eval.mla_layouts [--budgets 0.75 0.5 0.3 0.25] [--heal-budgets 0.5 0.3] [--heal-steps 30]
        [--point LAYOUT:BUDGET:R ...] [--output-dir results/mla_layouts] [--max-tokens 8192]

Protocol (the README's MLA curve): SmolLM2 converted once per (layout, budget) with the converter's defaults
(`conversion.mla.plan_conversion` + `write_conversion`, the code of `python -m conversion.mla`), one
calibration pass shared by every point (8,192 tokens of the five Austen novels other than *Persuasion*);
each checkpoint loaded with `AutoModelForCausalLM` (fp32, sdpa) and scored on the first `--max-tokens`
tokens of *Persuasion* in disjoint 1,024-token windows. Healing (`--heal-budgets`): `conversion.heal` with
the study's recipe (512-token sequences, batch 1, lr 1e-4, all parameters, the five other novels) for a fixed
number of optimizer steps (`--heal-steps`, the same for both layouts; the study's 2 minutes are about 30
steps on its idle machine), then scored again. `--point deepseek:0.5:12` adds a point with r given
(`deepseek:0.5:-:heal`: default r, healed).
Writes `layouts.json` (resumable: finished rows are skipped) and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint import AttentionGeometry, read_config
from hf_attn.eval.mla_curve import calibration_files, evaluate_checkpoint
from hf_attn.tooling import loading
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.files import scratch_directory
from hf_attn.tooling.loading import resolve_model


def run(
    *,
    model: str | None,
    output_dir: Path,
    points: list[tuple[str, float, int | None, bool]],
    heal_steps: int,
    max_tokens: int,
    context_length: int = 1024,
    calibration_tokens: int = 8192,
    skip_before_heal: bool = False,
) -> dict:
    from hf_attn.conversion.heal import heal

    src_dir = resolve_model(model)
    geometry = AttentionGeometry.from_config(read_config(src_dir))
    output_dir.mkdir(parents=True, exist_ok=True)
    out_json = output_dir / "layouts.json"
    corpus = load_corpus()
    ids = tokenize(loading.load_tokenizer(str(src_dir)), corpus)[:max_tokens]
    protocol = {
        "model": str(src_dir),
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "tokens": int(ids.numel()),
        "context_length": context_length,
        "calibration_tokens": calibration_tokens,
        "heal": {"steps": heal_steps, "seq_len": 512, "batch_size": 1, "lr": 1e-4, "trainable": "all"},
        "dtype": "float32",
    }
    record = json.loads(out_json.read_text()) if out_json.exists() else {"protocol": protocol, "rows": []}
    done = {r["key"] for r in record["rows"]}

    def save() -> None:
        out_json.write_text(json.dumps(record, indent=2) + "\n")

    todo = [p for p in points if _key(*p) not in done]
    calibration = None
    cal_path = output_dir / f"calibration-{calibration_tokens}.pt"  # reused by a re-run (same source)
    if todo and cal_path.exists():
        calibration = torch.load(cal_path, weights_only=False)
    elif todo:
        start = time.perf_counter()
        calibration = mla.calibrate(
            src_dir=src_dir,
            geometry=geometry,
            pair_norms=False,
            files=calibration_files(),
            tokens=calibration_tokens,
            shared_keys=True,
            sample_stride=mla.sr.SAMPLE_STRIDE,
            scratch_dir=cal_path.with_suffix(".statistics"),  # the pickled calibration reads them later
        )
        print(f"calibration: {time.perf_counter() - start:.0f} s", flush=True)
        torch.save(calibration, cal_path)
    for layout, budget, rope_pairs, do_heal in todo:
        start = time.perf_counter()
        plan = _plan(src_dir, layout, budget, rope_pairs, calibration)
        with scratch_directory("mla_layouts_", dir=output_dir) as scratch:
            tmp = Path(scratch)
            path = mla.write_conversion(plan, tmp / "ckpt", start=start)
            convert_seconds = round(time.perf_counter() - start, 1)
            before = None if do_heal and skip_before_heal else evaluate_checkpoint(path, ids, context_length)
            after = None
            if do_heal:
                heal(
                    model=path,
                    output=tmp / "healed",
                    max_steps=heal_steps,
                    seq_len=512,
                    batch_size=1,
                    lr=1e-4,
                    trainable="all",
                    eval_tokens=0,
                    progress=False,
                )
                after = evaluate_checkpoint(tmp / "healed", ids, context_length)
        shape = plan.shape
        row = {
            "key": _key(layout, budget, rope_pairs, do_heal),
            "layout": layout,
            "kv_budget": budget,
            "rope_pairs": shape.rope_pairs,
            "rope_stride": plan.rope_stride,
            "kv_lora_rank": shape.kv_lora_rank,
            "cache_numbers": shape.cache_numbers,
            "kv_fraction": round(shape.kv_fraction, 4),
            "convert_seconds": convert_seconds,
            "perplexity": None if before is None else before["perplexity"],
            "healed_perplexity": None if after is None else after["perplexity"],
            "before": before,
            "after": after,
        }
        if layout.startswith("deepseek"):
            row["shared_key_residual_mean"] = plan.record()["shared_key_residual_per_layer"]
        record["rows"].append(row)
        save()
        healed = "" if after is None else f" -> healed {after['perplexity']:.2f}"
        free = "-" if before is None else f"{before['perplexity']:.2f}"
        print(
            f"{layout} {budget}: r={shape.rope_pairs} s={plan.rope_stride} d_c={shape.kv_lora_rank} "
            f"({100 * shape.kv_fraction:.1f}%): ppl {free}{healed}",
            flush=True,
        )
    save()
    return record


def _plan(src_dir, layout: str, budget: float, rope_pairs: int | None, calibration) -> mla.MLAConversion:
    """`per-head-progression`: the per-head layout on the DeepSeek layout's pairs (same r, same progression,
    the same query refit of the dropped pairs), so that comparing the two isolates the shared key and the
    latent norm."""
    if layout == "deepseek-refined":  # the encoder refined through the norm (an experiment)
        plan = mla.plan_conversion(
            src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, layout="deepseek"
        )
        plan.norm_refine_steps = 15
        return plan
    if layout == "deepseek-no-refine":  # the latent norm with the least-squares decoders only
        plan = mla.plan_conversion(
            src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, layout="deepseek"
        )
        plan.norm_refine_steps = 0
        return plan
    if layout == "deepseek-no-norm":  # the DeepSeek layout without its latent norm (not exportable)
        plan = mla.plan_conversion(
            src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, layout="deepseek"
        )
        plan.norm_eps = None
        return plan
    if layout != "per-head-progression":
        return mla.plan_conversion(
            src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, layout=layout,
            allocation="uniform",  # the layouts are compared at one r and d_c in every layer
        )  # fmt: skip
    ds = mla.plan_conversion(
        src=src_dir, kv_budget=budget, rope_pairs=rope_pairs, calibration=calibration, layout="deepseek"
    )
    plan = mla.plan_conversion(
        src=src_dir, kv_budget=budget, rope_pairs=ds.shape.rope_pairs, calibration=calibration
    )
    plan.pairs, plan.rope_stride = ds.pairs, ds.rope_stride
    return plan


def _key(layout: str, budget: float, rope_pairs: int | None, healed: bool) -> str:
    return f"{layout}:{budget}:{rope_pairs}:{'healed' if healed else 'free'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.mla_layouts", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--output-dir", default="results/mla_layouts")
    p.add_argument("--layouts", nargs="+", default=["per-head", "deepseek"])
    p.add_argument("--budgets", nargs="*", type=float, default=[0.75, 0.5, 0.3, 0.25])
    p.add_argument("--heal-budgets", nargs="*", type=float, default=[0.5, 0.3])
    p.add_argument("--heal-steps", type=int, default=30)
    p.add_argument("--point", nargs="*", default=[], help="LAYOUT:BUDGET[:R|-][:heal], after the grid")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument(
        "--skip-before-heal",
        action="store_true",
        help="healed rows: no training-free score (see the free rows)",
    )
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
        skip_before_heal=args.skip_before_heal,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
