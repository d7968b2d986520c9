"""The experiments' one runner: grid -> convert -> score -> row store -> table.

An experiment is a list of `Point`s (a row name and the settings that define it) and a `measure(point)`
that converts and scores one. `run_grid` measures only the points its row store lacks
(`hf_attn.eval.rows.RowStore`, one JSON file per finished row, keyed by the protocol, the point and the
code that converts and scores it), so an interrupted or extended run resumes, and writes `NAME.json`
(protocol + rows) and `NAME.md` (the experiment's table, `hf_attn.tooling.tables.markdown_table`) after
every row. `Scoring` is the protocol every experiment scores with: the first `max_tokens` tokens of
*Persuasion*, disjoint windows of `context_length`, fp32 (`hf_attn.tooling.perplexity`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_attn.conversion.specs import CalibrationSpec
from hf_attn.eval.rows import RowStore, row_key
from hf_attn.eval.study import CONVERSION_CODE, code_hash
from hf_attn.tooling import loading
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.files import scratch_directory, write_json, write_text_atomic
from hf_attn.tooling.loading import resolve_model
from hf_attn.tooling.perplexity import evaluate_perplexity

# the code a row depends on besides the converter (CONVERSION_CODE): editing it re-measures the rows
MEASUREMENT_CODE = ("hf_attn.tooling.loading", "hf_attn.tooling.corpus", "hf_attn.tooling.perplexity")
CALIBRATION_CORPUS = "austen"  # the MLA sweeps calibrate on the five novels other than Persuasion


def calibration_spec(tokens: int, corpus: str = CALIBRATION_CORPUS) -> CalibrationSpec:
    """The calibration of the MLA sweeps (curve, layouts, allocation): `tokens` of `corpus`."""
    return CalibrationSpec(corpus=corpus, tokens=tokens)


@dataclass(frozen=True)
class Point:
    """One grid point: `name` (its row's file name) and `settings` (JSON-able; part of the row's key)."""

    name: str
    settings: dict


@dataclass
class Scoring:
    """The evaluation protocol shared by the experiments. Args:
    model_dir: the source checkpoint. ids: (T,) token ids of the evaluation text's first tokens.
    protocol: what a row's number depends on (model and text hashes, windows, dtype)."""

    model_dir: Path
    ids: torch.Tensor
    context_length: int
    protocol: dict = field(default_factory=dict)

    @classmethod
    def load(cls, model: str | None, *, max_tokens: int = 8192, context_length: int = 1024) -> Scoring:
        src = Path(resolve_model(model))
        corpus = load_corpus()
        ids = tokenize(loading.load_tokenizer(str(src)), corpus)[:max_tokens]
        protocol = {
            "model": str(src),
            "model_hash": loading.model_hash(str(src)),
            "corpus": corpus.name,
            "corpus_sha256": corpus.sha256,
            "tokens": int(ids.numel()),
            "context_length": context_length,
            "stride": context_length,
            "dtype": "float32",
        }
        return cls(src, ids, context_length, protocol)

    def score(self, path: str | Path) -> dict:
        """Perplexity of the checkpoint at `path` (fp32, sdpa) under this protocol."""
        model = loading.load_causal_lm(str(path), attn_implementation="sdpa", dtype=torch.float32)
        res = evaluate_perplexity(model, self.ids, context_length=self.context_length, progress=False)
        return {
            "perplexity": res.perplexity,
            "nll_sum": res.nll_sum,
            "tokens_scored": res.tokens_scored,
            "windows": res.windows,
            "eval_seconds": round(res.seconds, 1),
        }

    def score_plan(self, plan, work: Path, *, then: Callable[[Path, Path], dict] | None = None) -> dict:
        """Write a planned MLA conversion to a scratch checkpoint under `work`, score it (and, with `then`,
        whatever `then(checkpoint, scratch)` adds), delete it. Returns the scores and `convert_seconds`."""
        from hf_attn.conversion import mla

        start = time.perf_counter()
        with scratch_directory("hf-attn-experiment-", dir=work) as scratch:
            path = mla.write_conversion(plan, Path(scratch) / "ckpt", start=start)
            out = {"convert_seconds": round(time.perf_counter() - start, 1), **self.score(path)}
            if then is not None:
                out.update(then(path, Path(scratch)))
        return out

    def row_key(self, *parts) -> str:
        """The key of a conversion row: this protocol, the measuring and converting code, `parts`."""
        return row_key(self.protocol, code_hash(MEASUREMENT_CODE), code_hash(CONVERSION_CODE), *parts)


def cached_calibration(path: Path | None, make: Callable[..., object]):
    """The calibration torch.save'd at `path` (from an earlier run), or `make(scratch_dir)` saved there.
    With `path` None: `make(None)`, not saved (its statistics live in a temporary directory)."""
    if path is not None and path.exists():
        return torch.load(path, weights_only=False)
    start = time.perf_counter()
    calibration = make(None if path is None else path.with_suffix(".statistics"))
    print(f"calibration: {time.perf_counter() - start:.0f} s", flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(calibration, path)
    return calibration


def run_grid(
    directory: Path,
    stem: str,
    points: list[Point],
    measure: Callable[[Point], dict],
    *,
    key: Callable[[Point], str],
    table: Callable[[dict], str],
    protocol: dict,
    fresh: bool = False,
    log: Callable[[dict], str | None] = lambda row: None,
) -> dict:
    """Measure the points the row store lacks, in order; after each row write `STEM.json` and `STEM.md`.
    Args:
    directory: the experiment's results folder (rows in `directory/rows/`).
    key: a point's row key (everything its number depends on). table: record -> markdown.
    log: row -> one line to print (None: nothing).
    """
    directory.mkdir(parents=True, exist_ok=True)
    store = RowStore(directory / "rows", fresh=fresh)
    record = {"protocol": protocol, "rows": []}
    for i, p in enumerate(points):
        k = key(p)
        row = store.get(p.name, k)
        if row is None:
            row = store.put(p.name, k, {**p.settings, **measure(p)})
            line = log(row)
            if line:
                print(f"[{i + 1}/{len(points)}] {line}", flush=True)
        record["rows"].append(row)
        write_json(directory / f"{stem}.json", record)
        write_text_atomic(directory / f"{stem}.md", table(record))
    return record


def read_record(directory: Path, stem: str) -> dict:
    """The record an earlier `run_grid` wrote."""
    return json.loads((directory / f"{stem}.json").read_text())
