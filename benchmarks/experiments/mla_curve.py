"""The MLA quality curve: KV-cache fraction vs training-free perplexity for the options of conversion.mla.

    python -m benchmarks.experiments.mla_curve [--model SRC] [--output-dir results/mla_curve]
        [--grid default|quick]
        [--max-tokens 8192] [--context-length 1024] [--calibration-tokens 8192] [--fresh]

Protocol: the source is converted once per grid point (one calibration pass shared by all points: the
source model over `--calibration-tokens` tokens of the five Austen novels other than *Persuasion*, windows of
1024); each converted checkpoint is written by the converter itself (`conversion.mla.write_conversion`,
the same code as `python -m conversion.mla`), loaded with `AutoModelForCausalLM` in fp32 (sdpa) and scored
with `hf_attn.tooling.perplexity.evaluate_perplexity` on the first `--max-tokens` tokens of *Persuasion*
(disjoint windows of `--context-length`, no special tokens). The source itself is row 0.

Grid sections:
- `rope`: partial RoPE alone (full-rank latent, so only the removed rotations cost), r pairs x selection.
- `budget`: at each KV budget, every (selection, factorization) at the budget's default r, and a sweep of r
  for the default selection / factorization (the allocation between RoPE keys and the latent).

Rows are kept by the shared runner (`benchmarks/experiments/runner.py`, `OUTPUT_DIR/rows/`): an interrupted or
extended run measures only the rows it lacks (`--fresh` re-measures all). Writes `curve.json` (protocol +
rows), `curve.md` (the tables) and `curve.png` (KV fraction vs perplexity for every option). Timings are
wall seconds on whatever machine ran it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.experiments.runner import (
    Point,
    Scoring,
    cached_calibration,
    calibration_spec,
    read_record,
    run_grid,
)
from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.io import AttentionGeometry, read_config
from hf_attn.conversion.specs import (
    DEFAULT_FACTORIZATION,
    DEFAULT_ROPE_SELECTION,
    FACTORIZATIONS,
    SELECTIONS,
    MLASpec,
)
from hf_attn.tooling.cli import run_command
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.experiments.mla_curve"

BUDGETS = (0.125, 0.25, 0.3, 0.375, 0.5, 0.75)
COMPARE_BUDGETS = BUDGETS  # every selection x factorization at every budget (the default allocation)
ROPE_SHARES = (0.25, 0.375, 0.5, 0.625, 0.75)  # the allocation sweep: share of the budget for RoPE keys


def point(
    section: str,
    *,
    rope_pairs: int,
    selection: str,
    factorization: str | None = None,
    kv_lora_rank: int | None = None,
    kv_budget: float | None = None,
) -> dict:
    return {
        "section": section,
        "rope_pairs": rope_pairs,
        "selection": selection,
        "factorization": factorization or DEFAULT_FACTORIZATION,
        "kv_lora_rank": kv_lora_rank,
        "kv_budget": kv_budget,
    }


def grid(name: str, geometry: AttentionGeometry) -> list[dict]:
    """The grid points of `name` ("default" or "quick"), without duplicates, in run order."""
    half = geometry.head_dim // 2
    if name == "quick":
        return [
            point("rope", rope_pairs=max(1, half // 4), selection="high"),
            point(
                "budget",
                rope_pairs=mla.default_rope_pairs(geometry, 0.5),
                selection="attention",
                kv_budget=0.5,
            ),
        ]
    if name != "default":
        raise ValueError(f"Unknown --grid {name!r}; choose default or quick.")
    points = [
        point("rope", rope_pairs=r, selection=s)
        for r in (half // 8, half // 4, half * 3 // 8, half // 2)
        for s in SELECTIONS
    ]
    for budget in BUDGETS:  # allocation sweep with the default selection / factorization
        for share in ROPE_SHARES:
            r = mla.default_rope_pairs(geometry, budget, share)
            points.append(point("budget", rope_pairs=r, selection=DEFAULT_ROPE_SELECTION, kv_budget=budget))
    for budget in COMPARE_BUDGETS:  # every option at the default allocation
        for s in SELECTIONS:
            r = mla.default_rope_pairs(geometry, budget, selection=s)
            for f in FACTORIZATIONS:
                points.append(point("budget", rope_pairs=r, selection=s, factorization=f, kv_budget=budget))
    unique = {key(p): p for p in points}
    return list(unique.values())


def key(p: dict) -> str:
    return json.dumps(
        {
            k: p[k]
            for k in ("section", "rope_pairs", "selection", "factorization", "kv_lora_rank", "kv_budget")
        },
        sort_keys=True,
    )


def point_name(p: dict) -> str:
    """The file name of a grid point's row in the row store."""
    name = f"{p['section']}-r{p['rope_pairs']}-{p['selection']}-{p['factorization']}"
    if p["kv_budget"] is not None:
        name += f"-budget{p['kv_budget']:g}"
    if p["kv_lora_rank"] is not None:
        name += f"-rank{p['kv_lora_rank']}"
    return name


def run_curve(
    *,
    model: str | None,
    output_dir: Path,
    grid_name: str = "default",
    max_tokens: int = 8192,
    context_length: int = 1024,
    calibration_tokens: int = 8192,
    fresh: bool = False,
) -> dict:
    """Measure the grid's rows that the row store lacks; write curve.json / .md / .png; return the record."""
    scoring = Scoring.load(model, max_tokens=max_tokens, context_length=context_length)
    src_dir = scoring.model_dir
    geometry = AttentionGeometry.from_config(read_config(src_dir))
    protocol = {**scoring.protocol, "calibration_tokens": calibration_tokens}
    calibration = []  # one pass, made when the first missing row needs it, shared by every point

    def calibrated():
        if not calibration:
            spec = calibration_spec(calibration_tokens)
            calibration.append(
                cached_calibration(
                    None, lambda _: mla.calibrate(src_dir=src_dir, geometry=geometry, calibration=spec)
                )
            )
        return calibration[0]

    def measure(p: Point) -> dict:
        if p.name == "source":
            return {"kv_fraction": 1.0, "cache_numbers": 2 * geometry.kv_dim, **scoring.score(src_dir)}
        return measure_point(p.settings, src_dir, calibrated(), scoring, output_dir)

    points = [Point("source", {"section": "source"})]
    points += [Point(point_name(p), p) for p in grid(grid_name, geometry)]
    record = run_grid(
        output_dir,
        "curve",
        points,
        measure,
        key=lambda p: scoring.row_key(
            calibration_tokens, key(p.settings) if p.name != "source" else "source"
        ),
        table=markdown,
        protocol=protocol,
        fresh=fresh,
        log=lambda r: (
            f"{r['section']} r={r.get('rope_pairs', 'all')} ({100 * r['kv_fraction']:.1f}%): "
            f"ppl {r['perplexity']:.2f}"
        ),
    )
    plot_curve(record, output_dir / "curve.png")
    return record


def measure_point(p: dict, src_dir, calibration, scoring: Scoring, work: Path) -> dict:
    """Convert the source at grid point `p` (a temporary checkpoint under `work`) and score it."""
    plan = mla.plan_conversion(
        src_dir,
        MLASpec(
            kv_lora_rank=p["kv_lora_rank"],
            kv_budget=p["kv_budget"],
            rope_pairs=p["rope_pairs"],
            rope_selection=p["selection"],
            factorization=p["factorization"],
            allocation="uniform",
        ),
        calibration_pass=calibration,
    )
    shape = plan.shape
    return {
        "kv_lora_rank": shape.kv_lora_rank,
        "factorization": plan.factorization,
        "selection": plan.selection,
        "cache_numbers": shape.cache_numbers,
        "kv_fraction": round(shape.kv_fraction, 4),
        **scoring.score_plan(plan, work),
    }


def _ppl(row: dict | None) -> str:
    return "-" if row is None else f"{row['perplexity']:.1f}"


def _bold_best(value: str, row: dict | None, best: float) -> str:
    return f"**{value}**" if row is not None and row["perplexity"] == best else value


def markdown(record: dict) -> str:
    """Tables of a curve record: partial RoPE alone, the allocation sweep, the option comparison, all rows."""
    p = record["protocol"]
    rows = [r for r in record["rows"] if r["section"] != "source"]
    source = next((r for r in record["rows"] if r["section"] == "source"), None)
    geometry = _geometry(p)
    head = (
        f"Model `{Path(p['model']).name}` (weights sha256 {str(p['model_hash'])[:12]}), corpus {p['corpus']} "
        f"(sha256 {p['corpus_sha256'][:12]}), first {p['tokens']} tokens, disjoint windows of "
        f"{p['context_length']}, fp32, training-free; calibration: {p['calibration_tokens']} tokens of the "
        "other five novels (one pass)."
    )
    if source:
        head += f" Source: {source['perplexity']:.2f} at {source['cache_numbers']} numbers/token/layer."
    parts = [head, *_rope_table(rows), *_sweep_table(rows, geometry), *_options_table(rows, geometry)]
    parts += ["**All rows**", _all_rows_table(rows, source)]
    return "\n\n".join(parts) + "\n"


def _rope_table(rows: list[dict]) -> list[str]:
    rope = [r for r in rows if r["section"] == "rope"]
    if not rope:
        return []
    sels = [s for s in SELECTIONS if any(r["selection"] == s for r in rope)]
    table = [
        [
            r_,
            *(
                _ppl(next((r for r in rope if r["rope_pairs"] == r_ and r["selection"] == s), None))
                for s in sels
            ),
        ]
        for r_ in sorted({r["rope_pairs"] for r in rope})
    ]
    title = "**Partial RoPE alone** (latent at full rank, so nothing saved: the cost of removing rotations)"
    return [title, markdown_table(["r pairs kept", *sels], table, align="l" * (len(sels) + 1))]


def _sweep_table(rows: list[dict], geometry: AttentionGeometry) -> list[str]:
    sweep = [
        r
        for r in rows
        if r["section"] == "budget"
        and r["selection"] == DEFAULT_ROPE_SELECTION
        and r["factorization"] == DEFAULT_FACTORIZATION
    ]
    if not sweep:
        return []
    table = []
    for budget in sorted({r["kv_budget"] for r in sweep}):
        here = sorted((r for r in sweep if r["kv_budget"] == budget), key=lambda r: r["rope_pairs"])
        default_r = mla.default_rope_pairs(geometry, budget)
        best = min(r["perplexity"] for r in here)
        cells = []
        for r in here:
            share = 2 * geometry.num_kv_heads * r["rope_pairs"] / r["cache_numbers"]
            star = "*" if r["rope_pairs"] == default_r else ""
            cells.append(f"r={r['rope_pairs']}{star} ({share:.0%}): {_bold_best(_ppl(r), r, best)}")
        numbers = here[0]["cache_numbers"]
        table.append([f"{budget:g} ({numbers / (2 * geometry.kv_dim):.1%})", numbers, "; ".join(cells)])
    title = (
        f"**Allocation sweep** ({DEFAULT_ROPE_SELECTION} selection, {DEFAULT_FACTORIZATION} "
        "factorization): perplexity for r RoPE pairs per KV head, the latent taking the rest of the "
        "budget (RoPE share of the cached numbers in brackets; * = the default r for that budget)"
    )
    header = ["KV budget", "numbers/token/layer", "perplexity at r (RoPE share)"]
    return [title, markdown_table(header, table, align="lll")]


def _options_table(rows: list[dict], geometry: AttentionGeometry) -> list[str]:
    options = _options_at_default_allocation(rows, geometry)
    if not options:
        return []
    budgets = sorted({b for by_budget in options.values() for b in by_budget})
    best = {b: min(o[b]["perplexity"] for o in options.values() if b in o) for b in budgets}
    table = [
        [f"{sel} / {fac}", *(_bold_best(_ppl(by_budget.get(b)), by_budget.get(b), best[b]) for b in budgets)]
        for (sel, fac), by_budget in options.items()
    ]
    header = ["selection / factorization", *(f"{b:g} ({options_fraction(options, b):.1%})" for b in budgets)]
    title = (
        "**Every option across budgets** (selection / factorization; at each budget the default r, the "
        "latent taking the rest; best per budget in bold)"
    )
    return [title, markdown_table(header, table)]


def _all_rows_table(rows: list[dict], source: dict | None) -> str:
    table = []
    if source:
        table.append(
            [
                "source",
                "1.000",
                source["cache_numbers"],
                "all",
                "-",
                "-",
                "-",
                f"{source['perplexity']:.2f}",
                "-",
            ]
        )
    order = {"rope": 1, "budget": 2}

    def by(r: dict) -> tuple:
        return (
            order[r["section"]],
            r.get("kv_budget") or 0,
            r["rope_pairs"],
            r["selection"],
            r["factorization"],
        )

    for r in sorted(rows, key=by):
        budget = f" {r['kv_budget']:g}" if r.get("kv_budget") else ""
        table.append(
            [f"{r['section']}{budget}", f"{r['kv_fraction']:.3f}", r["cache_numbers"], r["rope_pairs"],
             r["kv_lora_rank"], r["selection"], r["factorization"], f"{r['perplexity']:.2f}",
             r.get("convert_seconds", "-")]
        )  # fmt: skip
    header = ["section", "KV fraction", "numbers/token/layer", "r", "d_c", "selection", "factorization"]
    return markdown_table([*header, "perplexity", "convert s"], table, align="l" * 9)


def _options_at_default_allocation(rows: list[dict], geometry: AttentionGeometry) -> dict:
    """{(selection, factorization): {kv_budget: row}} of the budget rows at each budget's default r."""
    out: dict = {}
    for sel in SELECTIONS:
        for fac in FACTORIZATIONS:
            by_budget = {
                r["kv_budget"]: r
                for r in rows
                if r["section"] == "budget"
                and r["selection"] == sel
                and r["factorization"] == fac
                and r["rope_pairs"] == mla.default_rope_pairs(geometry, r["kv_budget"], selection=sel)
            }
            if by_budget:
                out[(sel, fac)] = by_budget
    return out


def options_fraction(options: dict, budget: float) -> float:
    """The KV fraction actually reached at `budget` (rounding to whole numbers per token and layer)."""
    return next(o[budget]["kv_fraction"] for o in options.values() if budget in o)


def plot_curve(record: dict, path: Path) -> None:
    """KV fraction vs perplexity: one line per selection / factorization, the best allocation, the source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = record["protocol"]
    rows = [r for r in record["rows"] if r["section"] == "budget"]
    options = _options_at_default_allocation(rows, _geometry(p))
    colors = dict(zip(SELECTIONS, ("tab:orange", "tab:gray", "tab:blue", "tab:green"), strict=True))
    styles = dict(zip(FACTORIZATIONS, (":", "--", "-"), strict=True))
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120)
    for (sel, fac), by_budget in options.items():
        pts = sorted((r["kv_fraction"], r["perplexity"]) for r in by_budget.values())
        ax.plot(
            *zip(*pts, strict=True),
            styles[fac],
            marker="o",
            ms=3.5,
            color=colors[sel],
            label=f"{sel} / {fac}",
        )
    best: dict[float, dict] = {}
    for r in rows:
        if r["kv_budget"] not in best or r["perplexity"] < best[r["kv_budget"]]["perplexity"]:
            best[r["kv_budget"]] = r
    pts = sorted((r["kv_fraction"], r["perplexity"]) for r in best.values())
    ax.plot(*zip(*pts, strict=True), "k", lw=0.8, marker="*", ms=7, label="best of every row at that budget")
    source = next((r for r in record["rows"] if r["section"] == "source"), None)
    if source:
        ax.axhline(
            source["perplexity"], color="0.3", lw=0.8, ls="-.", label=f"source ({source['perplexity']:.2f})"
        )
    ax.set_yscale("log")
    ax.set_xlabel("KV cache, fraction of the source's bytes per token")
    ax.set_ylabel("perplexity, training-free (lower is better)")
    ax.set_title(f"MLA conversion of {Path(p['model']).name}: the KV / quality curve", fontsize=11)
    ax.text(
        0.01,
        0.01,
        f"{p['corpus']}, first {p['tokens']} tokens, disjoint {p['context_length']}-token windows, fp32; "
        f"calibration {p['calibration_tokens']} tokens of the other novels",
        transform=ax.transAxes,
        fontsize=6.5,
        color="0.4",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _geometry(protocol: dict) -> AttentionGeometry:
    return AttentionGeometry.from_config(read_config(protocol["model"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded SmolLM2)")
    parser.add_argument("--output-dir", default="results/mla_curve")
    parser.add_argument("--grid", default="default", choices=("default", "quick"))
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("--fresh", action="store_true", help="ignore rows of an earlier run")
    parser.add_argument("--report-only", action="store_true", help="rewrite curve.md/.png from curve.json")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    if args.report_only:
        record = read_record(out, "curve")
        (out / "curve.md").write_text(markdown(record))
        plot_curve(record, out / "curve.png")
        return 0
    options = dict(grid_name=args.grid, max_tokens=args.max_tokens, context_length=args.context_length)
    return run_command(
        PROG,
        lambda: run_curve(
            model=args.model,
            output_dir=out,
            calibration_tokens=args.calibration_tokens,
            fresh=args.fresh,
            **options,
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
