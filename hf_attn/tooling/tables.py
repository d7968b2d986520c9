"""The one markdown table renderer (the study's report, the results tables, the benchmarks, the experiments).

markdown_table(["model", "perplexity"], [["source", "32.91"], ["mqa", "47.60"]], align="lr")
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

MISSING = "–"


def cell(value, spec: str = "") -> str:
    """`value` formatted with `spec`; None and NaN as MISSING, text that does not take `spec` as str()."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A GitHub markdown table. Args:
    header: the column titles.
    rows: one sequence of cells per row (strings, or values shown with str()), as long as `header`.
    align: one letter per column, "l" or "r" (default: the first column left, the others right).
    """
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(header)} columns")
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    for row in rows:
        row = [str(c) for c in row]
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
