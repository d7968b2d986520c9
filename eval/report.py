"""The study's outputs: `results.json` (everything), `report.md` (table + plain-language reading) and
`pareto.png` (KV bytes per token vs perplexity, before/after healing). Each carries the study's mark
(`WRITER`), and `check_results_dir` lets the study replace only files that carry it."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

from hf_attn.conversion.specs import DEFAULT_CORPUS as CALIBRATION_CORPUS
from hf_attn.eval.study_config import Settings
from hf_attn.tooling.assets import CORPUS_TEXTS
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import WRITTEN_BY, read_json, write_json, write_text_atomic
from hf_attn.tooling.tables import cell, markdown_table

WRITER = "hf-attn study"
HEADING = f"# {WRITER} ("  # report.md's first line

COLUMNS = (
    "Variant", "Healed", "KV bytes/token", "KV vs source", "Perplexity", "Last-word acc", "Decode tok/s",
    "Convert s", "Heal s",
)  # fmt: skip


SECOND_CORPUS = ("perplexity_python_faq", "PPL Python FAQ")  # a column only when the study measured it
SECOND_AT = COLUMNS.index("Perplexity") + 1  # ... right after the Persuasion perplexity
TOLERANCE = 1.25  # the cross-domain check: FAQ ratio <= TOLERANCE x Persuasion ratio (`check_row`)


def heal_steps(settings: dict) -> str:
    """What healing trained, on how long a sequence, at what rate: the profile's values, or heal's own."""
    names = {"heal_trainable": "trainable", "heal_seq_len": "seq_len", "heal_lr": "lr"}
    given = [f"{names[k]} {settings[k]}" for k in names if settings.get(k) is not None]
    left = [name for k, name in names.items() if settings.get(k) is None]
    by_checkpoint = [f"{' / '.join(left)}: `hf-attn heal`'s defaults for each checkpoint"] if left else []
    return ", ".join(given + by_checkpoint)


def _cells(row: dict, second: bool) -> list[str]:
    healed = "yes" if row["healed"] else "no"
    if "error" in row:
        return [row["label"], healed, f"FAILED: {row['error']}", *[""] * (len(COLUMNS) + second - 3)]
    cells = [
        row["label"],
        healed,
        cell(row.get("kv_bytes_per_token"), ",.0f"),
        cell(row.get("kv_fraction") and 100 * row["kv_fraction"], ".1f") + "%",
        cell(row.get("perplexity"), ",.2f"),
        cell(row.get("lastword_acc"), ".3f"),
        "same" if row.get("decode_measured_on") else cell(row.get("decode_tokens_per_second"), ".1f"),
        cell(row.get("convert_seconds"), ".0f"),
        cell(row.get("heal_seconds"), ".0f") if row["healed"] else "",
    ]
    if second:
        cells.insert(SECOND_AT, cell(row.get(SECOND_CORPUS[0]), ",.2f"))
    return cells


def format_table(record: dict) -> str:
    second = any(SECOND_CORPUS[0] in r for r in record["rows"])
    titles = [*COLUMNS[:SECOND_AT], SECOND_CORPUS[1], *COLUMNS[SECOND_AT:]] if second else list(COLUMNS)
    rows = [_cells(r, second) for r in record["rows"]]
    return markdown_table(titles, rows, align="ll" + "r" * (len(titles) - 2))


def check_row(row: dict) -> bool:
    """The cross-domain check: perplexity ratio to the source on the Python FAQ <= TOLERANCE x the ratio on
    *Persuasion* (`row["ratio"]` maps "persuasion" and "python-faq" to converted / source perplexity)."""
    return row["ratio"]["python-faq"] <= TOLERANCE * row["ratio"]["persuasion"]


def cross_domain_table(record: dict) -> str | None:
    """The cross-domain check per row: perplexity ratio to the untouched source on each evaluation text,
    and the FAQ ratio over the *Persuasion* ratio against TOLERANCE (None without the FAQ column or the
    source row)."""
    ok = [r for r in record["rows"] if "error" not in r and r.get(SECOND_CORPUS[0])]
    source = next((r for r in ok if r["name"] == "source"), None)
    if source is None:
        return None
    rows = []
    for r in ok:
        if r is source:
            continue
        p, q = r["perplexity"] / source["perplexity"], r[SECOND_CORPUS[0]] / source[SECOND_CORPUS[0]]
        verdict = "pass" if check_row({"ratio": {"persuasion": p, "python-faq": q}}) else "no"
        rows.append(
            [r["label"], "yes" if r["healed"] else "no", f"{p:,.3f}", f"{q:,.3f}", f"{q / p:.3f} {verdict}"]
        )
    ratios = f"FAQ ratio / Persuasion ratio (<= {TOLERANCE})"
    return markdown_table(["Variant", "Healed", "Persuasion ratio", "FAQ ratio", ratios], rows, align="llrrl")


def reading(record: dict) -> list[str]:
    """A few plain-language sentences drawn from the numbers (nothing here is hand-written per run)."""
    ok = [r for r in record["rows"] if "error" not in r]
    by_name = {r["name"]: r for r in ok}
    out = []
    src = by_name.get("source")
    if src:
        out.append(
            f"The source model caches {src['kv_bytes_per_token']:,.0f} bytes per token (fp32, all layers) "
            f"and scores perplexity {src['perplexity']:.2f}."
        )
    mha = by_name.get("mha")
    if src and mha:
        same = abs(mha["perplexity"] - src["perplexity"]) <= 1e-3 * src["perplexity"]
        out.append(
            f"The exact MHA expansion caches {mha['kv_fraction']:.0f}x as much and scores "
            f"{mha['perplexity']:.2f} ({'the same, as it must' if same else 'NOT the same: a bug'})."
        )
    control = by_name.get("source+healed")
    if src and control:
        out.append(
            f"Healing the unconverted model with the same recipe moves it from {src['perplexity']:.2f} to "
            f"{control['perplexity']:.2f}: that much of any healed variant's gain is adaptation to the "
            "healing text, not repair, so compare healed rows with this control."
        )
    for r in ok:
        if r["kind"] in ("gqa", "mla") and not r["healed"]:
            healed = by_name.get(r["name"] + "+healed")
            text = (
                f"{r['label']}: {100 * r['kv_fraction']:.1f}% of the source's KV bytes, perplexity "
                f"{r['perplexity']:,.2f} before healing"
            )
            if healed:
                text += f", {healed['perplexity']:,.2f} after"
                if control:
                    text += f" ({healed['perplexity'] / control['perplexity']:.2f}x the healed control)"
            out.append(text + ".")
    failed = [r["name"] for r in record["rows"] if "error" in r]
    if failed:
        out.append(f"Failed rows (see the table for the error): {', '.join(failed)}.")
    return out


def plot_pareto(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {r["name"]: r for r in record["rows"] if "error" not in r and r.get("perplexity")}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    point = {name: (r["kv_bytes_per_token"] / 1024, r["perplexity"]) for name, r in ok.items()}  # KiB, ppl
    for name, r in ok.items():
        marker, color = ("^", "tab:green") if r["healed"] else ("o", "tab:blue")
        ax.scatter(*point[name], marker=marker, color=color, s=50, zorder=3)
        if not r["healed"] or r["variant"] not in ok:  # a healed point is named by its arrow's tail
            ax.annotate(name, point[name], fontsize=8, xytext=(5, 3), textcoords="offset points")
        if not r["healed"] and name + "+healed" in ok:
            arrow = {"arrowstyle": "->", "color": "0.6"}
            ax.annotate("", xy=point[name + "+healed"], xytext=point[name], arrowprops=arrow)
    ax.scatter([], [], marker="o", color="tab:blue", label="converted (training-free)")
    ax.scatter([], [], marker="^", color="tab:green", label="after healing (arrow from before)")
    if ok:
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        note = "no variant was measured (see the report's table)"
        ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes)
    ax.set_xlabel("KV cache, KiB per token (fp32, all layers, measured)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("SmolLM2-135M: KV cache vs perplexity", fontsize=11)
    protocol = textwrap.fill(record["protocol"], 110)  # under the axes, wrapped to the figure's width
    fig.text(0.01, 0.005, protocol, fontsize=6.5, color="0.4", va="bottom")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.018 * protocol.count("\n"), 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata={"Software": WRITER})  # the mark `check_results_dir` reads
    plt.close(fig)
    write_text_atomic(path, png.getvalue())


def _written_by_study(path: Path) -> bool:
    """Whether the file at `path` (in a results directory) carries the study's mark."""
    if not path.is_file() or path.is_symlink():
        return False
    if path.parent.name == "rows":  # a row of the variant it is named after (`eval.rows.RowStore`)
        row = read_json(path)
        return isinstance(row, dict) and "key" in row and row.get("name") == path.stem
    if path.suffix == ".json":
        return isinstance(record := read_json(path), dict) and record.get(WRITTEN_BY) == WRITER
    with open(path, "rb") as f:
        head = f.read(4096)
    if path.suffix == ".png":
        return head.startswith(b"\x89PNG") and b"Software\0" + WRITER.encode() in head
    return head.startswith(HEADING.encode())


def check_results_dir(results: Path, names: list[str]) -> None:
    """UserError naming the first file in `results` that the study would write (results.json, report.md,
    pareto.png, rows/NAME.json of the variants `names`) and that it did not write."""
    rows = [f"rows/{name}{healed}.json" for name in names for healed in ("", "+healed")]
    for rel in ("results.json", "report.md", "pareto.png", *rows):
        path = results / rel
        if (path.exists() or path.is_symlink()) and not _written_by_study(path):
            raise UserError(
                f"--results {results} holds {rel}, which {WRITER} did not write; it replaces only its own "
                f"files: move {rel} out of {results}, or choose another --results"
            )


def write_report(record: dict, results: Path) -> None:
    """results.json, pareto.png and report.md into `results`, each atomically and with the study's mark."""
    results.mkdir(parents=True, exist_ok=True)
    write_json(results / "results.json", record, prog=WRITER)
    plot_pareto(record, results / "pareto.png")
    s, rows = record["settings"], record["rows"]
    n = sum(bool(r.get("resumed")) for r in rows)
    resumed = f" ({n} of {len(rows)} rows resumed from an earlier run, their time not included)" if n else ""
    refined = any((r.get("options") or {}).get("refine") for r in rows)
    refinement = f"Rows marked refined: {Settings(**s).refinement}; counted in Convert s. " if refined else ""
    table = cross_domain_table(record)
    cross_domain = [
        "## Cross-domain check",
        "",
        "Perplexity over the untouched source's on each evaluation text (*Persuasion*, a novel; the Python "
        "FAQ, technical questions and answers with code; neither is calibration or healing text). A "
        "conversion that held only on one genre would lose more on the other text; the check asks the FAQ "
        f"ratio to be at most {TOLERANCE} times the *Persuasion* ratio.",
        "",
        table,
        "",
    ]
    text = [
        f"{HEADING}{record['profile']} profile, {record['date']})",
        "",
        f"Protocol: {record['protocol']}. Healing: {s['heal_minutes']} min per variant, batch "
        f"{s['heal_batch_size']}, {heal_steps(s)}, on {CORPUS_TEXTS[s.get('heal_corpus', 'austen')]}. "
        "Calibration: "
        f"{s['calibration_tokens']} tokens of the `{CALIBRATION_CORPUS}` corpus "
        f"({CORPUS_TEXTS[CALIBRATION_CORPUS]}; "
        "one pass shared by the MLA variants, counted in the first one's Convert s). "
        f"{refinement}"
        f"KV bytes per token are measured from a real cache (fp32, all 30 layers), except for deepseek_v3 "
        "exports: what an MLA engine (vLLM, SGLang) caches, from the config (transformers' DeepseekV3 caches "
        "expanded per-head K/V). Decode: tokens/s of "
        f"greedy decoding with a real cache, so it is noisy on a shared machine; a healed row runs the "
        'shapes, dtype and code of its unhealed row, so it is measured once ("same"). '
        f"Wall time {record['wall_seconds'] / 60:.1f} min{resumed}.",
        "",
        format_table(record),
        "",
        *(cross_domain if table is not None else []),
        "## Reading",
        "",
        *[f"- {line}" for line in reading(record)],
        "",
        "![KV bytes per token vs perplexity](pareto.png)",
        "",
    ]
    write_text_atomic(results / "report.md", "\n".join(text))
