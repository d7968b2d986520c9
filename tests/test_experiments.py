"""The experiments (`benchmarks/experiments/`, not installed): the shared runner's resume and tables, the MLA
curve's grid and report, the one markdown table renderer."""

from __future__ import annotations

import json

import pytest

from benchmarks.experiments.runner import Point, run_grid
from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.tooling.tables import markdown_table

SMOL = AttentionGeometry(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)


def test_markdown_table_layout_and_errors():
    text = markdown_table(["a", "b"], [["x", 1.5], ["y", None]], align="lr")
    assert text.splitlines() == ["| a | b |", "|---|---:|", "| x | 1.5 |", "| y | None |"]
    with pytest.raises(ValueError, match="2 cells under 3 columns"):
        markdown_table(["a", "b", "c"], [["x", "y"]])


def test_run_grid_measures_only_missing_rows_and_writes_the_table(tmp_path):
    """A second run with one more point measures that point only; a changed key re-measures its row."""
    calls = []

    def measure(p: Point) -> dict:
        calls.append(p.name)
        return {"value": 10 * p.settings["x"]}

    def table(record: dict) -> str:
        return markdown_table(["name", "value"], [[r["name"], r["value"]] for r in record["rows"]])

    def run(points, salt=""):
        return run_grid(
            tmp_path, "t", points, measure, key=lambda p: f"{p.settings}{salt}", table=table, protocol={}
        )

    a, b = Point("a", {"x": 1}), Point("b", {"x": 2})
    run([a])
    record = run([a, b])
    assert calls == ["a", "b"] and [r["value"] for r in record["rows"]] == [10, 20]
    assert json.loads((tmp_path / "t.json").read_text())["rows"][1]["value"] == 20
    assert "| b | 20 |" in (tmp_path / "t.md").read_text()
    run([a], salt="changed")
    assert calls == ["a", "b", "a"]


def test_curve_grid_points_are_valid_and_within_budget():
    from benchmarks.experiments.mla_curve import grid, key

    points = grid("default", SMOL)
    assert len({key(p) for p in points}) == len(points)
    for p in points:
        shape = mla.plan_shape(
            SMOL, kv_lora_rank=p["kv_lora_rank"], kv_budget=p["kv_budget"], rope_pairs=p["rope_pairs"]
        )
        if p["kv_budget"] is None:
            assert shape.is_full_rank  # the partial-RoPE section keeps the whole latent
        else:
            assert shape.kv_fraction <= p["kv_budget"] and shape.kv_lora_rank >= 1


def test_curve_report_tables_and_plot(tmp_path, smollm2_path):
    """The options table reads each budget's default-r rows only, bolds the best, and the plot is written."""
    from benchmarks.experiments.mla_curve import markdown, plot_curve

    def row(budget, r, sel, fac, ppl):
        shape = mla.plan_shape(SMOL, kv_budget=budget, rope_pairs=r)
        return {
            "section": "budget",
            "kv_budget": budget,
            "rope_pairs": r,
            "kv_lora_rank": shape.kv_lora_rank,
            "selection": sel,
            "factorization": fac,
            "cache_numbers": shape.cache_numbers,
            "kv_fraction": shape.kv_fraction,
            "perplexity": ppl,
        }

    r30, r50 = mla.default_rope_pairs(SMOL, 0.3), mla.default_rope_pairs(SMOL, 0.5)
    r50_high = mla.default_rope_pairs(SMOL, 0.5, selection="high")  # 16: only `attention` is capped (12)
    rows = [
        row(0.3, r30, "attention", "attention", 90.0),
        row(0.3, r30, "high", "activation", 180.0),
        row(0.3, r30 - 2, "high", "activation", 1.0),  # not the default r: an allocation-sweep row
        row(0.5, r50, "attention", "attention", 52.0),
        row(0.5, r50_high, "high", "activation", 65.0),
        row(0.5, r50, "high", "activation", 2.0),  # `attention`'s default r, not `high`'s
    ]
    protocol = {
        "model": str(smollm2_path),
        "model_hash": "0" * 64,
        "corpus": "persuasion.txt",
        "corpus_sha256": "0" * 64,
        "tokens": 8192,
        "context_length": 1024,
        "calibration_tokens": 8192,
    }
    record = {
        "protocol": protocol,
        "rows": [{"section": "source", "perplexity": 32.87, "cache_numbers": 384}, *rows],
    }
    text = markdown(record)
    table = text[text.index("**Every option") : text.index("**All rows**")]
    assert "| attention / attention | **90.0** | **52.0** |" in table
    assert "| high / activation | 180.0 | 65.0 |" in table  # the r30 - 2 row (1.0) belongs to the sweep
    plot_curve(record, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_results_tables_match_their_stored_rows():
    """docs/results/*.md and the README summary are what `python -m benchmarks.experiments.results` makes of
    the rows."""
    from benchmarks.experiments import results

    stale = [p for p, text in results.outputs().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `python -m benchmarks.experiments.results`: {stale}"
