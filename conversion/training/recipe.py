"""Healing, the recipe: the frozen `HealRecipe` a run and its checkpoints agree on, the step budget and the
learning-rate schedule, the trainable parameters, the state directory's checkpoints, the RNG state and the
JSON-lines log, and the model as healing loads it."""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hf_attn.tooling import loading

TRAINABLE = ("all", "attention")
SCHEDULES = ("cosine", "constant")
CLOCKS = ("wall", "cpu")  # what --max-minutes counts: wall-clock or process CPU time, of training steps only
PRECISIONS = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}  # --autocast-dtype -> mixed_precision
DEFAULT_TRAIN_CORPUS = "mix"  # the five non-eval novels and five documentation sections (docs/healing.md)
DEFAULT_LR = 3e-5  # with DEFAULT_TRAIN_CORPUS: improves refined MQA and MLA on both evaluation texts
DEFAULT_MAX_STEPS = 100  # when no budget is given: a short control run (100 steps of --seq-len tokens)
# Distillation (--teacher): the one home of its defaults, measured in docs/healing.md ("With a teacher").
DEFAULT_TEACHER = "none"
DEFAULT_DISTILL_WEIGHT = 0.5  # w in w x KL + (1 - w) x next-token cross-entropy
DEFAULT_DISTILL_TEMPERATURE = 1.0
MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak
ATTENTION_MARKER = ".self_attn."
STATE_FILE = "trainer_state.pt"
LOG_FILE = "log.jsonl"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
FSDP_CONFIG = Path(__file__).parent / "heal_fsdp.yaml"  # accelerate launch --config_file FSDP_CONFIG ...


@dataclass(frozen=True)
class StepDefaults:
    """What `hf-attn heal` trains, on what length, at what rate, when --trainable, --seq-len and --lr are
    left out: chosen per kind of checkpoint (`checkpoint_kind`), measured in docs/research/distillation.md."""

    trainable: str
    seq_len: int
    lr: float


STEP_DEFAULTS = {
    # MLA keeps a few RoPE pairs, so positions past 512 matter to it: both layouts heal on the evaluation's
    # 1,024-token window. A per-head conversion heals its attention alone at half the rate, which repaired
    # more on both texts at 1.75, 5 and 10 CPU-minutes (MLA 50% and 30%); the DeepSeek layout (and its
    # export) every parameter at the general rate, which repaired more there.
    "mla-per-head": StepDefaults("attention", 1024, 1.5e-5),
    "mla-deepseek": StepDefaults("all", 1024, DEFAULT_LR),
    # pooled KV heads (`hf-attn convert gqa`) keep every RoPE pair; far from its source, MQA repaired more on
    # both texts at 1e-4 than at 3e-5 (at 17 and at 72 steps)
    "gqa": StepDefaults("all", 512, 1e-4),
    # everything else: an unconverted model, an exact expansion, any LoRA run
    "other": StepDefaults("all", 512, DEFAULT_LR),
}


def checkpoint_kind(config: dict) -> str:
    """The key of `STEP_DEFAULTS` for a checkpoint's config.json (and its conversion record)."""
    model_type = config.get("model_type")
    if model_type == "llama_mla":
        return "mla-per-head" if config.get("rope_layout", "per_head") == "per_head" else "mla-deepseek"
    if model_type == "deepseek_v3":
        return "mla-deepseek"
    history = (config.get("hf_attn") or {}).get("history") or []
    return "gqa" if any(record.get("kind") == "gqa" for record in history) else "other"


@dataclass(frozen=True)
class HealRecipe:
    """Everything that decides the trajectory; a resumed run must have the same recipe."""

    seq_len: int
    batch_size: int  # chunks per process per micro-step
    grad_accum: int
    num_processes: int
    lr: float
    warmup_steps: int
    schedule: str
    total_steps: int | None  # None: a time budget only (then the schedule is constant)
    weight_decay: float
    max_grad_norm: float | None
    trainable: str
    autocast_dtype: str  # compute precision; master weights stay float32
    seed: int
    train_sha256: str
    source_hash: str
    relative_lr: float | None = None  # set: each tensor's peak lr is this x its RMS, and `lr` is unused
    teacher_hash: str | None = None  # the teacher's weights (checkpoint_hash); None: next-token labels only
    distill_temperature: float | None = None  # (with a teacher)
    distill_weight: float | None = None  # (with a teacher) w in w x KL + (1 - w) x cross-entropy
    lora_rank: int | None = None  # set: only LoRA adapters of this rank train (peft), merged on save
    lora_targets: str | None = None  # (with lora_rank) the adapted modules' names, comma-separated

    @property
    def global_batch(self) -> int:
        """Chunks per optimizer step over all processes."""
        return self.batch_size * self.num_processes * self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, cosine or flat."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        assert self.total_steps is not None
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    def mismatch(self, other: dict) -> list[str]:
        """Fields that differ from a saved recipe (as `asdict`), formatted `name: saved -> now`.

        With a constant schedule the step budget changes nothing before it is reached, so it may grow."""
        mine = asdict(self)
        other = {("autocast_dtype" if k == "dtype" else k): v for k, v in other.items()}  # (older states)
        free = {"total_steps"} if self.schedule == other.get("schedule") == "constant" else set()
        return [
            f"{k}: {other.get(k)!r} -> {v!r}" for k, v in mine.items() if other.get(k) != v and k not in free
        ]


def check_positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value < float("inf")  # (NaN fails the comparison below)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        flag = "--" + name.replace("_", "-")
        raise ValueError(
            f"{flag} must be {'>= 0' if allow_zero else 'positive'}, got {value!r} (a finite number)"
        )


def plan_budget(
    *, max_steps: int | None, max_tokens: int | None, max_minutes: float | None, tokens_per_step: int
) -> int | None:
    """Optimizer steps the run may take (None: only a time limit). No budget at all -> DEFAULT_MAX_STEPS."""
    if max_steps is None and max_tokens is None and max_minutes is None:
        return DEFAULT_MAX_STEPS
    limits = [max_steps] if max_steps is not None else []
    if max_tokens is not None:
        limits.append(max(1, math.ceil(max_tokens / tokens_per_step)))
    return min(limits) if limits else None


def resolve_schedule(schedule: str | None, total_steps: int | None) -> str:
    if schedule is None:
        return "cosine" if total_steps is not None else "constant"
    if schedule == "cosine" and total_steps is None:
        raise ValueError(
            "--schedule cosine needs a step budget (--max-steps or --max-tokens); with only --max-minutes "
            "use --schedule constant"
        )
    return schedule


def select_trainable(model: torch.nn.Module, trainable: str) -> list[str]:
    """requires_grad on every parameter (`all`) or on `*.self_attn.*` ones (`attention`); returns names.
    (`trainable` is validated with the settings: `HealSettings.validate`.)"""
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(trainable == "all" or ATTENTION_MARKER in f".{name}")
        if p.requires_grad:
            names.append(name)
    if not names:
        raise ValueError(
            f"--trainable {trainable} selects no parameter of {type(model).__name__} (no '*.self_attn.*' "
            "parameters); use --trainable all"
        )
    return names


def default_state_dir(output: Path) -> Path:
    return output.with_name(f"{output.name}.heal")


def check_writable(directory: Path, what: str) -> None:
    """Create `directory` if needed and prove it writable by creating a file in it (works for root too)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"{what} {directory} is not writable ({err.strerror or err}); choose another path"
        ) from err


def find_checkpoints(state_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (step, dir), oldest first; temp directories of interrupted writes are ignored."""
    paths = state_dir.iterdir() if state_dir.is_dir() else ()
    matches = ((_CHECKPOINT_RE.match(p.name), p) for p in paths)
    return sorted((int(m.group(1)), p) for m, p in matches if m and (p / STATE_FILE).is_file())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class JsonLog:
    """Append-only JSON-lines log, written by the main process only (others hold a disabled one)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (those a killed run logged past its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [entry for entry in read_log(self.path) if entry.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(entry) + "\n" for entry in keep))

    def write(self, **entry) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


def read_log(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_model(
    path: Path,
    *,
    attn_implementation: str | None,
    trust_remote_code: bool,
    gradient_checkpointing: bool,
    dtype: torch.dtype = torch.float32,
):
    """The checkpoint in train mode, as float32 master weights (or `dtype`)."""
    options = {"attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    model = loading.load_causal_lm(path, dtype=dtype, **options)
    if gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ValueError(f"{type(model).__name__} does not support --gradient-checkpointing")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype a checkpoint's config.json declares (the output is written in it); float32 if none."""
    config = loading.read_config(model_dir)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
