"""Healing, the loop: held-out evaluation, the optimizer steps with their budget, checkpoints and log lines,
and the atomic output in the input's format."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hf_attn.conversion.checkpoint.io import add_record, copy_side_files, read_config, write_config
from hf_attn.conversion.training.data import HealData, HealSettings
from hf_attn.conversion.training.lora import merged
from hf_attn.conversion.training.recipe import HealRecipe, JsonLog, stored_dtype
from hf_attn.conversion.training.state import TrainState, is_sharded, plain_copy, reshard
from hf_attn.conversion.training.teacher import training_loss
from hf_attn.tooling.files import atomic_directory
from hf_attn.tooling.perplexity import evaluate_perplexity


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
        names = ("perplexity", "nll_sum", "tokens_scored", "context_length", "stride")
        corpus = {"corpus": data.eval_corpus.name, "corpus_sha256": data.eval_corpus.sha256}
        return {**{k: getattr(res, k) for k in names}, **corpus}

    return evaluate


def _budget_spent(state: TrainState, s: HealSettings, recipe: HealRecipe, accelerator) -> bool:
    """Whether the step or time budget is spent (the main process decides the time budget for all)."""
    from accelerate.utils import broadcast

    done = recipe.total_steps is not None and state.step >= recipe.total_steps
    if s.max_minutes is None:
        return done
    spent = state.train_cpu_seconds if s.budget_clock == "cpu" else state.train_seconds
    flag = torch.tensor([float(done or spent >= s.max_minutes * 60)], device=accelerator.device)
    return bool(broadcast(flag).item()) if accelerator.num_processes > 1 else bool(flag.item())


def _optimizer_step(state: TrainState, recipe: HealRecipe, accelerator, batches, grad_accum: int):
    """One optimizer step over `grad_accum` micro-batches (each (B, L)); returns the mean of (loss,
    next-token cross-entropy, KL to the teacher) (a tensor of 3; the KL is 0 without a teacher)."""
    step_loss = torch.zeros(3, device=accelerator.device)
    for _ in range(grad_accum):
        batch = next(batches)  # (B, L)
        with accelerator.accumulate(state.net):
            loss, ce, kl = training_loss(state.net, state.teacher, batch, recipe)
            accelerator.backward(loss)
            if accelerator.sync_gradients and recipe.max_grad_norm:
                accelerator.clip_grad_norm_(state.params, recipe.max_grad_norm)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
        parts = [loss.detach(), ce.detach(), kl.detach() if kl is not None else torch.zeros_like(ce)]
        step_loss += torch.stack(parts).float() / grad_accum
    return step_loss


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
    from tqdm.auto import tqdm

    s, main, total_steps = settings, accelerator.is_main_process, recipe.total_steps
    unwrapped = accelerator.unwrap_model(state.net)
    losses: list[tuple[int, float]] = []
    bar = tqdm(
        total=total_steps, initial=state.step, unit="step", desc="heal", disable=not (progress and main)
    )
    batches = iter(state.loader)
    loss_value = float("nan")
    while not _budget_spent(state, s, recipe, accelerator):
        start, cpu_start = time.perf_counter(), time.process_time()
        step_loss = _optimizer_step(state, recipe, accelerator, batches, s.grad_accum)
        lr_now = recipe.lr_factor(state.step) * (recipe.relative_lr or recipe.lr)  # relative: x each RMS
        state.scheduler.step()
        loss_value, ce_value, kl_value = accelerator.reduce(step_loss, reduction="mean").tolist()
        parts = {"ce": ce_value, "kl": kl_value} if state.teacher is not None else {}
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
            **parts,  # with a teacher: the loss's next-token cross-entropy and KL
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
            state.add_eval(result, log)
            if main:
                bar.write(f"step {state.step}: held-out perplexity {result['perplexity']:.3f}")
        if s.checkpoint_every and state.step % s.checkpoint_every == 0 and not last:
            checkpoint()
    bar.close()
    return losses, loss_value


def write_output(
    model, source: Path, output: Path, record: dict, *, overwrite: bool, state_dict: dict | None = None
) -> None:
    """The healed model in the input's format (its config and dtype, side files copied), atomically, with
    `record` appended to the conversion history. `state_dict`: the full weights of a sharded model
    (`accelerator.get_state_dict`), written in place of the model's own (sharded) ones. LoRA adapters are
    merged into the weights first: the output is a plain checkpoint."""
    model = merged(model if state_dict is None else plain_copy(model, state_dict))
    with atomic_directory(output, overwrite=overwrite, kind="checkpoint") as tmp:
        model.to(stored_dtype(source)).save_pretrained(tmp)
        copy_side_files(source, tmp)
        write_config(tmp, add_record(read_config(tmp), record))
