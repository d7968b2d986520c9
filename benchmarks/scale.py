"""Every converter on checkpoints shaped like Llama-2-7B and Llama-3-8B: peak RSS, wall time, MB/s.

    python -m benchmarks.scale [--shapes llama-2-7b llama-3-8b] [--workdir DIR] [--calibration-tokens 256]
                        [--device auto|cpu|cuda] [--output FILE] [--keep]

1. For each shape, write a synthetic checkpoint into `--workdir`: the model's exact config (hidden size,
   layers, heads, KV heads, intermediate size, vocabulary, RoPE theta and scaling, untied embeddings), bf16
   weights drawn from a seeded normal of small std (norm weights 1) so forward passes stay finite, generated
   tensor by tensor in row blocks (never the whole model, never a whole tensor in float32), sharded like the
   hub's checkpoints (`--shard-gb`, default 5 GB, with `model.safetensors.index.json`). The tokenizer is a
   word-level one trained on the calibration text with a vocabulary smaller than the model's, so every id
   it gives is a valid embedding row and the converters' own `--calibration-text` path is used unchanged.
2. Reference: `cp -r` of the source (raw disk speed, read + write).
3. Each converter runs in a child process (`python -m hf_attn.conversion.<x>`): its peak RSS is the child's
   `ru_maxrss` (`os.wait4`), its wall time is measured around it, its output size read from disk, and its
   output deleted at once. MB/s = (source bytes read + output bytes written) / wall time.
4. `refine` (the layer-local refit, `hf-attn refine`) runs on the mean-pooled model against the source, both
   streamed layer by layer, with one Adam step per layer on 256 tokens: its memory and time, not its quality.
5. The DeepSeek export runs on an MLA DeepSeek-layout conversion, after the source is deleted (at most two
   checkpoints exist at any time).

Rows are written (JSON and markdown) after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.synthetic import SHAPES, write_synthetic
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, announce_device, resolve_device
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json, write_text_atomic
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.scale"
WRITER = "hf-attn benchmarks.scale"  # its JSON's written_by: an hf-attn output (the output guard)

CLOSED_FORM = ["--refine-steps", "0"]  # every conversion row times the closed form (refinement: its own row)
MEAN_POOLING = ["--method", "mean", *CLOSED_FORM]  # the GQA paper's pooling
REFINE_TOKENS = 256  # calibration tokens of the refine step (one window, one Adam step per layer)


# --------------------------------------------------------------------------------------------- measuring


@dataclass
class Row:
    shape: str
    converter: str
    command: str
    device: str
    peak_rss_bytes: int | None = None
    wall_s: float | None = None
    read_bytes: int = 0
    output_bytes: int = 0
    status: str = "ok"
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float | None:
        if not self.wall_s or self.status != "ok":
            return None
        return (self.read_bytes + self.output_bytes) / 1e6 / self.wall_s


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def _rss_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(argv: list[str], *, rss_limit: int | None = None) -> tuple[int, float, int, str, bool]:
    """Run argv as a child; (exit status, wall seconds, ru_maxrss bytes, stderr tail, killed over the limit).

    With `rss_limit` (bytes) the child's VmRSS is polled twice a second and the child killed (SIGKILL) once
    it is above: the machine is shared, a converter that needs 13 GB must not take it from the others."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    killed = False
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss = _rss_of(proc.pid)
            if rss_limit is not None and rss is not None and rss > rss_limit and not killed:
                proc.kill()
                killed = True
            time.sleep(0.5)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    return proc.returncode, wall, usage.ru_maxrss * 1024, tail, killed


_CUDA_REPORT = "    import torch; print('CUDA_PEAK', torch.cuda.max_memory_allocated(), file=sys.stderr)\n"


def child_argv(module: str, *, cuda: bool) -> list[str]:
    """argv that runs `python -m module` and prints its own VmHWM (and CUDA peak) to stderr at exit.

    The child's own high-water mark, not `ru_maxrss`: that one keeps the forked parent's RSS across exec."""
    code = (
        "import atexit, runpy, sys\n"
        "from hf_attn.eval.bench.memory import status_bytes\n"
        "def report():\n"
        "    print('PEAK_RSS', status_bytes('VmHWM'), file=sys.stderr)\n"
        + (_CUDA_REPORT if cuda else "")
        + "atexit.register(report)\n"
        f"sys.argv = [{module!r}] + sys.argv[1:]\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )
    return [sys.executable, "-c", code]


def run_step(
    *,
    shape: str,
    converter: str,
    module: str,
    args: list[str],
    src: Path,
    dst: Path,
    device: str,
    keep: bool,
    rss_limit: int | None = None,
) -> Row:
    argv = child_argv(module, cuda=device == "cuda") + args
    shown = f"python -m {module} " + " ".join(args)
    row = Row(shape=shape, converter=converter, command=shown, device=device)
    code, wall, _, tail, killed = measure(argv, rss_limit=rss_limit)
    row.wall_s = round(wall, 1)
    for line in tail.splitlines():
        if line.startswith("PEAK_RSS "):
            row.peak_rss_bytes = int(line.split()[1])
        if line.startswith("CUDA_PEAK "):
            row.extra["cuda_peak_bytes"] = int(line.split()[1])
    if killed:
        row.status = f"killed: RSS above --rss-limit-gb {rss_limit / 1024**3:.1f}"
        row.peak_rss_bytes = max(row.peak_rss_bytes or 0, rss_limit)
    elif code != 0:
        row.status = f"failed (exit {code})"
        errors = [x for x in tail.strip().splitlines() if not x.startswith(("PEAK_RSS", "CUDA_PEAK"))]
        row.note = errors[-1][:300] if errors else ""
    else:
        row.read_bytes = weight_bytes(src)
        row.output_bytes = weight_bytes(dst)
    if dst.exists() and not keep:
        shutil.rmtree(dst)
    for partial in dst.parent.glob(f".{dst.name}.*.tmp"):  # what atomic_directory leaves after a kill
        shutil.rmtree(partial, ignore_errors=True)
    return row


def pooled_kv_heads(dims: dict) -> int:
    """KV heads of the pooled GQA steps for a shape's `dims`: 32 -> 8 (Llama-2-7B), 8 -> 1 (Llama-3-8B)."""
    G = dims["num_key_value_heads"]
    return G // 4 if G >= 32 else 1


def refine_rows(shape: str, *, src: Path, workdir: Path, device: str, rss_limit: int | None) -> list[Row]:
    """`hf-attn refine` of the mean-pooled model against the source, both streamed layer by layer: its
    memory and time with one Adam step per layer on REFINE_TOKENS tokens (a measurement of the streaming,
    not a quality run). The pooled input is written first (its own row) and both are deleted afterwards."""
    pooled = pooled_kv_heads(SHAPES[shape])
    mean = workdir / f"{shape}-gqa-mean"
    rows = [
        run_step(
            shape=shape,
            converter=f"gqa mean -> {pooled} (refine's input)",
            module="hf_attn.conversion.gqa",
            args=["--model", str(src), "--output", str(mean), "--num-kv-heads", str(pooled), *MEAN_POOLING],
            src=src,
            dst=mean,
            device="cpu",
            keep=True,
            rss_limit=rss_limit,
        )
    ]
    if mean.exists():
        dst = workdir / f"{shape}-refined"
        args = ["--model", str(mean), "--source", str(src), "--output", str(dst), "--steps", "1"]
        args += [
            "--calibration-tokens",
            str(REFINE_TOKENS),
            "--calibration-corpus",
            "austen",
            "--no-progress",
        ]
        rows.append(
            run_step(
                shape=shape,
                converter=f"refine (1 step per layer, {REFINE_TOKENS} tokens)",
                module="hf_attn.conversion.refine",
                args=[*args, "--device", device],
                src=mean,
                dst=dst,
                device=device,
                keep=False,
                rss_limit=rss_limit,
            )
        )
        shutil.rmtree(mean)
    return rows


def copy_reference(*, shape: str, src: Path, dst: Path) -> Row:
    row = Row(
        shape=shape, converter="cp -r (disk reference)", command=f"cp -r {src.name} {dst.name}", device="-"
    )
    code, wall, _, tail, _ = measure(["cp", "-r", str(src), str(dst)])
    row.wall_s = round(wall, 1)
    if code != 0:
        row.status, row.note = f"failed (exit {code})", tail.strip()[-300:]
    else:
        row.read_bytes = row.output_bytes = weight_bytes(src)
    shutil.rmtree(dst, ignore_errors=True)
    return row


def plan(shape: str, *, calibration: list[str], device_args: list[str]) -> list[tuple[str, str, list[str]]]:
    """(converter label, module, arguments after --model/--output) for one shape, in running order."""
    dims = SHAPES[shape]
    H, G = dims["num_attention_heads"], dims["num_key_value_heads"]
    pooled = pooled_kv_heads(dims)
    steps = []
    expand_note = "expand (no-op: already MHA)" if G == H else f"expand {G}->{H} (MHA)"
    steps.append((expand_note, "hf_attn.conversion.expand", []))
    steps.append(
        (f"gqa mean {G}->{pooled}", "hf_attn.conversion.gqa", ["--num-kv-heads", str(pooled), *MEAN_POOLING])
    )
    steps.append(
        (
            f"gqa calibrated {G}->{pooled}",
            "hf_attn.conversion.gqa",
            [
                "--num-kv-heads",
                str(pooled),
                "--method",
                "calibrated",
                *CLOSED_FORM,
                *calibration,
                *device_args,
            ],
        )
    )
    steps.append(
        (
            "mla --kv-budget 0.5 (calibrated)",
            "hf_attn.conversion.mla",
            ["--kv-budget", "0.5", *CLOSED_FORM, *calibration, *device_args],
        )
    )
    return steps


def write_source(shape: str, src: Path) -> Row:
    """Write the synthetic checkpoint of `shape` to `src`; its row (wall time, size, shard count)."""
    start = time.perf_counter()
    write_synthetic(src, shape=shape)
    return Row(
        shape=shape,
        converter="write synthetic source",
        command=f"write_synthetic(shape={shape!r})",
        device="cpu",
        wall_s=round(time.perf_counter() - start, 1),
        output_bytes=weight_bytes(src),
        note=f"{len(list(src.glob('*.safetensors')))} shards",
    )


def export_steps(
    shape: str, *, src: Path, workdir: Path, mla_args: list[str], keep: bool, step, emit
) -> None:
    """The MLA DeepSeek-layout conversion of `src` (with `mla_args`), then its export to deepseek_v3 after
    `src` is deleted (unless `keep`): at most two checkpoints on disk. `step`: `run_step` with the shape's
    common arguments bound; each row goes to `emit` as soon as it is measured."""
    mla = workdir / f"{shape}-mla-deepseek"
    args = [
        "--model",
        str(src),
        "--output",
        str(mla),
        "--layout",
        "deepseek",
        "--kv-budget",
        "0.5",
        *CLOSED_FORM,
    ]
    emit(
        step(
            converter="mla --layout deepseek --kv-budget 0.5",
            module="hf_attn.conversion.mla",
            args=[*args, *mla_args],
            src=src,
            dst=mla,
            keep=True,
        )
    )
    if not keep:
        shutil.rmtree(src)  # at most two checkpoints on disk: the MLA source of the export and its output
    if mla.exists():
        dst = workdir / f"{shape}-deepseek-v3"
        emit(
            step(
                converter="export --to deepseek_v3",
                module="hf_attn.conversion.export",
                args=["--to", "deepseek_v3", "--model", str(mla), "--output", str(dst)],
                src=mla,
                dst=dst,
                device="cpu",
                keep=keep,
            )
        )
        if not keep:
            shutil.rmtree(mla)


def run_shape(
    shape: str,
    *,
    workdir: Path,
    calibration_tokens: int,
    device: str,
    keep: bool,
    skip: set[str],
    emit,
    rss_limit: int | None = None,
) -> None:
    """Every step of one shape, each row passed to `emit` as soon as it is measured."""
    src = workdir / f"{shape}-source"
    emit(write_source(shape, src))
    if "cp" not in skip:
        emit(copy_reference(shape=shape, src=src, dst=workdir / f"{shape}-copy"))
    calibration = ["--calibration-tokens", str(calibration_tokens)]
    device_args = ["--device", device]  # resolved ("cpu" / "cuda"): every child runs where this one said
    step = functools.partial(run_step, shape=shape, device=device, rss_limit=rss_limit)
    for label, module, args in plan(shape, calibration=calibration, device_args=device_args):
        if label.split()[0] in skip:
            continue
        dst = workdir / f"{shape}-out"
        args = ["--model", str(src), "--output", str(dst), *args]
        emit(step(converter=label, module=module, args=args, src=src, dst=dst, keep=keep))
    if "refine" not in skip:
        for row in refine_rows(shape, src=src, workdir=workdir, device=device, rss_limit=rss_limit):
            emit(row)
    if "export" in skip:
        if not keep:
            shutil.rmtree(src)
        return
    mla_args = [*calibration, *device_args]
    export_steps(shape, src=src, workdir=workdir, mla_args=mla_args, keep=keep, step=step, emit=emit)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.2f} GiB"


def markdown(rows: list[Row], header: str) -> str:
    columns = "shape | converter | device | peak RSS | peak GPU | wall time | output size | MB/s (read+write)"
    cells = []
    for r in rows:
        mbs = r.mb_per_s
        cells.append([
            r.shape, r.converter, r.device, _gib(r.peak_rss_bytes), _gib(r.extra.get("cuda_peak_bytes")),
            "-" if r.wall_s is None else f"{r.wall_s:.0f} s", _gib(r.output_bytes) if r.output_bytes else "-",
            "-" if mbs is None else f"{mbs:.0f}", f"{r.status}{(': ' + r.note) if r.note else ''}",
        ])  # fmt: skip
    table = markdown_table([*columns.split(" | "), "status"], cells, align="l" * 9)
    return f"{header}\n\n{table}\n"


def check_outputs(base: Path) -> None:
    """UserError unless FILE.json and FILE.md may be written: new, or a record of this command beside them."""
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    check_output(None, json_path, overwrite=True, kind="json")
    if md_path.exists() and not json_path.exists():
        raise UserError(
            f"--output {base}: {md_path} exists without the record {json_path} this command writes beside "
            "it; move it away or choose another --output"
        )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-2-7b", "llama-3-8b"])
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--calibration-tokens", type=int, default=256)
    parser.add_argument(
        "--device", choices=DEVICES, default=DEFAULT_DEVICE, help=f"calibration, refinement ({DEVICE_HELP})"
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["cp", "expand", "gqa", "mla", "refine", "export"],
        help="steps to skip",
    )
    parser.add_argument("--output", default=None, help="write FILE.json and FILE.md (FILE without suffix)")
    parser.add_argument(
        "--rss-limit-gb",
        type=float,
        default=8.0,
        help="kill a converter whose RSS goes above this many GiB (shared machines; 0: no limit)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (needs a lot of disk)")
    args = parser.parse_args(argv)

    def body() -> int:
        check_number("--calibration-tokens", args.calibration_tokens, minimum=1, inclusive=True, integer=True)
        check_number("--rss-limit-gb", args.rss_limit_gb, minimum=0, inclusive=True)
        if args.output:
            check_outputs(Path(args.output).with_suffix(""))
        device = resolve_device(args.device)  # --device cuda without CUDA: one line, before any work
        announce_device(device)
        made = args.workdir is None
        workdir = Path(tempfile.mkdtemp(prefix="hf-attn-bench-scale-")) if made else Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        header = (
            f"calibration: {args.calibration_tokens} tokens; device {device.type}; "
            f"nice {os.nice(0)}; {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}; "
            f"RSS limit {args.rss_limit_gb} GiB"
        )
        rows: list[Row] = []

        def emit(row: Row) -> None:
            rows.append(row)
            print(markdown([row], "").splitlines()[-1], flush=True)
            if args.output:
                base = Path(args.output).with_suffix("")
                payload = {"settings": header, "rows": [{**asdict(r), "mb_per_s": r.mb_per_s} for r in rows]}
                write_json(base.with_suffix(".json"), payload, prog=WRITER)
                write_text_atomic(base.with_suffix(".md"), markdown(rows, header))

        try:
            for shape in args.shapes:
                run_shape(
                    shape,
                    workdir=workdir,
                    calibration_tokens=args.calibration_tokens,
                    device=device.type,
                    keep=args.keep,
                    skip=set(args.skip),
                    emit=emit,
                    rss_limit=int(args.rss_limit_gb * 1024**3) if args.rss_limit_gb > 0 else None,
                )
        finally:
            if made and not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        print(markdown(rows, header))
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
