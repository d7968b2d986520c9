"""`python -m benchmarks.gpu` parts recipe and recipe-deep: the default conversion recipe on CUDA.

recipe: `hf-attn convert mla` (its defaults: --kv-budget 0.5, the calibrated closed form, then the refinement)
and `hf-attn convert gqa --num-kv-heads 1` (defaults otherwise), each with `--device cuda`, on the synthetic
Llama-3-8B-shaped checkpoint of benchmarks/synthetic.py (its exact config, random bf16 weights, the real
vocabulary) cut to `layers` layers. recipe-deep: `convert mla` on 8 layers, a second point for the full-depth
estimate (the full depth, 32 layers and 16 GB, does not fit one 10-minute command on an H200).

Each conversion runs in its own process, `python -m hf_attn.conversion.<x>` through a small wrapper that times
the recipe's stage functions (HOOKS; each call's seconds appended to a log as the call ends, so a conversion
stopped at its limit keeps the stages it finished) and reports its peak host RSS (VmHWM) and peak GPU memory
(torch.cuda.max_memory_allocated) at exit. Rows per converter: one per stage (calls, seconds, seconds per
layer, the full-depth estimate), the process start (wall time outside the stages) and the total; then the
finer `stage_seconds` that the output's conversion records carry, where the converters record them.
Full-depth estimate: a stage that grows with the layers (calibration, factorization, the layer fits, the rest
of the refinement) x L_full / L; a stage that reads or writes the checkpoint x (the checkpoint's bytes at full
depth / at L); the process start as measured; a stage's own time outside the stages inside it by its own rule.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_parts import Adapter

# (stage, the stage it runs inside, module, function, what it grows with at full depth: "layers" or "bytes")
HOOKS = (
    ("closed form", None, "hf_attn.conversion.pipeline", "convert_to_mla", "bytes"),
    ("closed form", None, "hf_attn.conversion.pipeline", "convert_gqa", "bytes"),
    ("calibration", "closed form", "hf_attn.conversion.mla.plan", "calibrate", "layers"),
    ("calibration and fit", "closed form", "hf_attn.conversion.gqa.convert", "_calibrate_layers", "layers"),
    ("closed-form write", "closed form", "hf_attn.conversion.mla.convert", "write_conversion", "bytes"),
    ("closed-form write", "closed form", "hf_attn.conversion.gqa.convert", "save_streamed", "bytes"),
    ("factorization", "closed-form write", "hf_attn.conversion.mla.plan", "convert_layer_on", "layers"),
    ("refinement", None, "hf_attn.conversion.pipeline", "_refine", "layers"),
    ("layer fits", "refinement", "hf_attn.conversion.refine", "fit_layer", "layers"),
    ("refined write", "refinement", "hf_attn.conversion.refine", "save_streamed", "bytes"),
)
CONVERTERS = {
    "mla": ("hf_attn.conversion.cli:mla_main", []),
    "gqa": ("hf_attn.conversion.cli:gqa_main", ["--num-kv-heads", "1"]),
}
STAGE_LOG = "HF_ATTN_STAGE_LOG"
CHILD = f"""
import atexit, functools, importlib, json, os, sys, time
log = open(os.environ[{STAGE_LOG!r}], "a", buffering=1)
def timed(stage, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.write(json.dumps({{"stage": stage, "seconds": time.perf_counter() - start}}) + "\\n")
    return wrapper
for stage, module, name in json.loads(sys.argv[1]):
    owner = importlib.import_module(module)
    original = getattr(owner, name)
    setattr(owner, name, timed(stage, original))
    for table in [v for v in vars(owner).values() if isinstance(v, dict)]:  # dispatch tables holding it
        table.update({{k: getattr(owner, name) for k, v in table.items() if v is original}})
@atexit.register
def peaks():
    import torch
    from hf_attn.eval.bench.memory import status_bytes
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    log.write(json.dumps({{"peak_rss": status_bytes("VmHWM"), "peak_gpu": gpu}}) + "\\n")
module, _, command = sys.argv[2].partition(":")
sys.exit(getattr(importlib.import_module(module), command or "main")(sys.argv[3:]))
"""


def dims_of(settings: dict) -> tuple[dict, int]:
    """(the synthetic checkpoint's dims at `layers`, the shape's full depth), checked."""
    from benchmarks import synthetic

    s = settings
    if s["shape"] not in synthetic.SHAPES:
        raise ValueError(f"recipe.shape: unknown {s['shape']!r}; choose from {sorted(synthetic.SHAPES)}")
    full = synthetic.SHAPES[s["shape"]]["num_hidden_layers"]
    layers = full if s["layers"] is None else s["layers"]
    if not isinstance(layers, int) or not 1 <= layers <= full:
        raise ValueError(
            f"recipe.layers must be an integer in [1, {full}] or null (all), got {s['layers']!r}"
        )
    bad = [c for c in s["converters"] if c not in CONVERTERS]
    if bad or not s["converters"]:
        raise ValueError(
            f"recipe.converters must be a non-empty list of {list(CONVERTERS)}, got {s['converters']}"
        )
    return {**synthetic.SHAPES[s["shape"]], "num_hidden_layers": layers}, full


def checkpoint_bytes(dims: dict) -> int:
    from benchmarks import synthetic

    return 2 * sum(math.prod(size) for _, size in synthetic.tensor_shapes(dims))  # bf16


def converter_argv(converter: str, src: str, dst: str, *, device: str = "cuda") -> list[str]:
    """The wrapped `python -m hf_attn.conversion.<converter>` of the default recipe on `device`."""
    module, args = CONVERTERS[converter]
    hooks = json.dumps([[stage, mod, fn] for stage, _, mod, fn, _ in HOOKS])
    return [
        sys.executable,
        "-c",
        CHILD,
        hooks,
        module,
        "--model",
        src,
        "--output",
        dst,
        *args,
        "--device",
        device,
    ]


def plan(settings: dict) -> list[str]:
    """Check the settings, that every hooked stage function exists and that each converter takes its argv."""
    import importlib

    from hf_attn.conversion import cli, specs
    from hf_attn.conversion.checkpoint.calibration import default_calibration_files

    dims, full = dims_of(settings)
    for stage, _, module, name, _ in HOOKS:
        if not callable(getattr(importlib.import_module(module), name, None)):
            raise ValueError(
                f"stage {stage!r}: {module}.{name} is gone; update HOOKS in benchmarks/gpu_recipe.py"
            )
    default_calibration_files()  # the synthetic tokenizer is trained on it, the converters calibrate on it
    lines = [f"{settings['shape']}, {dims['num_hidden_layers']} of {full} layers, "
             f"{checkpoint_bytes(dims) / 1e9:.1f} GB bf16"]  # fmt: skip
    for converter in settings["converters"]:
        argv = converter_argv(converter, "M", "O")
        spec = specs.MLASpec if converter == "mla" else specs.GQASpec
        cli.build_parser(converter, "", spec).parse_args(argv[argv.index("--model") :])
        lines.append("python -m " + " ".join(argv[4:]))
    return lines


def stage_rows(converter: str, log: Path, wall: float, status: str, scale: dict) -> list[dict]:
    """Rows of one conversion from its stage log: each stage, the process start, the total (see the module
    docstring for the full-depth estimate; `scale`: {"layers": L_full / L, "bytes": ..., "L": L})."""
    seconds, calls, peaks = {}, {}, {}
    for line in log.read_text().splitlines() if log.is_file() else []:
        item = json.loads(line)
        if "stage" in item:
            seconds[item["stage"]] = seconds.get(item["stage"], 0.0) + item["seconds"]
            calls[item["stage"]] = calls.get(item["stage"], 0) + 1
        peaks.update({k: v for k, v in item.items() if k.startswith("peak")})
    tree = {stage: (parent, grows) for stage, parent, _, _, grows in HOOKS if stage in seconds}
    full = {}
    for stage in reversed(list(tree)):  # the stages inside one come after it in HOOKS
        inner = [s for s, (parent, _) in tree.items() if parent == stage]
        own = seconds[stage] - sum(seconds[s] for s in inner)
        full[stage] = sum(full[s] for s in inner) + own * scale[tree[stage][1]]
    rows = []
    for stage, (parent, grows) in tree.items():
        depth = 0 if parent is None else 1 + (tree.get(parent, (None,))[0] is not None)
        per_layer = seconds[stage] / scale["L"] if grows == "layers" else None
        row = dict(
            converter=converter, stage="  " * depth + stage, calls=calls[stage], seconds=seconds[stage]
        )
        rows.append(dict(row, per_layer_s=per_layer, full_depth_s=full[stage]))
    start = wall - sum(seconds[s] for s, (parent, _) in tree.items() if parent is None)
    estimate = start + sum(full[s] for s, (parent, _) in tree.items() if parent is None)
    rows.append(
        dict(converter=converter, stage="process start and the rest", seconds=start, full_depth_s=start)
    )
    gib = {k: v / 2**30 if v else None for k, v in peaks.items()}
    rows.append(dict(converter=converter, stage="total", seconds=wall, full_depth_s=estimate, status=status,
                     peak_gpu_gib=gib.get("peak_gpu"), peak_rss_gib=gib.get("peak_rss")))  # fmt: skip
    return rows


def record_rows(converter: str, dst: Path, scale: dict) -> list[dict]:
    """Rows of the `stage_seconds` the output's conversion records carry (where the converters mark their
    stages: calibration forward, statistics, fit, refine forward / backward, ..., read, write), one per record
    and stage; [] where the records carry none. Read and write grow with the bytes, "other" stays."""
    try:
        history = json.loads((dst / "config.json").read_text()).get("hf_attn", {}).get("history", [])
    except (OSError, ValueError):
        return []
    rows = []
    for record in history:
        for stage, seconds in (record.get("stage_seconds") or {}).items():
            grows = {"read": "bytes", "write": "bytes", "other": None}.get(stage, "layers")
            label = f"{record.get('kind')} record: {stage}"
            rows.append(dict(converter=converter, stage=label, seconds=seconds,
                             per_layer_s=seconds / scale["L"] if grows == "layers" else None,
                             full_depth_s=seconds * (scale[grows] if grows else 1.0)))  # fmt: skip
    return rows


def convert(converter: str, src: Path, work: Path, scale: dict, emit) -> None:
    """One wrapped conversion of `src`; its rows emitted when it ends, also when it is stopped."""
    log, dst = work / f"{converter}.stages.jsonl", work / f"{converter}-out"
    env = dict(os.environ, **{STAGE_LOG: str(log)})
    start, status, finer = time.perf_counter(), "stopped (time limit)", []
    try:
        proc = subprocess.run(
            converter_argv(converter, str(src), str(dst)), env=env, capture_output=True, text=True
        )
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {lines[-1][:200]}"
        emit(meta={converter: (proc.stdout.strip().splitlines() or [""])[-1][:300]})
        finer = record_rows(converter, dst, scale)
    finally:
        for row in stage_rows(converter, log, time.perf_counter() - start, status, scale) + finer:
            emit(row)
        shutil.rmtree(dst, ignore_errors=True)


def run(settings: dict, emit) -> None:
    import torch

    from benchmarks import synthetic

    if not torch.cuda.is_available():
        raise RuntimeError("recipe needs a CUDA GPU")
    dims, full = dims_of(settings)
    layers = dims["num_hidden_layers"]
    full_dims = {**dims, "num_hidden_layers": full}
    scale = {
        "L": layers,
        "layers": full / layers,
        "bytes": checkpoint_bytes(full_dims) / checkpoint_bytes(dims),
    }
    emit(meta={"device": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "scale": scale})
    work = Path(tempfile.mkdtemp(prefix="hf-attn-gpu-recipe-", dir=settings["workdir"]))
    try:
        src, start = work / "source", time.perf_counter()
        synthetic.write_synthetic(src, shape=dims, progress=False)
        emit(dict(converter="-", stage=f"write the synthetic source ({checkpoint_bytes(dims) / 1e9:.1f} GB)",
                  seconds=time.perf_counter() - start, status="ok"))  # fmt: skip
        for converter in settings["converters"]:
            convert(converter, src, work, scale, emit)
    finally:
        shutil.rmtree(work, ignore_errors=True)


COLUMNS = (
    ("converter", "converter", ""), ("stage", "stage", ""), ("calls", "calls", "d"), ("s", "seconds", ".1f"),
    ("s / layer", "per_layer_s", ".2f"), ("full depth s (est.)", "full_depth_s", ".0f"),
    ("peak GPU GiB", "peak_gpu_gib", ".2f"), ("peak RSS GiB", "peak_rss_gib", ".2f"),
    ("status", "status", ""),
)  # fmt: skip
_DEFAULTS = dict(shape="llama-3-8b", layers=2, converters=["mla"], workdir=None)
ADAPTERS = {
    "recipe": Adapter(defaults=_DEFAULTS, columns=COLUMNS, plan=plan, run=run),
    "recipe-gqa": Adapter(defaults={**_DEFAULTS, "converters": ["gqa"]}, columns=COLUMNS, plan=plan, run=run),
    "recipe-deep": Adapter(
        defaults={**_DEFAULTS, "layers": 8, "converters": ["mla"]}, columns=COLUMNS, plan=plan, run=run
    ),  # fmt: skip
}
