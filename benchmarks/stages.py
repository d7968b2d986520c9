"""Where a default conversion's time goes: each stage's seconds beside its FLOP or byte bound on this machine.

    python -m benchmarks.stages [--models smollm2 llama-3-8b] [--converters mla gqa]
        [--recipes default before] [--layers 3] [--workdir DIR] [--output FILE]

For each model, converter and recipe it runs the conversion command as a child process (`python -m
hf_attn.conversion.mla --kv-budget 0.5` / `gqa --num-kv-heads 1`, the commands' defaults or `RECIPES`),
reads the `stage_seconds` its conversion records carry (conversion/stages.py) and writes one row per stage:
seconds, seconds per layer, the full-depth estimate, the stage's work (`stage_work`: FLOPs or bytes from the
config and the recorded settings, with the steps and tokens it counts) and the seconds that work takes at this
machine's rates, measured once per model shape (fp32 / fp64 matmul GFLOP/s at the layer's sizes with the
threads torch uses, memory and file GB/s). Models: the embedded SmolLM2 (every layer) and `benchmarks.scale`'s
synthetic Llama-2-7B / Llama-3-8B checkpoints cut to --layers layers (benchmarks/synthetic.py); a stage that
grows with the layers is extrapolated x L_full / L, the write by the checkpoint's bytes. Outputs and
synthetic sources are deleted once measured (--workdir: where they are written). Wall times depend on the
machine's load: the header records the load average before and after each run.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import stage_work as sw
from benchmarks.scale import check_outputs, child_argv, measure, weight_bytes
from benchmarks.synthetic import SHAPES, write_synthetic
from hf_attn.conversion import stages
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import json_record, write_text_atomic

PROG = "python -m benchmarks.stages"
WRITER = "hf-attn benchmarks.stages"  # its JSON's written_by: an hf-attn output (the output guard)
MODELS = ("smollm2", "llama-2-7b", "llama-3-8b", "tiny")
CONVERTERS = {
    "mla": ("hf_attn.conversion.mla", ["--kv-budget", "0.5"]),
    "gqa": ("hf_attn.conversion.gqa", ["--num-kv-heads", "1"]),
}
# the refinement's flags of each recipe ("before": the defaults until 2026-11-26)
RECIPES = {
    "default": [],
    "before": ["--refine-steps", "32", "--refine-tokens", "4096", "--refine-loss-stride", "1"]
    + ["--refine-step-dtype", "float32"],
}


UNITS = {"flop": "GFLOP", "fp64 flop": "GFLOP (fp64)", "byte": "GB"}


@dataclass
class StageRow:
    model: str
    converter: str
    recipe: str
    stage: str
    seconds: float
    per_layer_s: float | None
    full_depth_s: float
    work: float | None = None
    unit: str = ""
    bound_s: float | None = None
    note: str = ""


def source_for(model: str, workdir: Path, layers: int) -> tuple[Path, bool]:
    """(the source checkpoint, whether it was written here): the embedded SmolLM2, or a synthetic one."""
    if model == "smollm2":
        from hf_attn.tooling import loading

        return loading.resolve_model(None), False
    src = workdir / f"{model}-{layers}-layers"
    if src.exists():
        shutil.rmtree(src)
    write_synthetic(src, shape={**SHAPES[model], "num_hidden_layers": layers}, progress=False)
    return src, True


def shape_of(src: Path) -> sw.Shape:
    """The work model's per-layer shape of the checkpoint at `src` (its config and layer 0's tensors)."""
    from hf_attn.conversion.checkpoint.io import tensor_index

    cfg = json.loads((src / "config.json").read_text())
    index = tensor_index(src)
    layer0 = [info for name, info in index.items() if name.startswith("model.layers.0.")]
    attn = [info for name, info in index.items() if name.startswith("model.layers.0.self_attn.")]
    heads = cfg["num_attention_heads"]
    return sw.Shape(
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        attn_params=sum(_numel(i.shape) for i in attn),
        layer_bytes=sum(i.end - i.begin for i in layer0),
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def converted_sizes(dst: Path, layers: int) -> dict:
    """The converted checkpoint's attention parameters and bytes per layer, and its weights' bytes."""
    from hf_attn.conversion.checkpoint.io import tensor_index

    index = tensor_index(dst)
    attn = [i for n, i in index.items() if ".self_attn." in n]
    layer = [i for n, i in index.items() if n.startswith("model.layers.")]
    return {
        "attn_params": sum(_numel(i.shape) for i in attn) // layers,
        "layer_bytes": sum(i.end - i.begin for i in layer) // layers,
        "bytes": weight_bytes(dst),
    }


def full_depth_factors(model: str, shape: sw.Shape, src: Path) -> tuple[float, float]:
    """(layers, bytes) ratios of the full-depth model to the measured one (1, 1 for SmolLM2)."""
    if model == "smollm2":
        return 1.0, 1.0
    full = SHAPES[model]["num_hidden_layers"]
    measured = weight_bytes(src)
    fixed = measured - shape.layers * shape.layer_bytes  # embeddings, head, final norm
    return full / shape.layers, (fixed + full * shape.layer_bytes) / measured


def stage_rows(run: dict, shape: sw.Shape, rates: sw.Rates, factors: tuple[float, float]) -> list[StageRow]:
    """One row per recorded stage of a conversion `run` (its records, sizes, wall time), then the process
    start (wall time outside the recorded stages) and the total."""
    seconds: dict[str, float] = {}
    for record in run["records"]:
        for stage, s in (record.get("stage_seconds") or {}).items():
            seconds[stage] = seconds.get(stage, 0.0) + s
    work = sw.stage_work(shape, run["records"], {**run["sizes"], "source_bytes": run["source_bytes"]})
    key = dict(model=run["model"], converter=run["converter"], recipe=run["recipe"])
    rows, full_total = [], 0.0
    for stage, s in stages.rounded(seconds).items():  # in pipeline order
        grows = factors[1] if stage == "write" else 1.0 if stage == "other" else factors[0]
        per_layer = None if stage in ("write", "other") else s / shape.layers
        amount, unit = work.get(stage, (None, ""))
        bound = None if amount is None else sw.bound_seconds(amount, unit, rates, stage)
        rows.append(StageRow(**key, stage=stage, seconds=s, per_layer_s=per_layer, full_depth_s=s * grows,
                             work=amount, unit=unit, bound_s=bound))  # fmt: skip
        full_total += s * grows
    start = run["wall_s"] - sum(seconds.values())
    rows.append(StageRow(**key, stage="process start", seconds=start, per_layer_s=None, full_depth_s=start))
    rows.append(StageRow(**key, stage="total (wall)", seconds=run["wall_s"], per_layer_s=None,
                         full_depth_s=full_total + start, note=run["note"]))  # fmt: skip
    return rows


@contextlib.contextmanager
def busy_processes(n: int):
    """n child processes that each keep one core busy (a Python loop) while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_conversion(
    model: str, converter: str, recipe: str, *, src: Path, workdir: Path, extra: list[str], busy: int = 0
) -> dict:
    """Run one conversion as a child process; its records, sizes and wall time (the output deleted)."""
    module, args = CONVERTERS[converter]
    dst = workdir / f"{model}-{converter}-{recipe}"
    argv = child_argv(module, cuda=False) + ["--model", str(src), "--output", str(dst), *args]
    argv += [*RECIPES[recipe], *extra, "--device", "cpu"]
    load, cpu = os.getloadavg()[0], _children_cpu_seconds()
    with busy_processes(busy):
        code, wall, _, tail, _ = measure(argv)
        cpu = _children_cpu_seconds() - cpu  # the conversion's (the busy processes are reaped later)
    note = f"load {load:.1f} -> {os.getloadavg()[0]:.1f}; {busy} busy; child CPU {cpu:.0f} s"
    if code != 0:
        raise UserError(f"{' '.join(argv[3:])} failed (exit {code}): {tail.strip().splitlines()[-1:]}")
    history = json.loads((dst / "config.json").read_text())["hf_attn"]["history"]
    records = history[-2:] if history[-1]["kind"] == "refine" else history[-1:]
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    run = dict(model=model, converter=converter, recipe=recipe, records=records, wall_s=wall, note=note,
               sizes=converted_sizes(dst, layers), source_bytes=weight_bytes(src))  # fmt: skip
    shutil.rmtree(dst)
    return run


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of every child process reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(rows: list[StageRow], header: str) -> str:
    lines = [
        header,
        "",
        "| model | converter | recipe | stage | s | s / layer | full depth s | work | bound s | s / bound |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        work = "–" if r.work is None else f"{r.work / 1e9:.1f} " + UNITS[r.unit]
        ratio = None if not r.bound_s else r.seconds / r.bound_s
        lines.append(
            f"| {r.model} | {r.converter} | {r.recipe} | {r.stage} | {r.seconds:.1f} | "
            f"{_cell(r.per_layer_s, '.2f')} | {r.full_depth_s:.0f} | {work} | {_cell(r.bound_s, '.1f')} | "
            f"{_cell(ratio, '.1f')} |" + (f" {r.note}" if r.note else "")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["smollm2", "llama-3-8b"])
    parser.add_argument("--converters", nargs="+", choices=sorted(CONVERTERS), default=["mla", "gqa"])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["default"])
    parser.add_argument("--layers", type=int, default=3, help="layers of the synthetic checkpoints")
    parser.add_argument("--calibration-tokens", type=int, default=None, help="(default: the converters')")
    parser.add_argument(
        "--busy", type=int, default=0, help="CPU-bound processes competing with each conversion (default 0)"
    )
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--output", default=None, help="write FILE.json and FILE.md (FILE without suffix)")
    args = parser.parse_args(argv)

    def body() -> int:
        check_number("--layers", args.layers, minimum=1, inclusive=True, integer=True)
        check_number("--busy", args.busy, minimum=0, inclusive=True, integer=True)
        if args.output:
            check_outputs(Path(args.output).with_suffix(""))
        if args.calibration_tokens is not None:
            check_number(
                "--calibration-tokens", args.calibration_tokens, minimum=1, inclusive=True, integer=True
            )
        extra = (
            [] if args.calibration_tokens is None else ["--calibration-tokens", str(args.calibration_tokens)]
        )
        made = args.workdir is None
        workdir = Path(tempfile.mkdtemp(prefix="hf-attn-bench-stages-")) if made else Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        rows: list[StageRow] = []
        headers: list[str] = []
        try:
            for model in args.models:
                src, written = source_for(model, workdir, args.layers)
                shape = shape_of(src)
                rates = sw.measure_rates(
                    hidden=shape.hidden, intermediate=shape.intermediate, workdir=workdir
                )
                headers.append(f"{model}: {asdict(rates)}")
                factors = full_depth_factors(model, shape, src)
                for converter in args.converters:
                    for recipe in args.recipes:
                        run = run_conversion(
                            model, converter, recipe, src=src, workdir=workdir, extra=extra, busy=args.busy
                        )
                        rows += stage_rows(run, shape, rates, factors)
                        _write(args.output, rows, headers)
                if written:
                    shutil.rmtree(src)
        finally:
            if made:
                shutil.rmtree(workdir, ignore_errors=True)
        print(markdown(rows, "\n".join(headers)))
        return 0

    return run_command(PROG, body)


def _write(output: str | None, rows: list[StageRow], headers: list[str]) -> None:
    """FILE.json and FILE.md after every conversion (an interrupted run keeps what it measured)."""
    if output is None:
        return
    base = Path(output).with_suffix("")
    payload = {"rates": headers, "rows": [asdict(r) for r in rows]}
    write_text_atomic(base.with_suffix(".json"), json_record(payload, WRITER))
    write_text_atomic(base.with_suffix(".md"), markdown(rows, "\n".join(headers)))


if __name__ == "__main__":
    raise SystemExit(main())
