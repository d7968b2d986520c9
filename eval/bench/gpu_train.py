"""`hf-attn bench gpu` parts that run whole models: model-decode, heal and calibration.

model-decode: `eval/bench/mla_decode.run` on CUDA: SmolLM2's config with random weights (decode speed depends
on shapes only; the 517 MB weights do not travel), MLA attention of SmolLM2's 50% ranks, batch 1, fp32:
tokens/s of the absorbed path (the Triton kernel on CUDA), the expanded path and the source (sdpa).
heal: `eval/bench/heal.throughput` (heal vs a bare PyTorch loop, one GPU) on SmolLM2's config with random
weights, then `hf-attn heal` under `accelerate launch` with the shipped FSDP config, one process per GPU
present. Tokens/s from the median step; model FLOPs utilisation = (6 N + 12 L Hq d T) FLOPs per token (PaLM's
count) x tokens/s over the GPU's dense fp32 peak (heal trains in fp32 by default; no TF32).
calibration: `eval/bench/scale.py` on its synthetic Llama-3-8B-shaped checkpoint with `--device cuda`:
calibrated GQA 8 -> 1, MLA `--kv-budget 0.5`, and `hf-attn refine` of mean-pooled GQA (one step per layer),
each a child process (wall time, peak RSS, peak GPU memory), beside the README's CPU figures of the step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_attn.eval.bench.gpu_parts import Adapter

SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# Dense fp32 (non-tensor-core) peak TFLOPS by device name, longest match first (vendor data sheets)
FP32_PEAK_TFLOPS = (("H100 PCIe", 51.2), ("H100 NVL", 60.0), ("H100", 66.9), ("H200", 66.9), ("A100", 19.5))
# README, "Scale" table (CPU, 256 calibration tokens, 2-core shared machine, 2026-11-23/24): RSS GiB, wall s
CPU_REFERENCE = {
    ("llama-3-8b", "gqa calibrated"): (3.59, 2020), ("llama-3-8b", "mla --kv-budget"): (2.31, 744),
    ("llama-3-8b", "gqa mean"): (1.40, 64), ("llama-2-7b", "gqa calibrated"): (3.18, 1110),
    ("llama-2-7b", "mla --kv-budget"): (3.65, 3107), ("llama-2-7b", "gqa mean"): (0.69, 51),
    ("llama-2-7b", "refine"): (3.58, 285),
}  # fmt: skip


def smollm2_source() -> Path:
    """The embedded SmolLM2 folder (config and tokenizer are all these parts read from it)."""
    from hf_attn.tooling import assets

    folder = assets.cache_dir() / assets.SMOLLM2_DIRNAME
    missing = [name for name in SMOLLM2_FILES if not (folder / name).is_file()]
    if missing:
        raise OSError(
            f"{folder} lacks {missing}; run `hf-attn assets` (or carry .gpu/bundle: make gpu-wheels)"
        )
    return folder


def random_smollm2(dest: Path, *, seed: int = 0) -> Path:
    """A SmolLM2-135M checkpoint with random fp32 weights and the real tokenizer, written into new `dest`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = smollm2_source()
    dest.mkdir(parents=True)
    for name in SMOLLM2_FILES:
        shutil.copy2(source / name, dest / name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    model.save_pretrained(dest)
    return dest


# --------------------------------------------------------------------------------------------- model-decode


def plan_decode(settings: dict) -> list[str]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_source())
    if not 0 <= settings["rope_pairs"] <= config.head_dim // 2 or settings["kv_lora_rank"] < 1:
        raise ValueError(
            f"model-decode: rope_pairs must be in [0, {config.head_dim // 2}], kv_lora_rank >= 1"
        )
    if any(c < 1 for c in settings["contexts"]) or settings["new_tokens"] < 1:
        raise ValueError("model-decode: contexts and new_tokens must be positive")
    return [f"SmolLM2 config, random weights, d_c {settings['kv_lora_rank']}, r {settings['rope_pairs']}, "
            f"contexts {settings['contexts']}"]  # fmt: skip


def run_decode(settings: dict, emit) -> None:
    from hf_attn.eval.bench import mla_decode

    if not torch.cuda.is_available():
        raise RuntimeError("model-decode needs a CUDA GPU")
    seen: dict[int, dict] = {}

    def on_row(r: dict) -> None:
        row = seen.setdefault(r["context"], {"context": r["context"]})
        row[{"absorbed": "absorbed", "expanded": "expanded"}.get(r["variant"], "source") + "_tps"] = r[
            "tokens_per_s"
        ]
        if len(row) == 4:
            row["absorbed_vs_source"] = row["absorbed_tps"] / row["source_tps"]
            row["absorbed_vs_expanded"] = row["absorbed_tps"] / row["expanded_tps"]
            emit(row)

    record = mla_decode.run(
        source=smollm2_source(), random_weights=True, device="cuda", contexts=tuple(settings["contexts"]),
        new_tokens=settings["new_tokens"], kv_lora_rank=settings["kv_lora_rank"],
        rope_pairs=settings["rope_pairs"], on_row=on_row,
    )  # fmt: skip
    emit(meta={k: v for k, v in record.items() if k != "rows"} | {"device": torch.cuda.get_device_name()})


# --------------------------------------------------------------------------------------------- heal


def fsdp_argv(settings: dict, *, model: str, output: str, state: str, text: str, processes: int) -> list[str]:
    """`accelerate launch` of `hf-attn heal` with the shipped FSDP config (heal_fsdp.yaml)."""
    from hf_attn.conversion.heal import FSDP_CONFIG

    heal_args = ["--model", model, "--output", output, "--state-dir", state, "--train-text", text,
                 "--max-steps", str(settings["steps"]), "--seq-len", str(settings["seq_len"]),
                 "--batch-size", str(settings["batch_size"]), "--eval-tokens", "0", "--schedule", "constant",
                 "--overwrite", "--no-progress"]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
              "--num_processes", str(processes), "-m", "hf_attn.conversion.heal"]  # fmt: skip
    return launch + heal_args


def plan_heal(settings: dict) -> list[str]:
    import inspect

    from hf_attn.conversion import heal
    from hf_attn.eval.bench import heal as bench_heal
    from hf_attn.tooling import assets

    if min(settings["steps"], settings["seq_len"], settings["batch_size"]) < 1 or settings["steps"] <= 2:
        raise ValueError(
            "heal: steps must be > 2 (two warm-up steps are not timed), seq_len and batch_size >= 1"
        )
    smollm2_source()
    text = assets.austen_file("northangerabbey")
    argv = fsdp_argv(settings, model="M", output="O", state="S", text=str(text), processes=1)
    heal.build_parser().parse_args(argv[argv.index("hf_attn.conversion.heal") + 1 :])  # flags still exist
    wanted = {"model", "steps", "rounds", "seq_len", "batch_size"}
    if wanted - set(inspect.signature(bench_heal.throughput).parameters):
        raise ValueError(f"eval/bench/heal.throughput no longer takes {sorted(wanted)}")
    if not Path(heal.FSDP_CONFIG).is_file():
        raise OSError(f"{heal.FSDP_CONFIG} is missing")
    return [f"1 GPU: heal vs bare loop, {settings['steps']} steps of {settings['batch_size']} x "
            f"{settings['seq_len']} tokens", "FSDP: " + " ".join(argv[1:9])]  # fmt: skip


def flops_per_token(model_dir: Path, seq_len: int) -> float:
    """6 N + 12 L Hq d T (PaLM): training FLOPs per token of the model in `model_dir` at context T."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * n + 12 * config.num_hidden_layers * config.num_attention_heads * d * seq_len


def fp32_peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in FP32_PEAK_TFLOPS if key in name), None)


def _heal_row(mode: str, seconds: float, tokens: int, flops: float, peak: float | None, **extra) -> dict:
    tps = tokens / seconds
    return dict(mode=mode, seconds_per_step=seconds, tokens_per_s=tps,
                mfu_pct=100 * tps * flops / peak if peak else None, **extra)  # fmt: skip


def run_heal(settings: dict, emit) -> None:
    from hf_attn.conversion.heal import LOG_FILE
    from hf_attn.eval.bench import heal as bench_heal
    from hf_attn.tooling import assets

    if not torch.cuda.is_available():
        raise RuntimeError("heal needs a CUDA GPU")
    s, peak = settings, fp32_peak_flops()
    with tempfile.TemporaryDirectory(prefix="hf-attn-gpu-heal-") as tmp:
        model = random_smollm2(Path(tmp) / "smollm2-random")
        flops = flops_per_token(model, s["seq_len"])
        emit(meta={"device": torch.cuda.get_device_name(), "fp32_peak_flops": peak, "flops_per_token": flops})
        r = bench_heal.throughput(model=str(model), steps=s["steps"], rounds=1, seq_len=s["seq_len"],
                                  batch_size=s["batch_size"])  # fmt: skip
        tokens = s["seq_len"] * s["batch_size"]
        shape = dict(processes=1, batch=s["batch_size"], seq_len=s["seq_len"], steps_timed=s["steps"] - 2)
        emit(_heal_row("1 GPU, bare PyTorch loop", r["bare_seconds_per_step"], tokens, flops, peak, **shape))
        emit(_heal_row("1 GPU, hf-attn heal", r["heal_seconds_per_step"], tokens, flops, peak, **shape))
        n = torch.cuda.device_count()
        out, state = Path(tmp) / "fsdp-out", Path(tmp) / "fsdp-state"
        text = str(assets.austen_file("northangerabbey"))
        argv = fsdp_argv(s, model=str(model), output=str(out), state=str(state), text=text, processes=n)
        proc = subprocess.run(argv, capture_output=True, text=True)
        steps = (
            [json.loads(x) for x in (state / LOG_FILE).read_text().splitlines()]
            if proc.returncode == 0
            else []
        )
        times = [e["step_seconds"] for e in steps if e.get("event") == "step"][2:]
        if not times:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            emit(dict(mode=f"FSDP, {n} processes", processes=n, note=f"exit {proc.returncode}: {tail}"))
            return
        emit(_heal_row(f"FSDP, {n} processes", statistics.median(times), tokens * n, flops, peak,
                       processes=n, batch=s["batch_size"], seq_len=s["seq_len"],
                       steps_timed=len(times)))  # fmt: skip


# --------------------------------------------------------------------------------------------- calibration


def _selected(label: str, steps: list[str]) -> bool:
    return any(label.startswith(prefix) for prefix in steps)


def plan_calibration(settings: dict) -> list[str]:
    import importlib

    from hf_attn.conversion.calibration import default_calibration_files
    from hf_attn.eval.bench import scale, synthetic

    s = settings
    if s["shape"] not in synthetic.SHAPES:
        raise ValueError(f"calibration.shape: unknown {s['shape']!r}; choose from {sorted(synthetic.SHAPES)}")
    if s["calibration_tokens"] < 1:
        raise ValueError(f"calibration.calibration_tokens must be positive, got {s['calibration_tokens']}")
    default_calibration_files()  # the synthetic tokenizer is trained on it
    lines = []
    device = ["--device", "cuda"]
    for label, module, args in scale.plan(
        s["shape"], calibration=["--calibration-tokens", "8"], device_args=device
    ):
        if _selected(label, s["steps"]):
            parser = getattr(importlib.import_module(module), "build_parser", None)
            if parser is not None:
                parser().parse_args(["--model", "M", "--output", "O", *args])
            lines.append(f"{label}: python -m {module} {' '.join(args)}")
    if "refine" in s["steps"]:
        from hf_attn.conversion import refine

        refine.build_parser().parse_args(["--model", "M", "--source", "S", "--output", "O", "--steps", "1",
                                          "--calibration-tokens", "8", "--no-progress", *device])  # fmt: skip
        lines.append("refine: gqa mean, then python -m hf_attn.conversion.refine --steps 1 --device cuda")
    if not lines:
        raise ValueError(
            f"calibration.steps {s['steps']} select nothing; use 'gqa calibrated', 'mla', 'refine'"
        )
    dims = synthetic.SHAPES[s["shape"]]
    gb = 2 * sum(math.prod(size) for _, size in synthetic.tensor_shapes(dims)) / 1e9
    return [f"synthetic {s['shape']} source, {gb:.1f} GB bf16"] + lines


def _scale_row(r, shape: str) -> dict:
    ref = next(
        (v for (sh, prefix), v in CPU_REFERENCE.items() if sh == shape and r.converter.startswith(prefix)),
        None,
    )
    return dict(
        converter=r.converter, status=r.status + (f": {r.note}" if r.note else ""), wall_s=r.wall_s,
        peak_rss_gib=r.peak_rss_bytes / 2**30 if r.peak_rss_bytes else None,
        peak_gpu_gib=r.extra["cuda_peak_bytes"] / 2**30 if "cuda_peak_bytes" in r.extra else None,
        cpu_rss_gib=ref[0] if ref else None, cpu_wall_s=ref[1] if ref else None,
        speedup=ref[1] / r.wall_s if ref and r.wall_s and r.status == "ok" else None, command=r.command,
    )  # fmt: skip


def run_calibration(settings: dict, emit) -> None:
    from hf_attn.eval.bench import scale, synthetic

    if not torch.cuda.is_available():
        raise RuntimeError("calibration needs a CUDA GPU")
    s, shape = settings, settings["shape"]
    work = Path(tempfile.mkdtemp(prefix="hf-attn-gpu-calibration-", dir=s["workdir"]))
    emit(meta={"device": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "workdir": str(work)})
    try:
        src = work / f"{shape}-source"
        start = time.perf_counter()
        synthetic.write_synthetic(src, shape=shape, progress=False)
        emit(
            dict(
                converter="write synthetic source", status="ok", wall_s=round(time.perf_counter() - start, 1)
            )
        )
        calibration = ["--calibration-tokens", str(s["calibration_tokens"])]
        for label, module, args in scale.plan(
            shape, calibration=calibration, device_args=["--device", "cuda"]
        ):
            if _selected(label, s["steps"]):
                dst = work / f"{shape}-out"
                r = scale.run_step(shape=shape, converter=label, module=module, device="cuda", keep=False,
                                   args=["--model", str(src), "--output", str(dst), *args],
                                   src=src, dst=dst)  # fmt: skip
                emit(_scale_row(r, shape))
        if "refine" in s["steps"]:
            for r in scale.refine_rows(shape, src=src, workdir=work, device="cuda", rss_limit=None):
                emit(_scale_row(r, shape))
    finally:
        shutil.rmtree(work, ignore_errors=True)


ADAPTERS = {
    "model-decode": Adapter(
        defaults=dict(contexts=[1024, 4096, 16384], new_tokens=32, kv_lora_rank=120, rope_pairs=12),
        columns=(
            ("context", "context", "d"),
            ("absorbed tok/s", "absorbed_tps", ".1f"),
            ("expanded tok/s", "expanded_tps", ".1f"),
            ("source GQA (sdpa) tok/s", "source_tps", ".1f"),
            ("absorbed / expanded", "absorbed_vs_expanded", ".2f"),
            ("absorbed / source", "absorbed_vs_source", ".2f"),
        ),  # fmt: skip
        plan=plan_decode,
        run=run_decode,
    ),
    "heal": Adapter(
        defaults=dict(steps=10, seq_len=1024, batch_size=8),
        columns=(
            ("mode", "mode", ""),
            ("batch", "batch", "d"),
            ("seq", "seq_len", "d"),
            ("s/step", "seconds_per_step", ".3f"),
            ("tokens/s", "tokens_per_s", ".0f"),
            ("MFU % (fp32 peak)", "mfu_pct", ".1f"),
            ("note", "note", ""),
        ),  # fmt: skip
        plan=plan_heal,
        run=run_heal,
        extra_keys=("processes", "steps_timed"),
    ),
    "calibration": Adapter(
        defaults=dict(
            shape="llama-3-8b",
            calibration_tokens=256,
            steps=["gqa calibrated", "mla", "refine"],
            workdir=None,
        ),  # fmt: skip
        columns=(
            ("step", "converter", ""),
            ("status", "status", ""),
            ("GPU wall s", "wall_s", ".0f"),
            ("peak RSS GiB", "peak_rss_gib", ".2f"),
            ("peak GPU GiB", "peak_gpu_gib", ".2f"),
            ("CPU wall s (README)", "cpu_wall_s", ".0f"),
            ("CPU RSS GiB (README)", "cpu_rss_gib", ".2f"),
            ("x CPU", "speedup", ".1f"),
        ),  # fmt: skip
        plan=plan_calibration,
        run=run_calibration,
        extra_keys=("command",),
    ),
}
