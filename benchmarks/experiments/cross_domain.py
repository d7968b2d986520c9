"""Do calibrated conversions overfit the calibration text's genre?
(`python -m benchmarks.experiments.cross_domain`)

The matrix: every calibration corpus (`austen`: five novels; `python-docs`: five sections of the Python 3.11
docs; `mix`: equal token shares of both) x every conversion of the embedded SmolLM2 (MQA calibrated with 8,192
calibration tokens; MLA at KV budgets 0.5, 0.3, 0.25 and 0.125 with their default calibration), each then
refined against the source on the same corpus (`--refine-steps`, default `hf-attn refine`'s 32; 0: the closed
form), is scored, with the original model, on both embedded evaluation texts (*Persuasion*, the Python FAQ)
under the project protocol (first 8,192 tokens, disjoint 1,024-token windows, fp32). Per evaluation text it
reports the ratio converted / original perplexity, and the check: on the Python FAQ every row's ratio is at
most `TOLERANCE` x its ratio on *Persuasion*. To tell a genre fit from a genre's own sensitivity, it also
reports the check's quotient with each text scored by the conversion calibrated on that text's genre
(`in_genre`), and what the default corpus costs against that on each text.

Rows are measured by the shared runner (`benchmarks/experiments/runner.py`, `RESULTS/rows/`): an interrupted
run resumes; each converted checkpoint is deleted once scored. The summary goes to `RESULTS/cross_domain.md`
and `.json`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.experiments.runner import Point, run_grid
from hf_attn.eval.report import TOLERANCE, check_row
from hf_attn.eval.rows import row_key
from hf_attn.tooling import assets
from hf_attn.tooling.cli import error, run_command
from hf_attn.tooling.files import scratch_directory, sha256_file, write_json, write_text_atomic
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.experiments.cross_domain"
EVAL_TEXTS = ("persuasion", "python-faq")
CORPORA = ("austen", "python-docs", "mix")
IN_GENRE = {"persuasion": "austen", "python-faq": "python-docs"}  # each evaluation text's own genre


@dataclass(frozen=True)
class Refinement:
    """`hf-attn refine` after each conversion, on the conversion's corpus (steps 0: none)."""

    steps: int = 32
    tokens: int = 4096

    def flags(self) -> str:
        return f" --refine-steps {self.steps} --refine-tokens {self.tokens}" if self.steps else ""


@dataclass(frozen=True)
class Conversion:
    name: str
    kind: str  # "gqa" | "mla"
    options: dict
    command: str  # the equivalent command line, for the report

    def convert(self, dst: Path, files: list[Path], *, refine: Refinement) -> Path:
        """The conversion calibrated on `files` at `dst`, refined there when refine.steps > 0 (the conversion
        pipeline: the closed form in a scratch directory, one checkpoint on disk once refined)."""
        from hf_attn.conversion import pipeline
        from hf_attn.conversion.specs import CalibrationSpec, RefineSpec

        calibration = CalibrationSpec(text=[str(f) for f in files])
        spec, calibration = pipeline.specs_from_options(self.kind, self.options, calibration=calibration)
        stages = RefineSpec(steps=refine.steps, tokens=refine.tokens)
        return pipeline.convert(spec, src=None, dst=dst, calibration=calibration, refine=stages).path


CONVERSIONS = (
    Conversion(
        "mqa-calibrated",
        "gqa",
        {"num_kv_heads": 1, "method": "calibrated", "calibration_tokens": 8192},
        "hf-attn convert gqa --num-kv-heads 1 --method calibrated --calibration-tokens 8192",
    ),
    Conversion("mla-0.5", "mla", {"kv_budget": 0.5}, "hf-attn convert mla --kv-budget 0.5"),
    Conversion("mla-0.3", "mla", {"kv_budget": 0.3}, "hf-attn convert mla --kv-budget 0.3"),
    Conversion("mla-0.25", "mla", {"kv_budget": 0.25}, "hf-attn convert mla --kv-budget 0.25"),
    Conversion("mla-0.125", "mla", {"kv_budget": 0.125}, "hf-attn convert mla --kv-budget 0.125"),
)


def eval_files() -> dict[str, Path]:
    return {"persuasion": assets.eval_text_files()[0], "python-faq": assets.python_docs_eval_file()}


def perplexity(model: Path | None, text: Path, *, max_tokens: int, context: int) -> float:
    from hf_attn.eval.perplexity import PerplexitySettings, run

    settings = PerplexitySettings(
        model=None if model is None else str(model),
        texts=[str(text)],
        context_length=context,
        stride=context,
        max_tokens=max_tokens,
        load_dtype="float32",
        progress=False,
    )
    return float(run(settings)["perplexity"])


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def best_corpus(rows: list[dict]) -> dict:
    """The rule for the default calibration text: per corpus, the geometric mean of every ratio (all
    conversions x both evaluation texts); the lowest wins."""
    scores = {
        c: geomean(r["ratio"][t] for r in rows if r["corpus"] == c for t in EVAL_TEXTS)
        for c in sorted({r["corpus"] for r in rows})
    }
    return {"scores": scores, "best": min(scores, key=scores.get)}


def in_genre(rows: list[dict], default: str) -> list[dict]:
    """What the check would read if calibration knew each text's genre, per conversion with rows for both
    genres: the FAQ ratio of the `python-docs` row over the *Persuasion* ratio of the `austen` row (`bound`),
    and the `default` corpus's perplexity over the in-genre one on each text (`cost`: what not knowing the
    genre costs). A `bound` above TOLERANCE fails the check without any genre overfitting."""
    out = []
    for name in dict.fromkeys(r["conversion"] for r in rows):
        by = {r["corpus"]: r for r in rows if r["conversion"] == name}
        if not set(IN_GENRE.values()) <= set(by):
            continue
        own = {t: by[IN_GENRE[t]] for t in EVAL_TEXTS}  # text -> the row calibrated on its genre
        entry = {
            "conversion": name,
            "ratio": {t: own[t]["ratio"][t] for t in EVAL_TEXTS},
            "bound": own["python-faq"]["ratio"]["python-faq"] / own["persuasion"]["ratio"]["persuasion"],
        }
        if default in by:
            entry["cost"] = {t: by[default]["ppl"][t] / own[t]["ppl"][t] for t in EVAL_TEXTS}
        out.append(entry)
    return out


def run_matrix(
    results: Path,
    *,
    conversions=CONVERSIONS,
    corpora=CORPORA,
    refine: Refinement = Refinement(),
    max_tokens: int = 8192,
    context: int = 1024,
    fresh: bool = False,
) -> dict:
    if refine.steps < 0 or refine.tokens < 1:
        raise ValueError(
            f"--refine-steps must be >= 0 and --refine-tokens positive, got {refine.steps} and "
            f"{refine.tokens}"
        )
    texts = eval_files()
    text_sums = {t: sha256_file(p) for t, p in texts.items()}
    protocol = {"max_tokens": max_tokens, "context": context, "stride": context, "dtype": "float32"}
    source_hash = sha256_file(assets.smollm2_dir() / "model.safetensors")
    refined = [asdict(refine)] if refine.steps else []  # closed-form rows keep their earlier keys
    jobs = {}  # row name -> (conversion, corpus, calibration files)
    for conversion in conversions:
        for corpus in corpora:
            name = f"{conversion.name}.{corpus}" + (f".refined{refine.steps}" if refine.steps else "")
            jobs[name] = (conversion, corpus, assets.calibration_corpus_files(corpus))

    def key(p: Point) -> str:
        if p.name == "original":
            return row_key("original", source_hash, text_sums, protocol)
        conversion, _, files = jobs[p.name]
        sums = [sha256_file(f) for f in files]
        return row_key(p.name, conversion.options, sums, source_hash, text_sums, protocol, *refined)

    def score(model: Path | None) -> dict:
        return {t: perplexity(model, p, max_tokens=max_tokens, context=context) for t, p in texts.items()}

    def measure(p: Point) -> dict:
        if p.name == "original":
            return {"ppl": score(None)}
        conversion, _, files = jobs[p.name]
        with scratch_directory("hf-attn-cross-domain-") as tmp:  # deleted once scored
            return {"ppl": score(conversion.convert(Path(tmp) / "model", files, refine=refine))}

    points = [Point("original", {}), *(Point(name, {}) for name in jobs)]
    measured = run_grid(Path(results), "measured", points, measure, key=key, table=lambda record: "",
                        protocol=protocol, fresh=fresh, log=lambda r: f"{r['name']}: {r['ppl']}")  # fmt: skip
    original, *converted = measured["rows"]
    rows = []
    for (conversion, corpus, _), row in zip(jobs.values(), converted, strict=True):
        ppl = row["ppl"]
        ratio = {t: ppl[t] / original["ppl"][t] for t in EVAL_TEXTS}
        row = {
            "conversion": conversion.name,
            "command": f"{conversion.command} --calibration-corpus {corpus}{refine.flags()}",
            "corpus": corpus,
            "ppl": ppl,
            "ratio": ratio,
        }
        row["check"] = check_row(row)
        rows.append(row)
    summary = {
        "protocol": protocol,
        "refine": asdict(refine),
        "eval_texts": {t: {"file": p.name, "sha256": text_sums[t]} for t, p in texts.items()},
        "original": original["ppl"],
        "rows": rows,
        "all_pass": all(r["check"] for r in rows),
        "default_rule": best_corpus(rows),
    }
    summary["in_genre"] = in_genre(rows, summary["default_rule"]["best"])
    write_json(Path(results) / "cross_domain.json", summary)
    write_text_atomic(Path(results) / "cross_domain.md", markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    o = summary["original"]
    header = ["conversion", "calibration", "PPL Persuasion", "ratio", "PPL Python FAQ", "ratio"]
    header.append(f"FAQ ratio / Persuasion ratio (<= {TOLERANCE})")
    rows = [["original", "-", f"{o['persuasion']:.3f}", "1", f"{o['python-faq']:.3f}", "1", "-"]]
    for r in summary["rows"]:
        p, q = r["ratio"]["persuasion"], r["ratio"]["python-faq"]
        rows.append(
            [r["conversion"], r["corpus"], f"{r['ppl']['persuasion']:.3f}", f"{p:.3f}",
             f"{r['ppl']['python-faq']:.3f}", f"{q:.3f}", f"{q / p:.3f} {'pass' if r['check'] else 'FAIL'}"]
        )  # fmt: skip
    rule = summary["default_rule"]
    scores = ", ".join(f"{c} {s:.4f}" for c, s in rule["scores"].items())
    parts = [
        markdown_table(header, rows, align="llrrrrl"),
        f"Geometric mean of all ratios per calibration corpus: {scores}; best: {rule['best']}.",
    ]
    if summary.get("in_genre"):
        parts += _in_genre_table(summary["in_genre"], rule["best"])
    return "\n\n".join(parts) + "\n"


def _in_genre_table(entries: list[dict], best: str) -> list[str]:
    header = ["conversion", "Persuasion ratio", "FAQ ratio", "FAQ ratio / Persuasion ratio"]
    header += [f"{best} / in-genre, Persuasion", f"{best} / in-genre, FAQ"]
    rows = []
    for g in entries:
        cost = g.get("cost")
        tail = ["-", "-"] if cost is None else [f"{cost['persuasion']:.3f}", f"{cost['python-faq']:.3f}"]
        rows.append(
            [g["conversion"], f"{g['ratio']['persuasion']:.3f}", f"{g['ratio']['python-faq']:.3f}",
             f"{g['bound']:.3f}", *tail]
        )  # fmt: skip
    title = (
        "Each text scored by the conversion calibrated on its own genre (Persuasion: austen, FAQ: "
        f"python-docs), and what {best} calibration costs against that:"
    )
    return [title, markdown_table(header, rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True, help="results directory (rows, cross_domain.md/json)")
    parser.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA))
    parser.add_argument(
        "--conversions",
        nargs="+",
        choices=[c.name for c in CONVERSIONS],
        default=[c.name for c in CONVERSIONS],
    )
    parser.add_argument(
        "--refine-steps",
        type=int,
        default=Refinement.steps,
        help=f"hf-attn refine steps after each conversion (default {Refinement.steps}; 0: the closed form)",
    )
    parser.add_argument(
        "--refine-tokens", type=int, default=Refinement.tokens, help="calibration tokens of the refinement"
    )
    parser.add_argument("--max-tokens", type=int, default=8192, help="first N tokens of each evaluation text")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--fresh", action="store_true", help="re-measure every row")
    args = parser.parse_args(argv)
    if args.refine_steps < 0 or args.refine_tokens < 1:  # before any work
        return error(
            PROG,
            ValueError(
                f"--refine-steps must be >= 0 and --refine-tokens positive, got {args.refine_steps} and "
                f"{args.refine_tokens}"
            ),
        )

    def go() -> None:
        summary = run_matrix(
            Path(args.results),
            conversions=[c for c in CONVERSIONS if c.name in args.conversions],
            corpora=args.corpora,
            refine=Refinement(args.refine_steps, args.refine_tokens),
            max_tokens=args.max_tokens,
            context=args.context_length,
            fresh=args.fresh,
        )
        print(markdown(summary), end="")

    return run_command(PROG, go)


if __name__ == "__main__":
    raise SystemExit(main())
