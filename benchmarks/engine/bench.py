"""The KV-cache payoff of an MLA export measured inside vLLM: a source checkpoint (vLLM's Llama path) and its
`deepseek_v3` export served by the same engine with the same KV-cache bytes and the same requests.

    python -m benchmarks.engine [--models smollm2 llama-2-7b] [--quick] [--workdir DIR] [--dtype bfloat16]
                         [--cpu-threads N] [--output ROWS.json] [--markdown TABLES.md]

Per model pair (source, export), each served by `benchmarks/engine/bench_worker.py` in the engine's
environment:
1. Capacity: vLLM's own figures (KV blocks x block size, maximum concurrency at the run's `max_model_len`)
   beside the arithmetic (KV bytes / bytes per token from config.json, and the whole blocks that holds).
2. Decode apart from prefill: requests are added level by level (concurrency 1, 2, 4, ...; only the new ones
   prefill) and at each level pure decode steps are timed: time per output token at equal concurrency and at
   each model's maximum concurrency; a torch profile of the decode step (top ops) at the source's maximum.
3. End to end at a KV-bound operating point: more requests than the source's cache holds, all submitted at
   once: output tokens/s and mean time per output token, vLLM scheduling as it does in serving.

Models: `smollm2` (the embedded SmolLM2-135M, `convert mla --layout deepseek --kv-budget 0.5`, exported at 576
= 512 + 64, the only size vLLM's CPU MLA backend takes: more cache per token than the source, an honest loss),
`llama-2-7b` (Llama-2-7B's shape with `--layers` layers and seeded random bf16 weights,
`benchmarks/synthetic.py`, converted to exactly 512 + 64: 576 numbers per token and layer against 8192,
14.2x), `tiny` (`--quick`).
The same code runs on a GPU build of vLLM (the device is vLLM's); `--cpu-threads` only sets OMP_NUM_THREADS.
Prepared checkpoints are kept in `--workdir` and reused; the JSON rows and the tables are written there (or
to --output / --markdown) after every pair, a pair measured again replacing its rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import write_text_atomic

PROG = "python -m benchmarks.engine"
WORKER = Path(__file__).with_name("bench_worker.py")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MiB = 1024**2
NULL_BLOCKS = 1  # vLLM's block pool keeps one block as its null block: never given to a request


@dataclass(frozen=True)
class Workload:
    """What one model pair is asked to do (the same for source and export).

    Args:
        kv_cache_bytes: KV-cache memory given to each engine (vLLM's `kv_cache_memory_bytes`).
        prompt_len: prompt tokens of every request (random token ids, the same for both models).
        output_len: new tokens per request in the end-to-end run.
        num_requests: requests of the end-to-end run (more than the source's cache holds).
        levels: decode concurrencies tried (each model stops where its cache or max_num_seqs ends).
        steps: decode steps timed per level; profile_steps: decode steps profiled at the source's maximum.
    """

    kv_cache_bytes: int
    prompt_len: int
    output_len: int
    num_requests: int
    levels: tuple[int, ...]
    steps: int = 4
    profile_steps: int = 2
    max_num_seqs: int = 64


WORKLOADS: dict[str, Workload] = {
    # sized for a small CPU share: every decode-sweep sequence stays within one 128-token block of vLLM-CPU's
    # MHA cache (prompt 64 + at most 64 new tokens), so the source's capacity is whole requests
    "smollm2": Workload(
        32 * MiB, prompt_len=64, output_len=32, num_requests=16, levels=(1, 2, 4, 8, 16), steps=5
    ),
    "llama-2-7b": Workload(
        16 * MiB, prompt_len=64, output_len=32, num_requests=8, levels=(1, 2, 4, 8, 16), steps=5
    ),
    "tiny": Workload(
        1 * MiB, prompt_len=16, output_len=4, num_requests=4, levels=(1, 2), steps=2, profile_steps=1
    ),
}


@dataclass(frozen=True)
class Pair:
    """A source checkpoint and its deepseek_v3 export."""

    name: str
    source: Path
    export: Path
    note: str


# --------------------------------------------------------------------------------------------- checkpoints


def _run(argv: list[str], log: Path) -> None:
    """Run a project command in this interpreter's environment; its output goes to `log`; raise on failure."""
    with open(log, "a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:4])} failed (exit {done.returncode}); see {log}")


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"hf_attn.conversion.{name}"]


def _export_dims_flag(dims: int) -> list[str]:
    """The export's option for `kv_lora_rank + qk_rope_head_dim = dims` (its spelling in this version)."""
    from hf_attn.conversion.export import deepseek as export

    text = Path(export.__file__).read_text()
    return ["--engine-dims", str(dims)] if "--engine-dims" in text else ["--flashmla-dims"]


def convert_and_export(source: Path, work: Path, *, convert_args: list[str], pad_to_576: bool) -> Path:
    """`hf-attn convert mla --layout deepseek ...` then `hf-attn export --to deepseek_v3` (engine eps); the
    export directory (reused when it is already complete)."""
    mla, export = work / "mla", work / "export"
    if (export / "config.json").exists():
        return export
    log = work / "prepare.log"
    if not (mla / "config.json").exists():
        _run(
            [
                *_module("mla"),
                "--model",
                str(source),
                "--output",
                str(mla),
                "--layout",
                "deepseek",
                "--refine-steps",
                "0",  # the closed form: the benchmark measures the engine, not the quality
                *convert_args,
                "--overwrite",
            ],
            log,
        )
    dims = _export_dims_flag(576) if pad_to_576 else []
    _run(
        [
            *_module("export"),
            "--to",
            "deepseek_v3",
            "--model",
            str(mla),
            "--output",
            str(export),
            *dims,
            "--latent-norm-eps-for",
            "engines",
            "--overwrite",
        ],
        log,
    )
    return export


def write_mha_source(directory: Path, *, shape: dict, seed: int = 0, tokenizer_texts: int = 5) -> Path:
    """A Llama checkpoint of `shape` (benchmarks/synthetic.py's dims) with seeded random bf16 weights and a
    word-level tokenizer trained on the first `tokenizer_texts` calibration texts; reused when complete."""
    from benchmarks import synthetic
    from hf_attn.conversion.checkpoint.calibration import default_calibration_files

    if (directory / "config.json").exists():
        return directory
    files = default_calibration_files()[:tokenizer_texts]
    return synthetic.write_synthetic(directory, shape=shape, seed=seed, tokenizer_files=files, progress=False)


def prepare(name: str, workdir: Path, *, layers: int) -> Pair:
    """The named pair's source and export under `workdir/name` (written once, then reused)."""
    work = workdir / name
    work.mkdir(parents=True, exist_ok=True)
    if name == "smollm2":
        from hf_attn.tooling.assets import smollm2_dir

        source = smollm2_dir()
        export = convert_and_export(source, work, convert_args=["--kv-budget", "0.5"], pad_to_576=True)
        return Pair(name, source, export, "SmolLM2-135M-Instruct, MLA --kv-budget 0.5, exported at 512 + 64")
    if name == "llama-2-7b":
        from benchmarks.synthetic import SHAPES

        shape = dict(SHAPES["llama-2-7b"], num_hidden_layers=layers)
        source = write_mha_source(work / "source", shape=shape)
        rank = ["--kv-lora-rank", "512", "--rope-pairs", "32", "--allocation", "uniform"]
        export = convert_and_export(
            source, work, convert_args=[*rank, "--calibration-tokens", "4608"], pad_to_576=False
        )
        note = f"Llama-2-7B shape, {layers} layers, random bf16 weights; MLA 512 + 64 (no padding)"
        return Pair(name, source, export, note)
    if name == "tiny":
        from benchmarks.synthetic import SHAPES

        source = write_mha_source(work / "source", shape=SHAPES["tiny-mha"], tokenizer_texts=1)
        rank = ["--kv-lora-rank", "64", "--rope-pairs", "8", "--allocation", "uniform"]
        export = convert_and_export(
            source, work, convert_args=[*rank, "--calibration-tokens", "256"], pad_to_576=True
        )
        return Pair(name, source, export, "tiny random Llama (4 heads x 32), MLA 64 + 16 padded to 512 + 64")
    raise ValueError(f"unknown model {name!r}")


# --------------------------------------------------------------------------------------------- engine


def cache_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV-cache bytes per token: Llama (K and V per KV head) or deepseek_v3 (latent + RoPE key)."""
    layers = config["num_hidden_layers"]
    if config["model_type"] == "deepseek_v3":
        width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        width = 2 * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return layers * width * dtype_bytes


def horizon(work: Workload) -> int:
    """Context a decode-sweep sequence reaches by its last step (every level, the added maximum and the
    source's maximum, each `steps` steps plus the new requests' prefill steps, and the profile)."""
    return work.prompt_len + (work.steps + 2) * (len(work.levels) + 2) + work.profile_steps + 8


def worker_spec(
    model: Path, work: Workload, *, dtype: str, seed: int, levels: list[int], profile_at: list
) -> dict:
    """The worker's JSON spec: one engine, a decode sweep then the end-to-end run."""
    config = json.loads((model / "config.json").read_text())
    decode = dict(
        kind="decode",
        name="decode",
        levels=levels,
        prompt_len=work.prompt_len,
        steps=work.steps,
        profile_steps=work.profile_steps,
        profile_at=profile_at,
        horizon=horizon(work),
    )
    batch = dict(
        kind="batch",
        name="batch",
        num_requests=work.num_requests,
        prompt_len=work.prompt_len,
        output_len=work.output_len,
    )
    return dict(
        model=str(model),
        dtype=dtype,
        kv_cache_bytes=work.kv_cache_bytes,
        max_model_len=max(horizon(work), work.prompt_len + work.output_len),
        max_num_seqs=work.max_num_seqs,
        max_num_batched_tokens=None,
        rotary_workaround="auto",
        enforce_eager=True,
        token_range=[10, min(config["vocab_size"], 16000)],
        seed=seed,
        runs=[decode, batch],
    )


def run_worker(spec: dict, out_dir: Path, tag: str, *, python: Path, cpu_threads: int | None) -> dict:
    """Serve one model in the engine environment (a child process); its result dict."""
    from hf_attn.eval.engine.environment import engine_environ

    spec_path, result_path, log = (out_dir / f"{tag}.{x}" for x in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec, indent=1))
    env = engine_environ()  # offline, the engine core in the worker's process
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # whole GiB only, and it would override kv_cache_memory_bytes
    if cpu_threads:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    with open(log, "w") as out:
        done = subprocess.run(
            [str(python), str(WORKER), str(spec_path), str(result_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=out_dir,
        )
    if done.returncode != 0 or not result_path.exists():
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"engine worker failed for {spec['model']} (exit {done.returncode}): {tail}")
    return json.loads(result_path.read_text())


def expected_capacity(model: Path, work: Workload, dtype: str, block_size: int, request_len: int) -> dict:
    """The arithmetic: tokens that fit `kv_cache_bytes`, whole blocks of them, requests of `request_len`."""
    config = json.loads((model / "config.json").read_text())
    per_token = cache_bytes_per_token(config, DTYPE_BYTES[dtype])
    tokens = work.kv_cache_bytes // per_token
    blocks = tokens // block_size
    return dict(
        bytes_per_token=per_token,
        tokens=tokens,
        blocks=blocks,
        requests=(blocks - NULL_BLOCKS) // -(-request_len // block_size),
    )


# --------------------------------------------------------------------------------------------- one pair


def measure_pair(pair: Pair, work: Workload, *, dtype: str, out_dir: Path, **worker) -> dict:
    """Serve the source then the export with the same workload; both workers' results and the arithmetic.
    `worker`: run_worker's python and cpu_threads."""
    seed = 0
    spec = worker_spec(
        pair.source, work, dtype=dtype, seed=seed, levels=list(work.levels), profile_at=["max"]
    )
    source = run_worker(spec, out_dir, f"{pair.name}-source", **worker)
    most = source["runs"][0]["top_level"]  # the source's maximum (or the top level, if that is lower)
    levels = sorted(set(work.levels) | {most})
    spec = worker_spec(pair.export, work, dtype=dtype, seed=seed, levels=levels, profile_at=[most])
    mla = run_worker(spec, out_dir, f"{pair.name}-mla", **worker)
    request_len = work.prompt_len + work.output_len
    results = {}
    for role, model, result in (("source", pair.source, source), ("mla", pair.export, mla)):
        block = result["capacity"]["block_size"]
        result["expected"] = expected_capacity(model, work, dtype, block, request_len)
        results[role] = result
    return results


def rows_of(pair: Pair, work: Workload, results: dict, *, dtype: str, command: str, date: str) -> list[dict]:
    """JSON rows: one per model (capacity, decode levels, end-to-end run) with the run's settings."""
    rows = []
    for role, result in results.items():
        cap = result["capacity"]
        decode, batch = result["runs"]
        rows.append(
            dict(
                pair=pair.name,
                model=role,
                note=pair.note,
                dtype=dtype,
                kv_cache_bytes=work.kv_cache_bytes,
                workload=asdict(work),
                command=command,
                date=date,
                capacity=dict(
                    cap, vllm_tokens=cap["num_blocks"] * cap["block_size"], arithmetic=result["expected"]
                ),
                decode=decode,
                batch=batch,
                load_s=result["load_s"],
            )
        )
    return rows


# --------------------------------------------------------------------------------------------- CLI


def _merge(path: Path, new: list[dict]) -> list[dict]:
    """Rows already in `path` for other pairs, then the new rows (a pair measured again replaces its rows)."""
    old = json.loads(path.read_text()) if path.exists() else []
    pairs = {r["pair"] for r in new}
    return [r for r in old if r["pair"] not in pairs] + new


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=["smollm2", "llama-2-7b"])
    parser.add_argument("--quick", action="store_true", help="the tiny pair only, a few tokens (a smoke run)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "hf-attn-engine-bench",
        help="prepared checkpoints (kept and reused) and the workers' logs",
    )
    parser.add_argument(
        "--engine-python", default=None, help="the engine environment's Python (default: make engine's)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--layers", type=int, default=2, help="layers of the Llama-2-7B-shaped checkpoint")
    parser.add_argument("--cpu-threads", type=int, default=None, help="OMP_NUM_THREADS of the engine (CPU)")
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON rows (default WORKDIR/engine-bench.json)"
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="markdown tables (default WORKDIR/engine-bench.md)"
    )
    args = parser.parse_args(argv)
    return run_command(PROG, lambda: bench(args, argv))


def bench(args: argparse.Namespace, argv: list[str] | None) -> None:
    """The command's work: options checked first, then each pair prepared, served and measured; the rows
    merged into --output and the tables into --markdown after every pair (written atomically)."""
    from benchmarks.engine import bench_report as report

    check_number("--layers", args.layers, minimum=1, inclusive=True, integer=True)
    if args.cpu_threads is not None:
        check_number("--cpu-threads", args.cpu_threads, minimum=1, inclusive=True, integer=True)
    models = ["tiny"] if args.quick else args.models
    output = args.output or args.workdir / "engine-bench.json"
    tables = args.markdown or args.workdir / "engine-bench.md"
    from hf_attn.eval.engine.environment import EngineUnavailable, engine_python

    try:
        python = engine_python(args.engine_python)
    except EngineUnavailable as err:
        raise UserError(str(err)) from err
    command = "python -m benchmarks.engine " + " ".join(argv if argv is not None else sys.argv[1:])
    date = datetime.date.today().isoformat()
    out_dir = args.workdir / "runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    tables.parent.mkdir(parents=True, exist_ok=True)
    for name in models:
        started = time.perf_counter()
        pair = prepare(name, args.workdir, layers=args.layers)
        work = WORKLOADS[name]
        results = measure_pair(
            pair, work, dtype=args.dtype, out_dir=out_dir, python=python, cpu_threads=args.cpu_threads
        )
        rows = _merge(
            output, rows_of(pair, work, results, dtype=args.dtype, command=command.strip(), date=date)
        )
        write_text_atomic(output, json.dumps(rows, indent=1) + "\n")
        write_text_atomic(tables, report.markdown(rows))
        print(
            f"{name}: measured in {time.perf_counter() - started:.0f} s; {output}, {tables}", file=sys.stderr
        )
    print(report.markdown(json.loads(output.read_text())))


if __name__ == "__main__":
    sys.exit(main())
