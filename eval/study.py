"""The main job: one command runs the whole study on the embedded default and writes a readable report.

    python -m eval.study [--profile default|quick] [--config FILE] [--results DIR] [--only NAME ...] [--fresh]
                         [--discard-checkpoints] [--device auto|cpu|cuda]

For every variant in the config (`eval/study.toml`): convert the source (GQA/MQA pooling, MLA factorization,
exact MHA expansion), evaluate it, heal it for a fixed wall-clock budget and evaluate it again. Every row
reports the measured KV-cache bytes per token, perplexity on *Persuasion* (protocol stated in the report),
greedy decode tokens/s after a long prompt, and conversion / healing wall time.

Re-runs are cheap and safe (docs/study.md): converted and healed checkpoints are cached under
`$HF_ATTN_CACHE/study/` by a hash of their inputs, settings and code (`conversion/`, `hf_attn/`; `--fresh`
rebuilds them); each finished row is kept in `RESULTS/rows/`, so an interrupted study resumes without touching
the checkpoints of finished rows; `--discard-checkpoints` deletes each variant's checkpoints once its rows are
measured; a variant that raises is reported in the table with its error and does not stop the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hf_attn.conversion import mla, pipeline
from hf_attn.conversion.checkpoint.io import AttentionGeometry, read_config
from hf_attn.conversion.specs import CalibrationSpec, MLASpec, RefineSpec
from hf_attn.conversion.training.data import HealSettings
from hf_attn.conversion.training.heal import heal as heal_checkpoint
from hf_attn.conversion.training.recipe import default_state_dir
from hf_attn.eval.bench.decode import bench_decode
from hf_attn.eval.kv_cache import kv_bytes_per_token
from hf_attn.eval.perplexity import PerplexitySettings
from hf_attn.eval.perplexity import run as perplexity
from hf_attn.eval.report import check_results_dir, format_table, write_report
from hf_attn.eval.rows import RowStore
from hf_attn.eval.rows import row_key as _key
from hf_attn.eval.study_config import (
    DEFAULT_CONFIG,
    PROFILES,
    Settings,
    Variant,
    check_settings,
    check_variants,
    load_config,
)
from hf_attn.eval.tasks.accuracy import task_accuracy
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, announce_device, resolve_device
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import check_output, checkpoint_hash

PROG = "hf-attn study"


# The code a checkpoint or a row depends on: editing it invalidates what it built (no `--fresh` needed).
CONVERSION_CODE = ("hf_attn.conversion", "hf_attn")
MEASUREMENT_CODE = (
    "hf_attn.tooling.loading", "hf_attn.tooling.corpus", "hf_attn.tooling.perplexity",
    "hf_attn.eval.perplexity", "hf_attn.eval.kv_cache", "hf_attn.eval.bench.decode",
    "hf_attn.eval.tasks.accuracy", "hf_attn.eval.bench.decoding", "hf_attn.eval.bench.memory",
)  # fmt: skip


def code_hash(modules: tuple[str, ...]) -> str:
    """sha256 of the Python sources of these modules (every file of a package)."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin)
        files = sorted(origin.parent.rglob("*.py")) if spec.submodule_search_locations else [origin]
        for f in files:
            digest.update(f"{name}/{f.relative_to(origin.parent)}\0".encode() + f.read_bytes())
    return digest.hexdigest()[:16]


def _silent(line: str) -> None:
    pass


class Progress:
    """One line per step to `log` (the CLI passes print): which step, how far, elapsed."""

    def __init__(self, total: int, log: Callable[[str], None] = _silent):
        self.total, self.done, self.start, self.log = total, 0, time.perf_counter(), log

    def step(self, what: str, steps: int = 1) -> None:
        self.done += steps
        elapsed = time.perf_counter() - self.start
        self.log(f"[{self.done}/{self.total} | {elapsed / 60:5.1f} min] {what}")


def convert(
    variant: Variant,
    *,
    source: Path,
    dst: Path,
    settings: Settings,
    shared: dict | None = None,
    device: str = DEFAULT_DEVICE,
) -> None:
    """Write the converted checkpoint of `variant` to `dst` through the conversion pipeline
    (`conversion.pipeline.convert`: the closed form, then `refine = true`: the layer-local refinement with the
    profile's `refine_steps` / `refine_tokens`, then `export = "deepseek_v3"`: the export, which is measured).
    A variant without `refine = true` is the closed form only, whatever the converters' defaults. `shared` (a
    dict kept across calls) holds the MLA calibration pass, which does not depend on the ranks: every per-head
    MLA variant of a study reuses it."""
    s, opts = settings, dict(variant.options)
    export, refine = opts.pop("export", None), opts.pop("refine", False)  # refine: checked by check_variants
    spec, calibration = pipeline.specs_from_options(
        variant.kind, opts, calibration=CalibrationSpec(tokens=s.calibration_tokens, device=device)
    )
    stages = RefineSpec(steps=s.refine_steps, tokens=s.refine_tokens, loss_stride=s.refine_loss_stride)
    pipeline.convert(
        spec,
        src=source,
        dst=dst,
        calibration=calibration,
        refine=stages if refine else RefineSpec(0),
        export=export,
        calibration_pass=_shared_calibration(spec, source, calibration, {} if shared is None else shared),
    )


def _shared_calibration(spec, source: Path, calibration, shared: dict):
    """The MLA calibration pass of a per-head MLA spec on `calibration`'s text (kept in `shared` for the next
    variant); None for any other spec (the DeepSeek layout needs statistics of its own: calibrates itself)."""
    if not isinstance(spec, MLASpec) or spec.layout != "per-head":
        return None
    files = calibration.files()
    key = ("mla", str(source), calibration.tokens, calibration.window, json.dumps(files, default=str))
    if key not in shared:
        shared[key] = mla.calibrate(
            src_dir=source,
            geometry=AttentionGeometry.from_config(read_config(source)),
            calibration=calibration,
        )
    return shared[key]


def heal(src: Path, dst: Path, settings: Settings, device: str = DEFAULT_DEVICE) -> dict:
    recipe = HealSettings(
        model=str(src),
        output=str(dst),
        max_minutes=settings.heal_minutes,
        seq_len=settings.heal_seq_len,
        batch_size=settings.heal_batch_size,
        lr=settings.heal_lr,
        trainable=settings.heal_trainable,
        train_corpus=settings.heal_corpus,
        eval_tokens=0,  # the study measures every checkpoint itself, with one protocol
        device=device,
    )
    return heal_checkpoint(recipe, progress=False)


def measure(path: Path, settings: Settings, device: str = DEFAULT_DEVICE, *, decode: bool = True) -> dict:
    """Perplexity (with measured KV bytes per token), task accuracy and, with `decode`, decode speed of one
    checkpoint."""
    s = settings
    base = PerplexitySettings(
        model=str(path),
        context_length=s.context_length,
        max_tokens=s.eval_tokens,
        progress=False,
        device=device,
    )
    ppl, second = perplexity(base), {}
    if s.second_corpus_tokens:  # the cross-domain column: the Python FAQ, the same windows
        faq = [str(assets.python_docs_eval_file())]
        second = perplexity(dataclasses.replace(base, texts=faq, max_tokens=s.second_corpus_tokens))
    model, tokenizer = loading.load_causal_lm(path), loading.load_tokenizer(path)  # fp32
    accuracy = task_accuracy(model, tokenizer, tasks=("persuasion_lastword",), limit=s.task_items)
    del model  # (decode speed loads its own)
    speed = {}
    if decode:
        speed = bench_decode(path, prompt_tokens=s.decode_prompt_tokens, new_tokens=s.decode_new_tokens)
    # KV bytes measured from a real cache, except for deepseek_v3 exports: transformers' DeepseekV3 caches
    # expanded per-head K/V, so their row states what an MLA engine (vLLM, SGLang) caches, from the config.
    kv = ppl["kv_bytes_per_token" if ppl["model_type"] == "deepseek_v3" else "kv_bytes_per_token_measured"]
    return {
        **{key: ppl[key] for key in ("perplexity", "tokens_scored", "corpus_sha256", "model_type")},
        "kv_bytes_per_token": kv["total"],
        "kv_bytes_per_token_config": (ppl["kv_bytes_per_token"] or {}).get("total"),
        "kv_numbers_per_token_per_layer": kv["numbers_per_token_per_layer"],
        "decode_tokens_per_second": speed.get("decode_tokens_per_second"),
        "lastword_acc": accuracy["lastword_acc"],
        "task_items": accuracy["items"],
        "eval_seconds": ppl["seconds"],
        **({"perplexity_python_faq": second["perplexity"]} if second else {}),
    }


@dataclasses.dataclass
class Study:
    """Runs the variants in order; see the module docstring for what is cached and resumed.

    `keep_checkpoints=False` deletes a variant's converted and healed checkpoints once its rows are measured
    (about 0.5 GB each for SmolLM2 in fp32), so the study's disk use stays near two checkpoints. `log`
    receives the progress lines and the errors of failed variants (the CLI prints them)."""

    settings: Settings
    variants: list[Variant]
    results: Path
    _: dataclasses.KW_ONLY
    fresh: bool = False
    store: Path | None = None
    keep_checkpoints: bool = True
    log: Callable[[str], None] = _silent
    device: str = DEFAULT_DEVICE  # --device of every stage: conversion, healing, perplexity

    def __post_init__(self):
        self.results = Path(self.results)
        self.rows = RowStore(self.results / "rows", fresh=self.fresh)
        self.store = Path(self.store) if self.store is not None else assets.cache_dir() / "study"
        self.source = assets.smollm2_dir()
        self.source_hash = checkpoint_hash(self.source)
        self.code = {"conversion": code_hash(CONVERSION_CODE), "measurement": code_hash(MEASUREMENT_CODE)}
        self.counts = {"converted": 0, "healed": 0, "reused": 0}
        self.shared: dict = {}  # calibration passes shared by conversions (see `convert`)

    def _checkpoint(self, name: str, key: str, build, kind: str) -> tuple[Path, float, bool]:
        """Return (path, seconds it took to build, whether it was cached) of a cached checkpoint; counted as
        reused, or as `kind` ("converted", "healed") when built."""
        path = self.store / f"{name}-{key}"
        meta = path / "hf_attn_study.json"
        if path.exists() and meta.exists() and not self.fresh:
            self.counts["reused"] += 1
            return path, json.loads(meta.read_text())["seconds"], True
        if path.exists():  # left by an interrupted run (no metadata): ours to replace
            shutil.rmtree(path)
        start = time.perf_counter()
        build(path)
        seconds = time.perf_counter() - start
        meta.write_text(json.dumps({"seconds": seconds}))
        self.counts[kind] += 1
        return path, seconds, False

    def run(self) -> list[dict]:
        progress = Progress(sum(2 + 2 * v.heal for v in self.variants), self.log)
        rows = [row for v in self.variants for row in self._run_variant(v, progress)]
        source_kv = next(
            (r["kv_bytes_per_token"] for r in rows if r["kind"] == "source" and "error" not in r), None
        )
        if source_kv is None:  # no source row (`--only`): the source's cache from its config, in fp32
            source_kv = kv_bytes_per_token(loading.load_config(self.source)).total
        for r in rows:
            if r.get("kv_bytes_per_token") is not None:
                r["kv_fraction"] = r["kv_bytes_per_token"] / source_kv
        return rows

    def _run_variant(self, v: Variant, progress: Progress) -> list[dict]:
        """The variant's row and, if it heals, its healed row. A finished row is resumed without touching
        any checkpoint; a checkpoint is built (or taken from the store) only when a row needs measuring."""
        s = self.settings
        conv_key = _key(
            self.source_hash,
            self.code["conversion"],
            v.kind,
            v.options,
            s.calibration_tokens if v.kind != "source" else 0,
            (s.refine_steps, s.refine_tokens, s.refine_loss_stride) if v.options.get("refine") else None,
        )
        heal_key = _key(
            conv_key, s.heal_minutes, s.heal_seq_len, s.heal_batch_size, s.heal_lr, s.heal_trainable,
            s.heal_corpus,
        )  # fmt: skip
        built: dict[str, tuple[Path, float, bool]] = {}  # this run's checkpoints: (path, seconds, cached)

        def converted() -> tuple[Path, float, bool]:
            if v.kind == "source":
                return self.source, 0.0, True
            if "converted" not in built:
                build = lambda dst: convert(  # noqa: E731
                    v, source=self.source, dst=dst, settings=s, shared=self.shared, device=self.device
                )
                built["converted"] = self._checkpoint(v.name, conv_key, build, "converted")
            return built["converted"]

        def healed() -> tuple[Path, float, bool]:
            build = lambda dst: heal(converted()[0], dst, s, self.device)  # noqa: E731
            built["healed"] = self._checkpoint(f"{v.name}-healed", heal_key, build, "healed")
            return built["healed"]

        rows, first_step = [], progress.done
        try:
            before_key = _key(conv_key, self.code["measurement"], s.key(), "before")
            label = "convert" if v.kind != "source" else "source checkpoint"
            rows.append(self._row(v, before_key, converted, label, progress, healed=False))
        except Exception as err:  # a failing variant is reported, never fatal
            rows.append(self._failed(v, err, healed=False))
            if v.heal:
                rows.append(self._failed(v, "not healed: conversion or evaluation failed", healed=True))
        else:
            if v.heal:
                try:
                    after_key = _key(heal_key, self.code["measurement"], s.key(), "after")
                    label = f"heal for {s.heal_minutes} min"
                    after = self._row(v, after_key, healed, label, progress, healed=True, decode_from=rows[0])
                    after.setdefault("convert_seconds", rows[0].get("convert_seconds"))
                    rows.append(after)
                except Exception as err:
                    rows.append(self._failed(v, err, healed=True))
        progress.done = first_step + 2 + 2 * v.heal  # the steps a failure skipped
        if not self.keep_checkpoints:
            for path, _, _ in built.values():
                for tree in (path, default_state_dir(path)):  # the healing log lives beside its checkpoint
                    if tree.exists():
                        shutil.rmtree(tree)
        return rows

    def _row(
        self, v: Variant, key: str, checkpoint, label: str, progress: Progress, *, healed: bool,
        decode_from: dict | None = None,
    ):  # fmt: skip
        """One row: resumed from an earlier run with the same key, or measured on the checkpoint that
        `checkpoint()` returns as (path, seconds it took to build, whether it was cached). A healed row takes
        the decode speed of `decode_from`, its unhealed row: healing changes the weights' values, not the
        shapes, dtype or code that decoding runs, so it is not measured twice."""
        name = v.name + ("+healed" if healed else "")
        row = self.rows.get(name, key)
        if row is not None:
            progress.step(f"{v.name}: {label}, evaluate (resumed)", steps=2)
            return {**row, "resumed": True}
        progress.step(f"{v.name}: {label}")
        ckpt, build_seconds, cached = checkpoint()
        progress.step(f"{v.name}: evaluate" + (" healed" if healed else ""))
        row = {
            **measure(ckpt, self.settings, self.device, decode=decode_from is None),
            **self._describe(v, healed=healed, checkpoint=str(ckpt), cached=cached),
            ("heal_seconds" if healed else "convert_seconds"): build_seconds,
        }
        if decode_from is not None:
            row["decode_tokens_per_second"] = decode_from.get("decode_tokens_per_second")
            row["decode_measured_on"] = decode_from["name"]
        return self.rows.put(name, key, row)

    @staticmethod
    def _describe(v: Variant, *, healed: bool, **extra) -> dict:
        """The fields every row of `v` carries, measured or failed."""
        return {
            "name": v.name + ("+healed" if healed else ""),
            "variant": v.name,
            "label": v.label,
            "kind": v.kind,
            "options": v.options,
            "healed": healed,
            **extra,
        }

    def _failed(self, v: Variant, err, *, healed: bool) -> dict:
        if isinstance(err, BaseException):
            self.log("".join(traceback.format_exception(err)).rstrip())
            err = f"{type(err).__name__}: {err}"
        self.log(f"  {v.name}{'+healed' if healed else ''} FAILED: {err}")
        return self._describe(v, healed=healed, error=str(err).splitlines()[0][:300])


def run_study(
    *,
    profile: str = "default",
    config: str | Path = DEFAULT_CONFIG,
    results: str | Path = "results",
    only: list[str] | None = None,
    fresh: bool = False,
    overrides: dict | None = None,
    store: str | Path | None = None,
    keep_checkpoints: bool = True,
    log: Callable[[str], None] = _silent,
    device: str = DEFAULT_DEVICE,
) -> dict:
    """Run the study; write `results.json`, `report.md` and `pareto.png` into `results`; return the record.
    `log` receives one line per step (and the errors of failed variants); `device` is every stage's
    `--device` (auto: CUDA where torch sees it, else the CPU; the record says which)."""
    settings, variants = load_config(config, profile)
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
        check_settings(settings, "the overrides")
    check_output(None, results, overwrite=False, flag="--results", kind="directory")
    where = resolve_device(device)  # --device cuda without CUDA: one line, before any work
    if only:
        unknown = set(only) - {v.name for v in variants}
        if unknown:
            raise UserError(
                f"--only {sorted(unknown)}: no such variants; choose from {[v.name for v in variants]}"
            )
        variants = [v for v in variants if v.name in only]
    check_results_dir(Path(results), [v.name for v in variants])  # replaces only its own files there
    check_variants(variants, settings, assets.smollm2_dir(), str(config))  # all of them, before the first
    start = time.perf_counter()
    study = Study(
        settings,
        variants,
        Path(results),
        fresh=fresh,
        store=store,
        keep_checkpoints=keep_checkpoints,
        log=log,
        device=device,
    )
    announce_device(where)  # the command's one line saying where it computes
    rows = study.run()
    record = {
        "profile": profile,
        "settings": dataclasses.asdict(settings),
        "protocol": settings.protocol,
        "source": str(study.source),
        "source_hash": study.source_hash,
        "code_hashes": study.code,
        "rows": rows,
        "counts": study.counts,
        "device": where.type,
        "wall_seconds": time.perf_counter() - start,
        "date": time.strftime("%Y-%m-%d"),
        "versions": loading.library_versions(),
    }
    write_report(record, Path(results))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="default")
    parser.add_argument(
        "--quick", action="store_const", const="quick", dest="profile", help="= --profile quick"
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="study TOML (default: eval/study.toml)")
    parser.add_argument("--results", default="results", help="output directory (default: ./results)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these variants (default: all)")
    parser.add_argument("--fresh", action="store_true", help="rebuild cached checkpoints and rows")
    parser.add_argument(
        "--discard-checkpoints",
        action="store_true",
        help="delete each variant's checkpoints once its rows are measured (the default study keeps "
        "about 6 GB of them under $HF_ATTN_CACHE/study/)",
    )
    parser.add_argument("--device", choices=DEVICES, default=DEFAULT_DEVICE, help=DEVICE_HELP)
    args = parser.parse_args(argv)

    def study() -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress line per study step instead of a bar per model load
        record = run_study(
            profile=args.profile,
            config=args.config,
            results=args.results,
            only=args.only,
            fresh=args.fresh,
            keep_checkpoints=not args.discard_checkpoints,
            log=lambda line: print(line, flush=True),
            device=args.device,
        )
        print(f"\n{format_table(record)}")
        print(
            f"\nwrote {Path(args.results) / 'report.md'}, results.json, pareto.png "
            f"({record['wall_seconds'] / 60:.1f} min)"
        )

    return run_command(PROG, study)


if __name__ == "__main__":
    raise SystemExit(main())
