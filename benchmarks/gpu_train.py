"""`python -m benchmarks.gpu` parts that train: heal (one GPU) and fsdp.

heal: on SmolLM2's config with random weights (the 517 MB weights do not travel), `benchmarks/heal.throughput`
(`hf-attn heal` against a bare PyTorch loop doing the same steps), then `hf-attn heal --teacher DIR` with a
second random SmolLM2 as the frozen teacher (KL to its logits): what distilling costs per step.
fsdp: `hf-attn heal` under `accelerate launch` with the shipped FSDP config, one process per GPU present.
heal-lora: peak GPU memory of `hf-attn heal --lora-rank R` (fp32 master weights) on the synthetic
Llama-3-8B checkpoint of benchmarks/synthetic.py at full depth, alone and with the same checkpoint as a frozen
bf16 teacher (`--teacher DIR`): what LoRA healing of an 8B model needs. The healed output is not written (the
write is a stub in the part's own process): the part measures training, and a 16 GB write would take minutes.
Tokens/s from the median step; model FLOPs utilisation = FLOPs per token x tokens/s over the GPU's dense fp32
peak (heal trains in fp32 by default; no TF32), FLOPs per token = 6 N + 12 L Hq d T (PaLM's count) for the
student, plus 2 N + 4 L Hq d T for a teacher's forward.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_parts import Adapter

SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# Dense fp32 (non-tensor-core) peak TFLOPS by device name, longest match first (vendor data sheets)
FP32_PEAK_TFLOPS = (("H100 PCIe", 51.2), ("H100 NVL", 60.0), ("H100", 66.9), ("H200", 66.9), ("A100", 19.5))


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


# --------------------------------------------------------------------------------------------- heal


def fsdp_argv(settings: dict, *, model: str, output: str, state: str, text: str, processes: int) -> list[str]:
    """`accelerate launch` of `hf-attn heal` with the shipped FSDP config (heal_fsdp.yaml)."""
    from hf_attn.conversion.training.recipe import FSDP_CONFIG

    heal_args = ["--model", model, "--output", output, "--state-dir", state, "--train-text", text,
                 "--max-steps", str(settings["steps"]), "--seq-len", str(settings["seq_len"]),
                 "--batch-size", str(settings["batch_size"]), "--eval-tokens", "0", "--schedule", "constant",
                 "--overwrite", "--no-progress"]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
              "--num_processes", str(processes), "-m", "hf_attn.conversion.training"]  # fmt: skip
    return launch + heal_args


def _check(settings: dict) -> None:
    if min(settings["steps"], settings["seq_len"], settings["batch_size"]) < 1 or settings["steps"] <= 2:
        raise ValueError("steps must be > 2 (two warm-up steps are not timed), seq_len and batch_size >= 1")


def plan_heal(settings: dict) -> list[str]:
    import dataclasses
    import inspect

    from benchmarks import heal as bench_heal
    from hf_attn.conversion.training.data import HealSettings

    _check(settings)
    smollm2_source()
    wanted = {"model", "steps", "rounds", "seq_len", "batch_size"}
    if wanted - set(inspect.signature(bench_heal.throughput).parameters):
        raise ValueError(f"benchmarks/heal.throughput no longer takes {sorted(wanted)}")
    if "teacher" not in {f.name for f in dataclasses.fields(HealSettings)}:
        raise ValueError("hf-attn heal has no --teacher")
    s = settings
    return [f"heal, bare loop, heal --teacher: {s['steps']} steps of {s['batch_size']} x {s['seq_len']}"]


def plan_fsdp(settings: dict) -> list[str]:
    from hf_attn.conversion.training import heal
    from hf_attn.tooling import assets

    _check(settings)
    smollm2_source()
    text = str(assets.austen_file("northangerabbey"))
    argv = fsdp_argv(settings, model="M", output="O", state="S", text=text, processes=1)
    heal.build_parser().parse_args(argv[argv.index("hf_attn.conversion.training") + 1 :])  # flags still exist
    if not Path(heal.FSDP_CONFIG).is_file():
        raise OSError(f"{heal.FSDP_CONFIG} is missing")
    return ["accelerate launch " + " ".join(argv[3:9])]


def flops_per_token(model_dir: Path, seq_len: int, *, passes: int = 3) -> float:
    """2 passes (N + 2 L Hq d T) FLOPs per token at context T: passes 3 (forward and backward) is PaLM's
    6 N + 12 L Hq d T of training, 1 a forward alone (a teacher's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * passes * (n + 2 * config.num_hidden_layers * config.num_attention_heads * d * seq_len)


def fp32_peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in FP32_PEAK_TFLOPS if key in name), None)


def _heal_row(mode: str, seconds: float, tokens: int, flops: float, peak: float | None, **extra) -> dict:
    tps = tokens / seconds
    return dict(mode=mode, seconds_per_step=seconds, tokens_per_s=tps,
                mfu_pct=100 * tps * flops / peak if peak else None, **extra)  # fmt: skip


def heal_teacher_seconds(model: Path, teacher: Path, out: Path, settings: dict) -> float:
    """Median seconds per step (the first two left out) of `hf-attn heal --teacher TEACHER` on `model`."""
    from hf_attn.conversion.training.data import HealSettings
    from hf_attn.conversion.training.heal import heal
    from hf_attn.conversion.training.recipe import read_log
    from hf_attn.tooling import assets

    s, text = settings, str(assets.austen_file("northangerabbey"))
    run = HealSettings(model=str(model), output=str(out), train_text=[text], max_steps=s["steps"],
                       seq_len=s["seq_len"], batch_size=s["batch_size"], schedule="constant", eval_tokens=0,
                       overwrite=True, teacher=str(teacher))  # fmt: skip
    result = heal(run, progress=False)
    return statistics.median([e["step_seconds"] for e in read_log(result["log"]) if e["event"] == "step"][2:])


def run_heal(settings: dict, emit) -> None:
    from benchmarks import heal as bench_heal

    if not torch.cuda.is_available():
        raise RuntimeError("heal needs a CUDA GPU")
    s, peak = settings, fp32_peak_flops()
    with tempfile.TemporaryDirectory(prefix="hf-attn-gpu-heal-") as tmp:
        model = random_smollm2(Path(tmp) / "smollm2-random")
        flops, teacher = flops_per_token(model, s["seq_len"]), flops_per_token(model, s["seq_len"], passes=1)
        emit(meta={"device": torch.cuda.get_device_name(), "fp32_peak_flops": peak, "flops_per_token": flops})
        tokens = s["seq_len"] * s["batch_size"]
        shape = dict(processes=1, batch=s["batch_size"], seq_len=s["seq_len"], steps_timed=s["steps"] - 2)
        r = bench_heal.throughput(model=str(model), steps=s["steps"], rounds=1, seq_len=s["seq_len"],
                                  batch_size=s["batch_size"])  # fmt: skip
        emit(_heal_row("bare PyTorch loop", r["bare_seconds_per_step"], tokens, flops, peak, **shape))
        emit(_heal_row("hf-attn heal", r["heal_seconds_per_step"], tokens, flops, peak, **shape))
        other = random_smollm2(Path(tmp) / "teacher", seed=1)  # the teacher: same shape and vocabulary
        seconds = heal_teacher_seconds(model, other, Path(tmp) / "healed", s)
        emit(_heal_row("hf-attn heal --teacher DIR", seconds, tokens, flops + teacher, peak, **shape))


def run_fsdp(settings: dict, emit) -> None:
    from hf_attn.conversion.training.recipe import LOG_FILE
    from hf_attn.tooling import assets

    if not torch.cuda.is_available():
        raise RuntimeError("fsdp needs a CUDA GPU")
    s, peak, n = settings, fp32_peak_flops(), torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="hf-attn-gpu-fsdp-") as tmp:
        model = random_smollm2(Path(tmp) / "smollm2-random")
        flops = flops_per_token(model, s["seq_len"])
        emit(meta={"device": torch.cuda.get_device_name(), "gpus": n, "fp32_peak_flops": peak})
        out, state = Path(tmp) / "fsdp-out", Path(tmp) / "fsdp-state"
        text = str(assets.austen_file("northangerabbey"))
        argv = fsdp_argv(s, model=str(model), output=str(out), state=str(state), text=text, processes=n)
        proc = subprocess.run(argv, capture_output=True, text=True)
        log = state / LOG_FILE
        steps = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
        times = [e["step_seconds"] for e in steps if e.get("event") == "step"][2:]
        if proc.returncode != 0 or not times:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            emit(dict(mode=f"FSDP, {n} processes", processes=n, note=f"exit {proc.returncode}: {tail}"))
            raise RuntimeError(f"FSDP heal exit {proc.returncode}: {tail}")
        emit(_heal_row(f"FSDP, {n} processes", statistics.median(times), s["seq_len"] * s["batch_size"] * n,
                       flops, peak * n if peak else None, processes=n, batch=s["batch_size"],
                       seq_len=s["seq_len"], steps_timed=len(times)))  # fmt: skip


def plan_heal_lora(settings: dict) -> list[str]:
    import dataclasses

    from benchmarks.synthetic import SHAPES
    from hf_attn.conversion.training import heal

    s = settings
    if s["shape"] not in SHAPES:
        raise ValueError(f"shape {s['shape']!r}: choose one of {sorted(SHAPES)}")
    if min(s["layers"], s["lora_rank"], s["seq_len"]) < 1 or s["steps"] <= 2:
        raise ValueError("layers, lora_rank and seq_len must be >= 1, steps > 2")
    if not {"lora_rank", "teacher"} <= {f.name for f in dataclasses.fields(heal.HealSettings)}:
        raise ValueError("hf-attn heal has no --lora-rank or --teacher")
    if not callable(getattr(heal, "write_output", None)):
        raise ValueError("hf_attn.conversion.training.heal no longer calls write_output")
    smollm2_source()
    return [f"{s['shape']}, {s['layers']} layers: heal --lora-rank {s['lora_rank']}, then with --teacher DIR"]


def lora_heal_peak(model: Path, out: Path, settings: dict, *, teacher: Path | None = None) -> dict:
    """One `hf-attn heal --lora-rank R` run of `model` in this process, its output write stubbed out: the
    peak GPU memory of the run (max_memory_allocated, None on the CPU), seconds per step (median, the first
    two left out), trainable parameters and the run's wall seconds (loading included)."""
    from hf_attn.conversion.training import heal
    from hf_attn.conversion.training.recipe import read_log
    from hf_attn.tooling import assets

    s, cuda, text = settings, torch.cuda.is_available(), str(assets.austen_file("northangerabbey"))
    run = heal.HealSettings(model=str(model), output=str(out), train_text=[text],
                            max_steps=s["steps"], seq_len=s["seq_len"], lora_rank=s["lora_rank"],
                            schedule="constant", eval_tokens=0, overwrite=True,
                            teacher=str(teacher) if teacher else "none")  # fmt: skip
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    original, start = heal.write_output, time.perf_counter()
    heal.write_output = lambda *args, **kwargs: None  # training is measured, not the 32 GB write
    try:
        result = heal.heal(run, progress=False)
    finally:
        heal.write_output = original
    log = read_log(result["log"])
    steps = [e["step_seconds"] for e in log if e["event"] == "step"][2:]
    trainable = next(e["trainable_parameters"] for e in log if e["event"] == "start")
    return dict(peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                seconds_per_step=statistics.median(steps), wall_s=time.perf_counter() - start,
                trainable_m=trainable / 1e6)  # fmt: skip


def run_heal_lora(settings: dict, emit) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.synthetic import SHAPES, write_synthetic

    if not torch.cuda.is_available():
        raise RuntimeError("heal-lora needs a CUDA GPU")
    s = settings
    shape = {**SHAPES[s["shape"]], "num_hidden_layers": s["layers"]}
    with tempfile.TemporaryDirectory(prefix="hf-attn-gpu-lora-") as tmp:
        start = time.perf_counter()
        model = write_synthetic(Path(tmp) / "source", shape=shape, progress=False)
        with torch.device("meta"):
            n = sum(
                p.numel()
                for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
            )
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        emit(meta={"device": torch.cuda.get_device_name(), "write_s": time.perf_counter() - start,
                   "parameters_b": n / 1e9, "total_gib": total_gib})  # fmt: skip
        row = dict(shape=s["shape"], layers=s["layers"], parameters_b=n / 1e9, seq_len=s["seq_len"])
        r = lora_heal_peak(model, Path(tmp) / "healed", s)
        emit(dict(mode=f"LoRA r{s['lora_rank']}, fp32", **row, **r))
        r = lora_heal_peak(model, Path(tmp) / "healed-teacher", s, teacher=model)
        emit(dict(mode=f"LoRA r{s['lora_rank']}, fp32, + bf16 teacher", **row, **r))


_COLUMNS = (
    ("mode", "mode", ""), ("batch", "batch", "d"), ("seq", "seq_len", "d"),
    ("s/step", "seconds_per_step", ".3f"), ("tokens/s", "tokens_per_s", ".0f"),
    ("MFU % (fp32 peak)", "mfu_pct", ".1f"), ("note", "note", ""),
)  # fmt: skip
_DEFAULTS = dict(steps=10, seq_len=1024, batch_size=8)
ADAPTERS = {
    "heal": Adapter(defaults=_DEFAULTS, columns=_COLUMNS, plan=plan_heal, run=run_heal,
                    extra_keys=("processes", "steps_timed")),
    "fsdp": Adapter(defaults=_DEFAULTS, columns=_COLUMNS, plan=plan_fsdp, run=run_fsdp,
                    extra_keys=("processes", "steps_timed")),
    "heal-lora": Adapter(defaults=dict(shape="llama-3-8b", layers=32, lora_rank=16, seq_len=512, steps=4),
                         columns=(("mode", "mode", ""), ("shape", "shape", ""), ("layers", "layers", "d"),
                                  ("parameters B", "parameters_b", ".2f"),
                                  ("trainable M", "trainable_m", ".1f"),
                                  ("seq", "seq_len", "d"), ("peak GPU GiB", "peak_gib", ".2f"),
                                  ("s/step", "seconds_per_step", ".3f"), ("run s", "wall_s", ".0f")),
                         plan=plan_heal_lora, run=run_heal_lora),
}  # fmt: skip
