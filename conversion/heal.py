"""Healing: a short uptraining of a converted checkpoint (causal-LM loss on held-apart text), with accelerate.

The GQA paper uptrains pooled checkpoints for a small fraction of pre-training compute; MHA2MLA and TransMLA
fine-tune after conversion too. This module does that step for any `AutoModelForCausalLM` checkpoint (pooled
GQA/MQA Llama-family, the `llama_mla` model type, remote-code models with `trust_remote_code`).

Recipe: the training text is tokenized once and cut into `seq_len` chunks (`conversion.train_data`), visited
in a seeded order; AdamW on the chosen parameters (`all`, or `attention` = every `*.self_attn.*` parameter),
linear warmup then cosine (to 10% of the peak) or constant learning rate, gradient clipping, optional gradient
accumulation, gradient checkpointing and bf16/fp16 autocast. Data parallel through `accelerate.Accelerator`:
process p of P takes every P-th batch and gradients are averaged, so `batch_size x P x grad_accum` chunks make
one optimizer step whatever P is (the same global batch gives the same run on one or many processes).

Evaluation: held-out perplexity with the project's protocol (`hf_attn.tooling.perplexity.evaluate_perplexity`,
disjoint windows of `eval_context` tokens over the first `eval_tokens` tokens) before, every `eval_every`
steps, and after. Training and evaluation text must not overlap (`train_data.check_disjoint`).

Interruption: every `checkpoint_every` steps an atomic checkpoint `STATE/checkpoint-NNNNNN/` is written: the
model in `save_pretrained` format (loadable as is) plus `trainer_state.pt` (optimizer, scheduler, the RNG of
every process, data position, progress). `resume=True` continues from the newest complete one with the same
data order and optimizer state: the losses are those of an uninterrupted run. `STATE` defaults to
`OUTPUT.heal/` and also holds the JSON-lines log `log.jsonl` (one line per step, evaluation, checkpoint).

Output: the healed model in the input's format (same config and model type, weights in the input's dtype,
side files such as the tokenizer copied), written atomically, never over or inside its source
(`hf_attn.tooling.files.check_output`, checked before training); the run is appended to
`config.json["hf_attn"]["history"]` (`conversion.checkpoint.conversion_record`, kind `heal`).

Code: `HealSettings` (every option; the command line is built from it) -> `load_data` -> `make_recipe` ->
`find_resume_point` / `build_train_state` (`TrainState.save` / `restore`) -> `train_steps` (with the
`held_out_evaluation` hook) -> `write_output`; `heal()` strings them together.

    hf-attn heal --model SRC --output DST [--train-text FILE ... | --train-corpus mix | --dataset NAME ...]
        [--max-steps N | --max-tokens N | --max-minutes M [--budget-clock wall|cpu]] [--seq-len 512]
        [--batch-size 1] [--grad-accum 1]
        [--lr 1e-4 | --relative-lr R] [--warmup-steps 0] [--schedule cosine|constant]
        [--trainable all|attention]
        [--autocast-dtype float32|bfloat16|float16] [--eval-text FILE ...] [--eval-every S]
        [--eval-tokens 8192] [--checkpoint-every N] [--resume] [--seed 0] [--gradient-checkpointing]
        [--overwrite]
    accelerate launch --multi_gpu --num_processes 2 -m conversion.heal ...   # data parallel (CPU: gloo)
    accelerate launch --config_file FSDP_CONFIG --num_processes N -m hf_attn.conversion.heal ...   # FSDP2

Sharded training (FSDP, `FSDP_CONFIG` = heal_fsdp.yaml beside this file; docs/heal-fsdp.md): the optimizer
is prepared together with the model (FSDP2 re-points it at the sharded parameters; FSDP1 gets it built
after the model is wrapped), clipping goes through `accelerator.clip_grad_norm_`, every checkpoint and the
output hold the FULL state dict gathered to the main process (`accelerator.get_state_dict`, the optimizer
via `torch.distributed.checkpoint.state_dict` with full state dicts), so they are the same files as without
sharding; held-out evaluation runs every window on every process (a sharded forward is collective).
Precision under FSDP2 is accelerate's: `--autocast-dtype bfloat16` becomes FSDP2's MixedPrecisionPolicy
(parameters all-gathered, outputs and gradient reductions in bfloat16, float32 sharded master weights), not
autocast: a different rounding from the unsharded runs (docs/heal-fsdp.md).
accelerate does not enable FSDP on CPU; with an FSDP config, several processes and no accelerator device,
`make_accelerator` switches its state to FSDP2 itself (fully_shard over gloo), which is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import hf_attn  # noqa: F401  (registers the hf-attn attention implementations and the llama_mla model type)
from hf_attn.conversion.checkpoint import (
    add_record,
    conversion_record,
    copy_side_files,
    read_config,
    write_config,
)
from hf_attn.conversion.refine import param_groups
from hf_attn.conversion.train_data import (
    check_disjoint,
    check_not_embedded_eval,
    chunk_tokens,
    load_eval_corpus,
    load_train_corpus,
    make_loader,
)
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import (
    USER_ERRORS,
    add_settings_arguments,
    check_choices,
    error,
    one_line,
    setting,
    settings_from_args,
)
from hf_attn.tooling.corpus import Corpus, tokenize
from hf_attn.tooling.files import atomic_directory, check_output, checkpoint_hash
from hf_attn.tooling.loading import resolve_model
from hf_attn.tooling.perplexity import check_window, evaluate_perplexity

PROG = "hf-attn heal"

TRAINABLE = ("all", "attention")
SCHEDULES = ("cosine", "constant")
CLOCKS = ("wall", "cpu")  # what --max-minutes counts: wall-clock or process CPU time, of training steps only
PRECISIONS = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}  # --autocast-dtype -> mixed_precision
DEFAULT_MAX_STEPS = 100  # when no budget is given: a short control run (100 steps of --seq-len tokens)
MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak
ATTENTION_MARKER = ".self_attn."
STATE_FILE = "trainer_state.pt"
LOG_FILE = "log.jsonl"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
FSDP_CONFIG = Path(__file__).with_name("heal_fsdp.yaml")  # accelerate launch --config_file FSDP_CONFIG ...


# --------------------------------------------------------------------------------------------- recipe


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


def _positive(name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")


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
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule == "cosine" and total_steps is None:
        raise ValueError(
            "--schedule cosine needs a step budget (--max-steps or --max-tokens); with only --max-minutes "
            "use --schedule constant"
        )
    return schedule


def select_trainable(model: torch.nn.Module, trainable: str) -> list[str]:
    """requires_grad on every parameter (`all`) or on `*.self_attn.*` ones (`attention`); returns names.
    (`trainable` is validated with the settings: `HealSettings.validate`.)"""
    assert trainable in TRAINABLE, trainable
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


# --------------------------------------------------------------------------------------------- paths


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
    if not state_dir.is_dir():
        return []
    found = []
    for path in state_dir.iterdir():
        m = _CHECKPOINT_RE.match(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


# --------------------------------------------------------------------------------------------- RNG + log


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
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in keep))

    def write(self, **entry) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


def read_log(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------- model


def load_model(
    path: Path, *, attn_implementation: str | None, trust_remote_code: bool, gradient_checkpointing: bool
):
    """The checkpoint as float32 master weights, in train mode."""
    model = loading.load_causal_lm(
        path,
        attn_implementation=attn_implementation,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
    )
    if gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ValueError(f"{type(model).__name__} does not support --gradient-checkpointing")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype a checkpoint's config.json declares (the output is written in it); float32 if none."""
    config = read_config(model_dir)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _lm_forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch of chunks (B, L) (the model shifts the labels itself)."""
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class HealSettings:
    """Every option of a healing run; `hf-attn heal`'s flags are built from these fields (`--field-name`)."""

    output: str = setting(help="directory of the healed checkpoint", required=True)
    model: str | None = setting(None, "checkpoint directory or hub id (default: the embedded SmolLM2)")
    train_text: list[str] | None = setting(
        None, "training text files (default: --train-corpus austen)", metavar="FILE", exclusive="train source"
    )
    train_corpus: str | None = setting(
        None,
        "an embedded training corpus: austen (the five non-eval novels, the default), python-docs (five "
        "sections, not the FAQ) or mix (both)",
        choices=assets.CORPORA,
        exclusive="train source",
    )
    dataset: str | None = setting(
        None, "datasets id of the training text, e.g. wikitext", exclusive="train source"
    )
    dataset_config: str | None = setting(None)
    dataset_split: str = setting("train")
    text_column: str = setting("text")
    eval_text: list[str] | None = setting(None, "default: Persuasion", metavar="FILE")
    max_steps: int | None = setting(None, f"default {DEFAULT_MAX_STEPS} if no budget is given")
    max_tokens: int | None = setting(None, "training tokens (rounded up to whole steps)")
    max_minutes: float | None = setting(None, "training time, evaluation excluded")
    budget_clock: str = setting(
        "wall",
        "what --max-minutes counts: wall (default) or cpu (process CPU time: fair on a shared machine)",
        choices=CLOCKS,
    )
    seq_len: int = setting(512)
    batch_size: int = setting(1, "chunks per process per micro-step")
    grad_accum: int = setting(1)
    lr: float = setting(1e-4, "peak learning rate of every tensor", exclusive="learning rate")
    relative_lr: float | None = setting(
        None,
        "each tensor's peak lr as this fraction of its RMS at the start, instead of one --lr (as hf-attn "
        "refine: a converted model's latent factors differ a hundredfold in scale)",
        exclusive="learning rate",
    )
    warmup_steps: int = setting(0)
    schedule: str | None = setting(
        None, "default: cosine with a step budget, else constant", choices=SCHEDULES
    )
    weight_decay: float = setting(0.0)
    max_grad_norm: float | None = setting(1.0, "0 disables clipping")
    trainable: str = setting("all", "attention: only *.self_attn.* parameters", choices=TRAINABLE)
    autocast_dtype: str = setting(
        "float32",
        "training compute precision (autocast; master weights stay float32, the output keeps the input's "
        "dtype)",
        choices=tuple(PRECISIONS),
        deprecated_flags=("--dtype",),
    )
    attn_implementation: str | None = setting(None)
    trust_remote_code: bool = setting(False)
    eval_every: int = setting(0, "held-out perplexity every S steps (0: off)")
    eval_tokens: int = setting(8192, "first N tokens of the eval text (0: no eval)")
    eval_context: int = setting(1024, "window length (disjoint windows)")
    checkpoint_every: int = setting(0, "atomic resumable checkpoint every N steps")
    state_dir: str | None = setting(None, "checkpoints + log.jsonl (default: OUTPUT.heal)")
    keep_checkpoints: bool = setting(False, "end with a checkpoint (resume later with a larger budget)")
    resume: bool = setting(False, "continue from the newest checkpoint in the state dir")
    seed: int = setting(0)
    gradient_checkpointing: bool = setting(False)
    overwrite: bool = setting(False)

    def validate(self) -> None:
        """ValueError for a bad value (cheap: before any loading)."""
        check_choices(self)
        for name in ("seq_len", "batch_size", "grad_accum", "lr"):
            _positive(name, getattr(self, name))
        for name in ("max_steps", "max_tokens", "max_minutes", "relative_lr"):
            _positive(name, getattr(self, name), allow_none=True)
        for name in ("warmup_steps", "eval_every", "eval_tokens", "checkpoint_every", "weight_decay"):
            _positive(name, getattr(self, name), allow_zero=True)
        if self.eval_tokens:
            check_window(self.eval_context, None)

    def paths(self) -> tuple[Path, Path]:
        """(output, state dir) as absolute paths."""
        output = Path(self.output).expanduser().absolute()
        state = Path(self.state_dir).expanduser().absolute() if self.state_dir else default_state_dir(output)
        return output, state

    def record(self) -> dict:
        """The settings as JSON values (paths as strings), for the conversion record."""
        return {k: _jsonable(v) for k, v in asdict(self).items()}


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, os.PathLike) else value


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class HealData:
    """The tokenized training chunks and held-out ids (None: no evaluation), with their corpora."""

    train_corpus: Corpus
    train_tokens: int
    chunks: torch.Tensor  # (N, seq_len)
    eval_corpus: Corpus
    eval_ids: torch.Tensor | None  # (eval_tokens,)

    def record(self) -> dict:
        return {
            "corpus": self.train_corpus.name,
            "sha256": self.train_corpus.sha256,
            "tokens": self.train_tokens,
        }


def load_data(settings: HealSettings, source: Path, *, num_processes: int) -> HealData:
    """Tokenize the training text once (cut into `seq_len` chunks) and the held-out text; they must not
    overlap (`train_data.check_disjoint`)."""
    s = settings
    files = assets.calibration_corpus_files(s.train_corpus) if s.train_corpus else s.train_text
    train_corpus, train_files = load_train_corpus(
        files,
        dataset=s.dataset,
        dataset_config=s.dataset_config,
        split=s.dataset_split,
        text_column=s.text_column,
    )
    eval_corpus, eval_files = load_eval_corpus(s.eval_text)
    check_disjoint(train_corpus, train_files, eval_corpus, eval_files)
    check_not_embedded_eval(train_corpus, train_files)
    tokenizer = loading.load_tokenizer(source)
    train_ids = tokenize(tokenizer, train_corpus)
    chunks = chunk_tokens(train_ids, s.seq_len, min_chunks=s.batch_size * num_processes * s.grad_accum)
    eval_ids = tokenize(tokenizer, eval_corpus)[: s.eval_tokens] if s.eval_tokens else None
    if eval_ids is not None and eval_ids.numel() < s.eval_context:
        raise ValueError(
            f"The evaluation text {eval_corpus.name} has {eval_ids.numel()} tokens (--eval-tokens "
            f"{s.eval_tokens}), fewer than one window of {s.eval_context}; give a longer --eval-text or "
            "lower --eval-tokens / --eval-context"
        )
    return HealData(train_corpus, int(train_ids.numel()), chunks, eval_corpus, eval_ids)


def make_recipe(
    settings: HealSettings, data: HealData, *, num_processes: int, source_hash: str
) -> HealRecipe:
    s = settings
    total_steps = plan_budget(
        max_steps=s.max_steps,
        max_tokens=s.max_tokens,
        max_minutes=s.max_minutes,
        tokens_per_step=s.batch_size * num_processes * s.grad_accum * s.seq_len,
    )
    return HealRecipe(
        seq_len=s.seq_len,
        batch_size=s.batch_size,
        grad_accum=s.grad_accum,
        num_processes=num_processes,
        lr=s.lr,
        relative_lr=s.relative_lr,
        warmup_steps=s.warmup_steps,
        schedule=resolve_schedule(s.schedule, total_steps),
        total_steps=total_steps,
        weight_decay=s.weight_decay,
        max_grad_norm=s.max_grad_norm or None,
        trainable=s.trainable,
        autocast_dtype=s.autocast_dtype,
        seed=s.seed,
        train_sha256=data.train_corpus.sha256,
        source_hash=source_hash,
    )


# --------------------------------------------------------------------------------------------- train state


def make_accelerator(autocast_dtype: str, grad_accum: int):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cpu = not (
        torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())
    )
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision") != PRECISIONS[autocast_dtype]:
        # heal() called again in this process with another precision: accelerate keeps one per process, so
        # drop it (private but stable API) and keep the distributed setup (PartialState).
        AcceleratorState._reset_state(reset_partial_state=False)
    try:
        accelerator = Accelerator(
            mixed_precision=PRECISIONS[autocast_dtype], gradient_accumulation_steps=grad_accum, cpu=cpu
        )
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"--autocast-dtype {autocast_dtype} is not supported here: {one_line(err)}") from err
    if accelerator.distributed_type.value == "DEEPSPEED":
        # ZeRO partitions the weights and the optimizer state, which the checkpoints and the output here
        # gather only for FSDP; written as for DDP they would be empty or partial (docs/heal-fsdp.md)
        raise ValueError(
            f"hf-attn heal does not support DeepSpeed; launch with the FSDP config instead: --config_file "
            f"{FSDP_CONFIG}"
        )
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_asked and cpu and accelerator.num_processes > 1 and not is_sharded(accelerator):
        enable_cpu_fsdp(accelerator)
    return accelerator


def is_sharded(accelerator) -> bool:
    """True under FSDP (v1 or v2): parameters and optimizer state are split over the processes."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def enable_cpu_fsdp(accelerator) -> None:
    """Turn a multi-process CPU (gloo) accelerator into an FSDP2 one, as asked by the launch config.

    accelerate 1.x picks `MULTI_CPU` on CPU and silently ignores an FSDP plugin there (DDP would run instead);
    torch's `fully_shard` itself works over gloo on CPU, so the state is switched to FSDP with the plugin the
    launcher's environment describes (private but stable attributes: the same two shared-state dicts
    accelerate itself writes). FSDP1 is refused here: only FSDP2 is known to run on CPU."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` sets
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"FSDP version {plugin.fsdp_version} on CPU is not supported; use fsdp_version: 2 in the "
            f"accelerate config (e.g. {FSDP_CONFIG})"
        )
    if accelerator.mixed_precision != "no":  # as accelerate does on GPU: FSDP2's MixedPrecisionPolicy
        plugin.set_mixed_precision(accelerator.mixed_precision)
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def find_resume_point(
    state_dir: Path, recipe: HealRecipe, *, resume: bool, overwrite: bool
) -> tuple[dict | None, Path | None, list[tuple[int, Path]]]:
    """(saved trainer state, its checkpoint dir) to resume from, or (None, None); plus every checkpoint found.
    ValueError / FileExistsError if the state dir holds another run or one with a different recipe."""
    checkpoints = find_checkpoints(state_dir)
    if checkpoints and not resume and not overwrite:
        raise FileExistsError(
            f"{state_dir} holds checkpoints of an earlier run; pass --resume to continue it or --overwrite "
            "to start over"
        )
    if not (resume and checkpoints):
        return None, None, checkpoints
    step0, ckpt_dir = checkpoints[-1]
    saved = torch.load(ckpt_dir / STATE_FILE, map_location="cpu", weights_only=False)  # our own file
    diff = recipe.mismatch(saved["recipe"])
    # the global batch decides the trajectory; how it is split over processes does not
    diff = [d for d in diff if not d.startswith(("batch_size", "num_processes"))]
    per_micro_step = saved["recipe"]["batch_size"] * saved["recipe"]["num_processes"]
    now = recipe.batch_size * recipe.num_processes
    if per_micro_step != now:
        diff.append(f"batch_size x num_processes: {per_micro_step} -> {now}")
    if diff:
        raise ValueError(f"--resume: the run in {state_dir} used a different recipe ({'; '.join(diff)})")
    assert saved["step"] == step0, (saved["step"], step0)
    return saved, ckpt_dir, checkpoints


def prepare_state_dir(
    state_dir: Path, log: JsonLog, *, saved: dict | None, checkpoints: list[tuple[int, Path]]
) -> None:
    """Main process: a fresh run clears the old checkpoints and log; stale temp dirs and log lines past the
    resumed checkpoint go."""
    if saved is None and state_dir.exists():
        for _, path in checkpoints:
            shutil.rmtree(path)
        (state_dir / LOG_FILE).unlink(missing_ok=True)
    check_writable(state_dir, "State directory")
    for stale in state_dir.glob(".checkpoint-*.tmp"):  # left by a run killed while writing a checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    log.truncate_after(saved["step"] if saved else -1)


@dataclass
class TrainState:
    """Everything a resumed run needs: the model, optimizer and scheduler, the counters and the evaluations
    so far (the RNG of every process and the data position are saved with it: `save` / `restore`)."""

    net: torch.nn.Module  # prepared by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    params: list[torch.nn.Parameter]
    loader: object
    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    train_cpu_seconds: float = 0.0
    eval_before: dict | None = None
    evals: list[dict] = field(default_factory=list)

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def clocks(self) -> dict:
        return {"train_seconds": self.train_seconds, "train_cpu_seconds": self.train_cpu_seconds}

    def restore(self, saved: dict, *, process_index: int, num_processes: int, optimizer: bool = True) -> None:
        """Counters, optimizer (unless `optimizer=False`: sharded runs load it after `prepare`, see
        `restore_sharded_optimizer`), scheduler and this process's RNG from a saved trainer state."""
        if optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step, self.tokens, self.train_seconds = saved["step"], saved["tokens"], saved["train_seconds"]
        self.train_cpu_seconds = saved["train_cpu_seconds"]
        self.eval_before, self.evals = saved["eval_before"], saved["evals"]
        if len(saved["rng"]) == num_processes:
            set_rng_state(saved["rng"][process_index])

    def save(self, state_dir: Path, *, recipe: HealRecipe, source: Path, accelerator, log: JsonLog) -> None:
        """An atomic `checkpoint-NNNNNN/` (loadable model + trainer_state.pt); older ones go."""
        from accelerate.utils import gather_object

        rngs = gather_object([rng_state()])  # one entry per process, in process order
        sharded = is_sharded(accelerator)
        if sharded:  # collective: every process takes part, the main one receives the full tensors
            weights = accelerator.get_state_dict(self.net)
            optimizer_state = full_optimizer_state(self.net, self.optimizer)
        else:
            weights, optimizer_state = None, self.optimizer.state_dict()
        if accelerator.is_main_process:
            path = state_dir / f"checkpoint-{self.step:06d}"
            with atomic_directory(path, overwrite=True) as tmp:
                model = accelerator.unwrap_model(self.net)
                (plain_copy(model, weights) if sharded else model).save_pretrained(tmp)
                copy_side_files(source, tmp)
                state = {
                    "recipe": asdict(recipe),
                    "step": self.step,
                    "tokens": self.tokens,
                    **self.clocks(),
                    "data_position": self.step * recipe.global_batch,
                    "optimizer": optimizer_state,
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rngs,
                    "eval_before": self.eval_before,
                    "evals": self.evals,
                }
                torch.save(state, tmp / STATE_FILE)
            for old_step, old in find_checkpoints(state_dir):
                if old_step < self.step:
                    shutil.rmtree(old, ignore_errors=True)
            log.write(event="checkpoint", step=self.step, path=str(path))
        accelerator.wait_for_everyone()


def build_train_state(
    start_dir: Path,
    settings: HealSettings,
    recipe: HealRecipe,
    data: HealData,
    accelerator,
    *,
    saved: dict | None,
) -> TrainState:
    """Model (float32 master weights) from `start_dir`, AdamW on the trainable parameters, the schedule and
    the seeded data order from the saved position; restored from `saved` when resuming."""
    net = load_model(
        start_dir,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        gradient_checkpointing=settings.gradient_checkpointing,
    )
    select_trainable(net, settings.trainable)
    sharded = is_sharded(accelerator)
    if sharded and not accelerator.is_fsdp2:  # FSDP1: the optimizer must see the wrapped (flat) parameters
        net = accelerator.prepare(net)
    params = [p for p in net.parameters() if p.requires_grad]
    if recipe.relative_lr is not None and sharded and not accelerator.is_fsdp2:
        raise ValueError(
            f"--relative-lr {recipe.relative_lr} needs each tensor whole, and FSDP1 flattens them; use FSDP2 "
            "(the shipped heal_fsdp.yaml) or --lr"
        )
    groups = param_groups(
        params, lr=None if recipe.relative_lr is not None else recipe.lr, relative_lr=recipe.relative_lr
    )
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, recipe.lr_factor)
    state = TrainState(net, optimizer, scheduler, params, loader=None)
    if saved is not None:
        state.restore(
            saved,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
            optimizer=not sharded,
        )
    loader = make_loader(
        data.chunks,
        batch_size=settings.batch_size,
        seed=settings.seed,
        start=state.step * recipe.global_batch,
    )
    # The scheduler is stepped by hand once per optimizer step (accelerate would step it once per process).
    # (FSDP2 needs the model and its optimizer in one call: it re-points the optimizer at the sharded params.)
    state.net, state.optimizer, state.loader = accelerator.prepare(net, optimizer, loader)
    if sharded:
        # clip over the model's own parameters (what accelerate's FSDP clipping expects; frozen ones have
        # no gradient and add nothing to the norm)
        state.params = list(state.net.parameters())
        # One forward under no_grad before any evaluation: FSDP2 allocates its unsharded parameter buffers at
        # the first all-gather and reuses them; allocated under the evaluation's inference_mode they would be
        # inference tensors that training may not write ("Inplace update to inference tensor").
        with torch.no_grad():
            state.net(input_ids=data.chunks[:1, :1].to(accelerator.device), use_cache=False)
        reshard(state.net)  # (before the optimizer is matched to the model's parameters by name)
        if saved is not None:
            restore_sharded_optimizer(state.net, state.optimizer, saved["optimizer"])
    return state


def reshard(net) -> None:
    """Put every FSDP2 unit of `net` back on its sharded parameters. A forward without backward leaves the
    units that keep their parameters gathered (the root; the final norm with the head) unsharded, with plain
    tensors registered in place of the DTensors that the optimizer and the state-dict helpers look for."""
    from torch.distributed.fsdp import FSDPModule

    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def plain_copy(model, state_dict: dict) -> torch.nn.Module:
    """An unsharded model of `model`'s own class and config holding the full `state_dict` (built on the meta
    device, the tensors assigned without a copy). Written with `save_pretrained` it gives the same files as
    an unsharded run: saving the FSDP2 module itself would record its wrapper class (`_fsdp_init.FSDP...` in
    `auto_map`, its module file copied beside remote code) and the float32 of the master weights as dtype."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2: (FSDPModule, cls)
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(state_dict, strict=True, assign=True)
    plain.tie_weights()  # (assign replaced the tied tensors one by one)
    return plain


def _raw_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # (accelerate's AcceleratedOptimizer wraps it)


def full_optimizer_state(net, optimizer) -> dict:
    """Collective: the optimizer state of a sharded model as full tensors keyed by parameter name, on the
    main process (others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(net, _raw_optimizer(optimizer), options=options)


def restore_sharded_optimizer(net, optimizer, full_state: dict) -> None:
    """Collective: load a `full_optimizer_state` into the optimizer of a sharded model (every process read
    the same file, so each keeps its own shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(net, _raw_optimizer(optimizer), full_state, options=options)


# --------------------------------------------------------------------------------------------- evaluation


def held_out_evaluation(data: HealData, *, context_length: int, accelerator, progress: bool):
    """The evaluation hook: a function of the model giving the held-out perplexity record (None: no eval)."""

    def evaluate(model) -> dict | None:
        if data.eval_ids is None:
            return None
        model.eval()
        # sharded: every process runs every window (each forward all-gathers, so the counts must match)
        split = None if is_sharded(accelerator) else accelerator
        res = evaluate_perplexity(
            model, data.eval_ids, context_length=context_length, accelerator=split, progress=progress
        )
        if split is None and accelerator.is_fsdp2:
            reshard(model)
        model.train()
        return {
            "perplexity": res.perplexity,
            "nll_sum": res.nll_sum,
            "tokens_scored": res.tokens_scored,
            "context_length": res.context_length,
            "stride": res.stride,
            "corpus": data.eval_corpus.name,
            "corpus_sha256": data.eval_corpus.sha256,
        }

    return evaluate


# --------------------------------------------------------------------------------------------- step loop


def train_steps(
    state: TrainState,
    settings: HealSettings,
    recipe: HealRecipe,
    accelerator,
    log: JsonLog,
    *,
    evaluate,
    checkpoint,
    progress: bool,
) -> tuple[list[tuple[int, float]], float]:
    """Optimizer steps until the step budget or the time budget is spent; ([(step, loss)], last loss).
    Evaluates every `eval_every` and checkpoints every `checkpoint_every` steps (not at the last one)."""
    from accelerate.utils import broadcast
    from tqdm.auto import tqdm

    s, main, total_steps = settings, accelerator.is_main_process, recipe.total_steps
    max_seconds = s.max_minutes * 60 if s.max_minutes is not None else None
    unwrapped = accelerator.unwrap_model(state.net)
    losses: list[tuple[int, float]] = []
    bar = tqdm(
        total=total_steps, initial=state.step, unit="step", desc="heal", disable=not (progress and main)
    )
    batches = iter(state.loader)
    loss_value = float("nan")
    while True:
        done = total_steps is not None and state.step >= total_steps
        if max_seconds is not None:
            spent = state.train_cpu_seconds if s.budget_clock == "cpu" else state.train_seconds
            flag = torch.tensor([float(done or spent >= max_seconds)], device=accelerator.device)
            multi = accelerator.num_processes > 1
            done = bool(broadcast(flag).item()) if multi else bool(flag.item())  # main decides
        if done:
            break
        start, cpu_start = time.perf_counter(), time.process_time()
        step_loss = torch.zeros((), device=accelerator.device)
        for _ in range(s.grad_accum):
            batch = next(batches)  # (B, L)
            with accelerator.accumulate(state.net):
                loss = _lm_forward(state.net, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and recipe.max_grad_norm:
                    accelerator.clip_grad_norm_(state.params, recipe.max_grad_norm)
                state.optimizer.step()
                state.optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / s.grad_accum
        lr_now = recipe.lr_factor(state.step) * (recipe.relative_lr or recipe.lr)  # relative: x each RMS
        state.scheduler.step()
        loss_value = accelerator.reduce(step_loss, reduction="mean").item()
        seconds = time.perf_counter() - start
        state.step += 1
        state.tokens += recipe.tokens_per_step
        cpu_seconds = time.process_time() - cpu_start
        state.train_seconds += seconds
        state.train_cpu_seconds += cpu_seconds
        losses.append((state.step, loss_value))
        log.write(
            event="step",
            step=state.step,
            loss=loss_value,
            lr=lr_now,
            tokens=state.tokens,
            step_seconds=seconds,
            cpu_seconds=cpu_seconds,  # of all threads of this process
            **state.clocks(),
        )
        bar.update(1)
        bar.set_postfix(
            loss=f"{loss_value:.4f}", lr=f"{lr_now:.2e}", tok_s=f"{recipe.tokens_per_step / seconds:.0f}"
        )
        last = total_steps is not None and state.step >= total_steps
        if s.eval_every and state.step % s.eval_every == 0 and not last:
            result = evaluate(unwrapped)
            state.evals.append({"step": state.step, "tokens": state.tokens, **state.clocks(), **result})
            log.write(event="eval", **state.evals[-1])
            if main:
                bar.write(f"step {state.step}: held-out perplexity {result['perplexity']:.3f}")
        if s.checkpoint_every and state.step % s.checkpoint_every == 0 and not last:
            checkpoint()
    bar.close()
    return losses, loss_value


# --------------------------------------------------------------------------------------------- output


def write_output(
    model, source: Path, output: Path, record: dict, *, overwrite: bool, state_dict: dict | None = None
) -> None:
    """The healed model in the input's format (its config and dtype, side files copied), atomically, with
    `record` appended to the conversion history. `state_dict`: the full weights of a sharded model
    (`accelerator.get_state_dict`), written in place of the model's own (sharded) ones."""
    if state_dict is not None:
        model = plain_copy(model, state_dict)
    with atomic_directory(output, overwrite=overwrite) as tmp:
        model.to(stored_dtype(source)).save_pretrained(tmp)
        copy_side_files(source, tmp)
        write_config(tmp, add_record(read_config(tmp), record))


# --------------------------------------------------------------------------------------------- heal


def heal(settings: HealSettings, *, progress: bool = True) -> dict:
    """Heal `settings.model` into `settings.output`; returns the run record (also stored in the output's
    config.json) with the output path, the log path, the losses and the evaluations.

    ValueError / FileExistsError for user mistakes, raised before any training (an output that is, lies in
    or contains the source is refused). `eval_tokens=0` skips the held-out evaluation. Call it once per
    process under `accelerate launch` for data parallelism.
    """
    from accelerate.utils import set_seed

    s = settings
    s.validate()
    output, state_dir = s.paths()
    source = resolve_model(s.model)
    check_output(source, output, overwrite=s.overwrite)  # fail fast: before any training
    check_output(source, state_dir, overwrite=True, flag="--state-dir")
    check_writable(output.parent, "Output directory")

    accelerator = make_accelerator(s.autocast_dtype, s.grad_accum)
    main, num_processes = accelerator.is_main_process, accelerator.num_processes
    set_seed(s.seed)

    data = load_data(s, source, num_processes=num_processes)
    recipe = make_recipe(s, data, num_processes=num_processes, source_hash=checkpoint_hash(source))
    saved, ckpt_dir, checkpoints = find_resume_point(
        state_dir, recipe, resume=s.resume, overwrite=s.overwrite
    )
    accelerator.wait_for_everyone()  # every process has read the state before the main one cleans up
    log = JsonLog(state_dir / LOG_FILE, enabled=main)
    if main:
        prepare_state_dir(state_dir, log, saved=saved, checkpoints=checkpoints)
    accelerator.wait_for_everyone()

    state = build_train_state(ckpt_dir if saved else source, s, recipe, data, accelerator, saved=saved)
    unwrapped = accelerator.unwrap_model(state.net)
    evaluate = held_out_evaluation(
        data, context_length=s.eval_context, accelerator=accelerator, progress=progress and main
    )

    def checkpoint() -> None:
        state.save(state_dir, recipe=recipe, source=source, accelerator=accelerator, log=log)

    if saved is None:
        log.write(
            event="start",
            step=0,
            source=str(source),
            recipe=asdict(recipe),
            train_corpus=data.train_corpus.name,
            train_tokens=data.train_tokens,
            chunks=len(data.chunks),
            trainable_parameters=state.trainable_parameters,
            distributed=str(accelerator.distributed_type.value),  # NO | MULTI_CPU | MULTI_GPU | FSDP | ...
        )
        state.eval_before = evaluate(unwrapped)
        if state.eval_before is not None:
            log.write(event="eval", step=0, **state.eval_before)
    else:
        log.write(event="resume", step=state.step, checkpoint=str(ckpt_dir))

    losses, final_loss = train_steps(
        state, s, recipe, accelerator, log, evaluate=evaluate, checkpoint=checkpoint, progress=progress
    )

    eval_after = evaluate(unwrapped)
    if eval_after is not None:
        state.evals.append({"step": state.step, "tokens": state.tokens, **state.clocks(), **eval_after})
        log.write(event="eval", **state.evals[-1])
    if s.keep_checkpoints:  # a final checkpoint: a later --resume with a larger budget continues from here
        checkpoint()
    record = conversion_record(
        kind="heal",
        source=source,
        source_hash=recipe.source_hash,
        settings=s.record(),
        steps=state.step,
        tokens=state.tokens,
        schedule=recipe.schedule,
        global_batch=recipe.global_batch,
        trainable_parameters=state.trainable_parameters,
        num_processes=num_processes,
        train_data=data.record(),
        final_loss=final_loss,
        eval_before=state.eval_before,
        eval_after=eval_after,
        **state.clocks(),
        state_dir=str(state_dir),
    )
    full = accelerator.get_state_dict(state.net) if is_sharded(accelerator) else None  # collective
    if main:
        write_output(unwrapped, source, output, record, overwrite=s.overwrite, state_dict=full)
        if not s.keep_checkpoints:
            for _, path in find_checkpoints(state_dir):
                shutil.rmtree(path, ignore_errors=True)
        log.write(event="end", step=state.step, output=str(output), final_loss=final_loss)
    accelerator.wait_for_everyone()
    return {
        **record,
        "output": str(output),
        "log": str(state_dir / LOG_FILE),
        "losses": losses,
        "evals": state.evals,
    }


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_arguments(p, HealSettings)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = heal(settings_from_args(HealSettings, args), progress=not args.no_progress)
    except USER_ERRORS as err:
        return error(PROG, err)
    from accelerate import PartialState

    if PartialState().is_main_process:
        before, after = result["eval_before"], result["eval_after"]
        ppl = (
            f" | held-out ppl {before['perplexity']:.3f} -> {after['perplexity']:.3f}"
            if before and after
            else ""
        )
        print(
            f"healed {result['source']} -> {result['output']}: {result['steps']} steps, "
            f"{result['tokens']} tokens, final loss {result['final_loss']:.4f}{ppl} | "
            f"{result['train_seconds']:.1f} s training"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
