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

Evaluation: held-out perplexity with the project's protocol (`hf_attn.tooling.perplexity.evaluate_perplexity`, disjoint
windows of `eval_context` tokens over the first `eval_tokens` tokens) before, every `eval_every` steps, and
after. Training and evaluation text must not overlap (`train_data.check_disjoint`).

Interruption: every `checkpoint_every` steps an atomic checkpoint `STATE/checkpoint-NNNNNN/` is written: the
model in `save_pretrained` format (loadable as is) plus `trainer_state.pt` (optimizer, scheduler, the RNG of
every process, data position, progress). `resume=True` continues from the newest complete one with the same
data order and optimizer state: the losses are those of an uninterrupted run. `STATE` defaults to
`OUTPUT.heal/` and also holds the JSON-lines log `log.jsonl` (one line per step, evaluation, checkpoint).

Output: the healed model in the input's format (same config and model type, weights in the input's dtype,
side files such as the tokenizer copied), written atomically; the run is appended to
`config.json["hf_attn"]["history"]` (`conversion.checkpoint.add_record`).

    python -m conversion.heal --model SRC --output DST [--train-text FILE ... | --dataset NAME ...]
        [--max-steps N | --max-tokens N | --max-minutes M [--budget-clock wall|cpu]] [--seq-len 512]
        [--batch-size 1] [--grad-accum 1]
        [--lr 1e-4] [--warmup-steps 0] [--schedule cosine|constant] [--trainable all|attention]
        [--dtype float32|bfloat16|float16] [--eval-text FILE ...] [--eval-every S] [--eval-tokens 8192]
        [--checkpoint-every N] [--resume] [--seed 0] [--gradient-checkpointing] [--overwrite]
    accelerate launch --multi_gpu --num_processes 2 -m conversion.heal ...   # data parallel (CPU: gloo)
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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import hf_attn  # noqa: F401  (registers the hf-attn attention implementations and the llama_mla model type)
from hf_attn.conversion.checkpoint import add_record, copy_side_files, read_config, write_config
from hf_attn.conversion.train_data import (
    check_disjoint,
    chunk_tokens,
    load_eval_corpus,
    load_train_corpus,
    make_loader,
)
from hf_attn.tooling import loading
from hf_attn.tooling.cli import error, one_line
from hf_attn.tooling.corpus import tokenize
from hf_attn.tooling.files import atomic_directory, checkpoint_hash
from hf_attn.tooling.loading import resolve_model
from hf_attn.tooling.perplexity import check_window, evaluate_perplexity

PROG = "hf-attn heal"

TRAINABLE = ("all", "attention")
SCHEDULES = ("cosine", "constant")
CLOCKS = ("wall", "cpu")  # what --max-minutes counts: wall-clock or process CPU time, of training steps only
PRECISIONS = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}  # --dtype -> accelerate mixed_precision
DEFAULT_MAX_STEPS = 100  # when no budget is given: the DESIGN.md control recipe (100 steps of 512 tokens)
MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak
ATTENTION_MARKER = ".self_attn."
STATE_FILE = "trainer_state.pt"
LOG_FILE = "log.jsonl"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


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
    dtype: str  # compute precision (autocast); master weights stay float32
    seed: int
    train_sha256: str
    source_hash: str

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
        raise ValueError(f"--{name} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")


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
    """requires_grad on every parameter (`all`) or on `*.self_attn.*` ones (`attention`); returns names."""
    if trainable not in TRAINABLE:
        raise ValueError(f"Unknown --trainable {trainable!r}; choose one of {', '.join(TRAINABLE)}")
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


# --------------------------------------------------------------------------------------------- heal


def heal(
    *,
    model: str | os.PathLike | None,
    output: str | os.PathLike,
    train_text: list[str | os.PathLike] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    dataset_split: str = "train",
    text_column: str = "text",
    eval_text: list[str | os.PathLike] | None = None,
    max_steps: int | None = None,
    max_tokens: int | None = None,
    max_minutes: float | None = None,
    budget_clock: str = "wall",
    seq_len: int = 512,
    batch_size: int = 1,
    grad_accum: int = 1,
    lr: float = 1e-4,
    warmup_steps: int = 0,
    schedule: str | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    trainable: str = "all",
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    eval_every: int = 0,
    eval_tokens: int = 8192,
    eval_context: int = 1024,
    checkpoint_every: int = 0,
    state_dir: str | os.PathLike | None = None,
    keep_checkpoints: bool = False,
    resume: bool = False,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Heal `model` into `output`; returns the run record (also stored in the output's config.json).

    ValueError / FileExistsError for user mistakes, raised before any training. `eval_tokens=0` skips the
    held-out evaluation. Call it once per process under `accelerate launch` for data parallelism.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import broadcast, gather_object, set_seed
    from tqdm.auto import tqdm

    # ---- arguments (all cheap checks first, so a mistake costs no loading time)
    if trainable not in TRAINABLE:
        raise ValueError(f"Unknown --trainable {trainable!r}; choose one of {', '.join(TRAINABLE)}")
    if budget_clock not in CLOCKS:
        raise ValueError(f"Unknown --budget-clock {budget_clock!r}; choose one of {', '.join(CLOCKS)}")
    if dtype not in PRECISIONS:
        raise ValueError(f"Unknown --dtype {dtype!r}; choose one of {', '.join(PRECISIONS)}")
    for name, value in (
        ("seq-len", seq_len),
        ("batch-size", batch_size),
        ("grad-accum", grad_accum),
        ("lr", lr),
    ):
        _positive(name, value)
    for name, value in (("max-steps", max_steps), ("max-tokens", max_tokens), ("max-minutes", max_minutes)):
        _positive(name, value, allow_none=True)
    for name, value in (
        ("warmup-steps", warmup_steps),
        ("eval-every", eval_every),
        ("eval-tokens", eval_tokens),
        ("checkpoint-every", checkpoint_every),
        ("weight-decay", weight_decay),
    ):
        _positive(name, value, allow_zero=True)
    if eval_tokens:
        check_window(eval_context, None)
    output = Path(output).expanduser().absolute()
    state_dir = Path(state_dir).expanduser().absolute() if state_dir else default_state_dir(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"Output {output} already exists; pass --overwrite to replace it")
    check_writable(output.parent, "Output directory")

    cpu = not (
        torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())
    )
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision") != PRECISIONS[dtype]:
        # heal() called again in this process with another precision: accelerate keeps one per process, so
        # drop it (private but stable API) and keep the distributed setup (PartialState).
        AcceleratorState._reset_state(reset_partial_state=False)
    try:
        accelerator = Accelerator(
            mixed_precision=PRECISIONS[dtype], gradient_accumulation_steps=grad_accum, cpu=cpu
        )
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"--dtype {dtype} is not supported here: {one_line(err)}") from err
    main = accelerator.is_main_process
    set_seed(seed)

    # ---- data: tokenized once, disjoint from the evaluation text
    source = resolve_model(model)
    train_corpus, train_files = load_train_corpus(
        train_text,
        dataset=dataset,
        dataset_config=dataset_config,
        split=dataset_split,
        text_column=text_column,
    )
    eval_corpus, eval_files = load_eval_corpus(eval_text)
    check_disjoint(train_corpus, train_files, eval_corpus, eval_files)
    tokenizer = loading.load_tokenizer(source)
    train_ids = tokenize(tokenizer, train_corpus)
    num_processes = accelerator.num_processes
    chunks = chunk_tokens(train_ids, seq_len, min_chunks=batch_size * num_processes * grad_accum)
    eval_ids = tokenize(tokenizer, eval_corpus)[:eval_tokens] if eval_tokens else None
    if eval_ids is not None and eval_ids.numel() < eval_context:
        raise ValueError(
            f"The evaluation text {eval_corpus.name} has {eval_ids.numel()} tokens (--eval-tokens "
            f"{eval_tokens}), fewer than one window of {eval_context}; give a longer --eval-text or lower "
            "--eval-tokens / --eval-context"
        )

    total_steps = plan_budget(
        max_steps=max_steps,
        max_tokens=max_tokens,
        max_minutes=max_minutes,
        tokens_per_step=batch_size * num_processes * grad_accum * seq_len,
    )
    recipe = HealRecipe(
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=grad_accum,
        num_processes=num_processes,
        lr=lr,
        warmup_steps=warmup_steps,
        schedule=resolve_schedule(schedule, total_steps),
        total_steps=total_steps,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        trainable=trainable,
        dtype=dtype,
        seed=seed,
        train_sha256=train_corpus.sha256,
        source_hash=checkpoint_hash(source),
    )

    # ---- state directory: resume from the newest complete checkpoint, or start clean
    checkpoints = find_checkpoints(state_dir)
    if checkpoints and not resume and not overwrite:
        raise FileExistsError(
            f"{state_dir} holds checkpoints of an earlier run; pass --resume to continue it or --overwrite "
            "to start over"
        )
    saved = None
    if resume and checkpoints:
        step0, ckpt_dir = checkpoints[-1]
        saved = torch.load(ckpt_dir / STATE_FILE, map_location="cpu", weights_only=False)  # our own file
        diff = recipe.mismatch(saved["recipe"])
        # the global batch decides the trajectory; how it is split over processes does not
        diff = [d for d in diff if not d.startswith(("batch_size", "num_processes"))]
        per_micro_step = saved["recipe"]["batch_size"] * saved["recipe"]["num_processes"]
        if per_micro_step != batch_size * num_processes:
            diff.append(f"batch_size x num_processes: {per_micro_step} -> {batch_size * num_processes}")
        if diff:
            raise ValueError(f"--resume: the run in {state_dir} used a different recipe ({'; '.join(diff)})")
        assert saved["step"] == step0, (saved["step"], step0)
    accelerator.wait_for_everyone()  # every process has read the state before the main one cleans up
    log = JsonLog(state_dir / LOG_FILE, enabled=main)
    if main:
        if saved is None and state_dir.exists():
            for _, path in checkpoints:
                shutil.rmtree(path)
            (state_dir / LOG_FILE).unlink(missing_ok=True)
        check_writable(state_dir, "State directory")
        for stale in state_dir.glob(".checkpoint-*.tmp"):  # left by a run killed while writing a checkpoint
            shutil.rmtree(stale, ignore_errors=True)
        log.truncate_after(saved["step"] if saved else -1)
    accelerator.wait_for_everyone()

    # ---- model, optimizer, schedule, data order
    start_dir = ckpt_dir if saved else source
    net = load_model(
        start_dir,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        gradient_checkpointing=gradient_checkpointing,
    )
    select_trainable(net, trainable)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, recipe.lr_factor)
    step = tokens = 0
    train_seconds = train_cpu_seconds = 0.0
    eval_before, evals = None, []
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step, tokens, train_seconds = saved["step"], saved["tokens"], saved["train_seconds"]
        train_cpu_seconds = saved["train_cpu_seconds"]
        eval_before, evals = saved["eval_before"], saved["evals"]
        if len(saved["rng"]) == num_processes:
            set_rng_state(saved["rng"][accelerator.process_index])
    loader = make_loader(chunks, batch_size=batch_size, seed=seed, start=step * recipe.global_batch)
    # The scheduler is stepped by hand once per optimizer step (accelerate would step it once per process).
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    unwrapped = accelerator.unwrap_model(net)

    def evaluate() -> dict | None:
        if eval_ids is None:
            return None
        unwrapped.eval()
        res = evaluate_perplexity(
            unwrapped,
            eval_ids,
            context_length=eval_context,
            accelerator=accelerator,
            progress=progress and main,
        )
        unwrapped.train()
        return {
            "perplexity": res.perplexity,
            "nll_sum": res.nll_sum,
            "tokens_scored": res.tokens_scored,
            "context_length": res.context_length,
            "stride": res.stride,
            "corpus": eval_corpus.name,
            "corpus_sha256": eval_corpus.sha256,
        }

    def save_checkpoint() -> None:
        rngs = gather_object([rng_state()])  # one entry per process, in process order
        if main:
            with atomic_directory(state_dir / f"checkpoint-{step:06d}", overwrite=True) as tmp:
                unwrapped.save_pretrained(tmp)
                copy_side_files(source, tmp)
                state = {
                    "recipe": asdict(recipe),
                    "step": step,
                    "tokens": tokens,
                    "train_seconds": train_seconds,
                    "train_cpu_seconds": train_cpu_seconds,
                    "data_position": step * recipe.global_batch,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rngs,
                    "eval_before": eval_before,
                    "evals": evals,
                }
                torch.save(state, tmp / STATE_FILE)
            for old_step, old in find_checkpoints(state_dir):
                if old_step < step:
                    shutil.rmtree(old, ignore_errors=True)
            log.write(event="checkpoint", step=step, path=str(state_dir / f"checkpoint-{step:06d}"))
        accelerator.wait_for_everyone()

    if saved is None:
        log.write(
            event="start",
            step=0,
            source=str(source),
            recipe=asdict(recipe),
            train_corpus=train_corpus.name,
            train_tokens=int(train_ids.numel()),
            chunks=len(chunks),
            trainable_parameters=sum(p.numel() for p in params),
        )
        eval_before = evaluate()
        if eval_before is not None:
            log.write(event="eval", step=0, **eval_before)
    else:
        log.write(event="resume", step=step, checkpoint=str(ckpt_dir))

    # ---- train
    max_seconds = max_minutes * 60 if max_minutes is not None else None

    def clocks() -> dict:
        return {"train_seconds": train_seconds, "train_cpu_seconds": train_cpu_seconds}

    losses: list[tuple[int, float]] = []
    bar = tqdm(total=total_steps, initial=step, unit="step", desc="heal", disable=not (progress and main))
    batches = iter(loader)
    loss_value = float("nan")
    while True:
        done = total_steps is not None and step >= total_steps
        if max_seconds is not None:
            spent = train_cpu_seconds if budget_clock == "cpu" else train_seconds
            flag = torch.tensor([float(done or spent >= max_seconds)], device=accelerator.device)
            done = bool(broadcast(flag).item()) if num_processes > 1 else bool(flag.item())  # main decides
        if done:
            break
        start, cpu_start = time.perf_counter(), time.process_time()
        step_loss = torch.zeros((), device=accelerator.device)
        for _ in range(grad_accum):
            batch = next(batches)  # (B, L)
            with accelerator.accumulate(net):
                loss = _lm_forward(net, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm:
                    accelerator.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / grad_accum
        lr_now = scheduler.get_last_lr()[0]
        scheduler.step()
        loss_value = accelerator.reduce(step_loss, reduction="mean").item()
        seconds = time.perf_counter() - start
        step += 1
        tokens += recipe.tokens_per_step
        cpu_seconds = time.process_time() - cpu_start
        train_seconds += seconds
        train_cpu_seconds += cpu_seconds
        losses.append((step, loss_value))
        log.write(
            event="step",
            step=step,
            loss=loss_value,
            lr=lr_now,
            tokens=tokens,
            step_seconds=seconds,
            cpu_seconds=cpu_seconds,  # of all threads of this process
            train_seconds=train_seconds,
            train_cpu_seconds=train_cpu_seconds,
        )
        bar.update(1)
        bar.set_postfix(
            loss=f"{loss_value:.4f}", lr=f"{lr_now:.2e}", tok_s=f"{recipe.tokens_per_step / seconds:.0f}"
        )
        last = total_steps is not None and step >= total_steps
        if eval_every and step % eval_every == 0 and not last:
            result = evaluate()
            evals.append({"step": step, "tokens": tokens, **clocks(), **result})
            log.write(event="eval", **evals[-1])
            if main:
                bar.write(f"step {step}: held-out perplexity {result['perplexity']:.3f}")
        if checkpoint_every and step % checkpoint_every == 0 and not last:
            save_checkpoint()
    bar.close()

    # ---- evaluate, write the output in the input's format, record the run
    eval_after = evaluate()
    if eval_after is not None:
        evals.append({"step": step, "tokens": tokens, **clocks(), **eval_after})
        log.write(event="eval", **evals[-1])
    if keep_checkpoints:  # a final checkpoint: a later --resume with a larger budget continues from here
        save_checkpoint()
    record = {
        "step": "heal",
        "source": str(source),
        "source_hash": recipe.source_hash,
        "steps": step,
        "tokens": tokens,
        "lr": lr,
        "schedule": recipe.schedule,
        "warmup_steps": warmup_steps,
        "seq_len": seq_len,
        "global_batch": recipe.global_batch,
        "trainable": trainable,
        "trainable_parameters": sum(p.numel() for p in params),
        "dtype": dtype,
        "seed": seed,
        "num_processes": num_processes,
        "train_data": {
            "corpus": train_corpus.name,
            "sha256": train_corpus.sha256,
            "tokens": int(train_ids.numel()),
        },
        "final_loss": loss_value,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,
        "state_dir": str(state_dir),
    }
    if main:
        with atomic_directory(output, overwrite=overwrite) as tmp:
            unwrapped.to(stored_dtype(source)).save_pretrained(tmp)
            copy_side_files(source, tmp)
            config = read_config(tmp)
            write_config(tmp, add_record(config, record))
        if not keep_checkpoints:
            for _, path in find_checkpoints(state_dir):
                shutil.rmtree(path, ignore_errors=True)
        log.write(event="end", step=step, output=str(output), final_loss=loss_value)
    accelerator.wait_for_everyone()
    return {
        **record,
        "output": str(output),
        "log": str(state_dir / LOG_FILE),
        "losses": losses,
        "evals": evals,
    }


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    p.add_argument("--output", required=True, help="directory of the healed checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--train-text", nargs="+", default=None, metavar="FILE", help="default: the 5 non-eval novels"
    )
    src.add_argument("--dataset", default=None, help="datasets id of the training text, e.g. wikitext")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--eval-text", nargs="+", default=None, metavar="FILE", help="default: Persuasion")
    p.add_argument(
        "--max-steps", type=int, default=None, help=f"default {DEFAULT_MAX_STEPS} if no budget is given"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="training tokens (rounded up to whole steps)")
    p.add_argument("--max-minutes", type=float, default=None, help="training time, evaluation excluded")
    p.add_argument(
        "--budget-clock",
        default="wall",
        help="what --max-minutes counts: wall (default) or cpu (process CPU time: fair on a shared machine)",
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1, help="chunks per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--schedule", default=None, help="cosine | constant (default: cosine with a step budget)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--trainable", default="all", help="all | attention (only *.self_attn.* parameters)")
    p.add_argument(
        "--dtype", default="float32", help="compute precision: float32 | bfloat16 | float16 (autocast)"
    )
    p.add_argument("--attn-implementation", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--eval-every", type=int, default=0, help="held-out perplexity every S steps (0: off)")
    p.add_argument(
        "--eval-tokens", type=int, default=8192, help="first N tokens of the eval text (0: no eval)"
    )
    p.add_argument("--eval-context", type=int, default=1024, help="window length (disjoint windows)")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="atomic resumable checkpoint every N steps"
    )
    p.add_argument("--state-dir", default=None, help="checkpoints + log.jsonl (default: OUTPUT.heal)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="end with a checkpoint (resume later with a larger budget)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in the state dir"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = heal(
            model=args.model,
            output=args.output,
            train_text=args.train_text,
            dataset=args.dataset,
            dataset_config=args.dataset_config,
            dataset_split=args.dataset_split,
            text_column=args.text_column,
            eval_text=args.eval_text,
            max_steps=args.max_steps,
            max_tokens=args.max_tokens,
            max_minutes=args.max_minutes,
            budget_clock=args.budget_clock,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            grad_accum=args.grad_accum,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            schedule=args.schedule,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm or None,
            trainable=args.trainable,
            dtype=args.dtype,
            attn_implementation=args.attn_implementation,
            trust_remote_code=args.trust_remote_code,
            eval_every=args.eval_every,
            eval_tokens=args.eval_tokens,
            eval_context=args.eval_context,
            checkpoint_every=args.checkpoint_every,
            state_dir=args.state_dir,
            keep_checkpoints=args.keep_checkpoints,
            resume=args.resume,
            seed=args.seed,
            gradient_checkpointing=args.gradient_checkpointing,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ValueError, OSError, KeyError) as err:
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
