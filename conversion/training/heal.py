"""Healing: a short uptraining of a converted checkpoint (causal-LM loss on held-apart text), with accelerate.

Any `AutoModelForCausalLM` checkpoint heals (pooled GQA/MQA Llama-family, `llama_mla`, remote-code models
with `trust_remote_code`). docs/healing.md describes the recipe, the teacher, LoRA and the output;
docs/heal-fsdp.md the sharded runs.

Code (`conversion/training/`): `HealSettings` (every option; the command line is built from it) -> `load_data`
-> `make_recipe` -> `find_resume_point` / `build_train_state` (`TrainState.save` / `restore`) -> `train_steps`
(with the `held_out_evaluation` hook) -> `write_output`; `heal()` here strings them together.

    hf-attn heal --model SRC --output DST [--train-text FILE ... | --train-corpus mix | --dataset NAME ...]
        [--max-steps N | --max-tokens N | --max-minutes M] [--teacher auto|DIR|none] ...   # all flags: --help
    accelerate launch --multi_gpu --num_processes 2 -m conversion.training ...   # data parallel (CPU: gloo)
    accelerate launch --config_file FSDP_CONFIG --num_processes N -m hf_attn.conversion.training ...   # FSDP2

`FSDP_CONFIG` is heal_fsdp.yaml beside this file (on CPU, `make_accelerator` switches to FSDP2 itself:
`state.enable_cpu_fsdp`).
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_attn.conversion.checkpoint.io import conversion_record
from hf_attn.conversion.training.data import HealData, HealSettings, load_data, make_recipe
from hf_attn.conversion.training.loop import held_out_evaluation, train_steps, write_output
from hf_attn.conversion.training.lora import resolve_targets
from hf_attn.conversion.training.recipe import (
    ATTENTION_MARKER,
    CLOCKS,
    DEFAULT_MAX_STEPS,
    FSDP_CONFIG,
    LOG_FILE,
    MIN_LR_RATIO,
    PRECISIONS,
    SCHEDULES,
    STATE_FILE,
    TRAINABLE,
    HealRecipe,
    JsonLog,
    check_writable,
    default_state_dir,
    find_checkpoints,
    load_model,
    plan_budget,
    read_log,
    resolve_schedule,
    select_trainable,
    stored_dtype,
)
from hf_attn.conversion.training.state import (
    TrainState,
    build_train_state,
    find_resume_point,
    is_sharded,
    make_accelerator,
    prepare_state_dir,
)
from hf_attn.conversion.training.teacher import check_same_vocabulary, resolve_teacher
from hf_attn.tooling import loading
from hf_attn.tooling.cli import ArgumentParser, add_settings_arguments, run_command, settings_from_args
from hf_attn.tooling.devices import announce_device, warn_emulated_bfloat16
from hf_attn.tooling.errors import UserError, user_input
from hf_attn.tooling.files import check_output, check_text_files, checkpoint_hash

__all__ = [  # the public names of healing, wherever they live (conversion/training/)
    "ATTENTION_MARKER",
    "CLOCKS",
    "DEFAULT_MAX_STEPS",
    "FSDP_CONFIG",
    "LOG_FILE",
    "MIN_LR_RATIO",
    "PRECISIONS",
    "SCHEDULES",
    "STATE_FILE",
    "TRAINABLE",
    "HealData",
    "HealRecipe",
    "HealSettings",
    "JsonLog",
    "TrainState",
    "build_parser",
    "default_state_dir",
    "find_checkpoints",
    "heal",
    "load_data",
    "load_model",
    "main",
    "make_recipe",
    "plan_budget",
    "read_log",
    "resolve_schedule",
    "select_trainable",
    "stored_dtype",
]

PROG = "hf-attn heal"


def heal(settings: HealSettings, *, progress: bool = True) -> dict:
    """Heal `settings.model` into `settings.output`; returns the run record (also stored in the output's
    config.json) with the output path, the log path, the losses and the evaluations.

    UserError / FileExistsError for user mistakes, raised before any training (an output that is, lies in
    or contains the source is refused). `eval_tokens=0` skips the held-out evaluation. Call it once per
    process under `accelerate launch` for data parallelism.
    """
    from accelerate.utils import set_seed

    output, state_dir, source, extras = _check_inputs(settings)
    s = settings.with_defaults(loading.read_config(source))  # what was left out, for this checkpoint
    accelerator = make_accelerator(s.autocast_dtype, s.grad_accum, s.device)
    main = accelerator.is_main_process
    set_seed(s.seed)
    data, recipe = _data_and_recipe(s, source, accelerator.num_processes, extras)
    saved, ckpt_dir, checkpoints = find_resume_point(
        state_dir, recipe, resume=s.resume, overwrite=s.overwrite
    )
    accelerator.wait_for_everyone()  # every process has read the state before the main one cleans up
    log = JsonLog(state_dir / LOG_FILE, enabled=main)
    if main:
        prepare_state_dir(state_dir, log, saved=saved, checkpoints=checkpoints)
        announce_device(accelerator.device)  # every input checked: the command's one line saying where
        if s.autocast_dtype == "bfloat16":
            warn_emulated_bfloat16(accelerator.device, "--autocast-dtype")
        if extras.note:  # (--teacher auto without a teacher: one line saying so)
            print(extras.note, flush=True)
    accelerator.wait_for_everyone()

    start, teacher = ckpt_dir if saved else source, extras.teacher
    state = build_train_state(start, s, recipe, data, accelerator, saved=saved, base=source, teacher=teacher)
    unwrapped = accelerator.unwrap_model(state.net)
    evaluate = held_out_evaluation(
        data, context_length=s.eval_context, accelerator=accelerator, progress=progress and main
    )

    def checkpoint() -> None:
        state.save(state_dir, recipe=recipe, source=source, accelerator=accelerator, log=log)

    if saved is None:
        _start(log, state, data, recipe, evaluate, unwrapped, source=source, accelerator=accelerator)
    else:
        log.write(event="resume", step=state.step, checkpoint=str(ckpt_dir))

    losses, final_loss = train_steps(
        state, s, recipe, accelerator, log, evaluate=evaluate, checkpoint=checkpoint, progress=progress
    )
    eval_after = evaluate(unwrapped)
    if eval_after is not None:
        state.add_eval(eval_after, log)
    if s.keep_checkpoints:  # a final checkpoint: a later --resume with a larger budget continues from here
        checkpoint()
    record = _heal_record(
        s,
        state,
        recipe,
        data,
        source=source,
        accelerator=accelerator,
        final_loss=final_loss,
        eval_after=eval_after,
        state_dir=state_dir,
        teacher=extras.teacher,
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


def _data_and_recipe(s: HealSettings, source: Path, num_processes: int, extras: _Extras):
    """(HealData, HealRecipe) of the run: the texts tokenized, the budget and schedule checked."""
    with user_input():  # a text too short or empty for the settings
        data = load_data(s, source, num_processes=num_processes)
    source_hash = checkpoint_hash(source)
    with user_input():  # the budget and schedule options agree
        recipe = make_recipe(s, data, num_processes=num_processes, source_hash=source_hash, **extras.recipe)
    return data, recipe


def _check_inputs(s: HealSettings) -> tuple[Path, Path, Path, _Extras]:
    """Refuse bad settings before any loading or training (their own checks, the text files, the source
    checkpoint (complete), the output and state paths: never over or inside the source, writable); returns
    (output, state directory, source, the teacher and LoRA modules: `_check_teacher_and_lora`)."""
    with user_input():  # the settings' own checks are about the input
        s.validate()
    for flag, files in (("--train-text", s.train_text), ("--eval-text", s.eval_text)):
        check_text_files(files or [], flag)  # binary or missing text: refused before any loading
    output, state_dir = s.paths()
    source = loading.resolve_model(s.model)
    loading.check_checkpoint_complete(source)  # a readable config and every weight, before any training
    check_output(source, output, overwrite=s.overwrite)  # fail fast: before any training
    check_output(source, state_dir, overwrite=True, flag="--state-dir", kind="directory")
    _check_state_dir(state_dir)
    with user_input():
        check_writable(output.parent, "Output directory")
    return output, state_dir, source, _check_teacher_and_lora(s, source, output, state_dir)


def _check_state_dir(state_dir: Path) -> None:
    """UserError naming the first entry of an existing state directory that heal did not write: its own are
    LOG_FILE (a log whose first line is a `start` event) and its checkpoints, complete or partial."""
    for path in sorted(state_dir.iterdir()) if state_dir.is_dir() else ():
        if path.name == LOG_FILE and path.is_file():
            with open(path, "rb") as f:
                first = f.readline()
            ours = not first.strip() or first.startswith(b'{"event": "start"')
        else:
            partial = path.name.startswith(".checkpoint-")
            ours = partial or (path.name.startswith("checkpoint-") and path.is_dir())
        if not ours:
            raise UserError(
                f"--state-dir {state_dir} holds {path.name}, which hf-attn heal did not write; move it out "
                f"of {state_dir}, or choose another --state-dir (its default is OUTPUT.heal)"
            )


@dataclass(frozen=True)
class _Extras:
    """The teacher and the LoRA modules of a run, resolved and checked before any work."""

    teacher: Path | None  # None: next-token labels only
    recipe: dict  # make_recipe's teacher_hash and lora_targets
    note: str | None  # one line for the user (--teacher auto that found no teacher)


def _check_teacher_and_lora(s: HealSettings, source: Path, output: Path, state_dir: Path) -> _Extras:
    """Resolve `--teacher` (a teacher of another vocabulary, or one the output would overwrite, is refused)
    and `--lora-targets` (names the checkpoint lacks are refused; LoRA under FSDP too)."""
    with user_input():
        teacher, teacher_hash, note = resolve_teacher(s.teacher, source)
    if teacher is not None:
        check_output(teacher, output, overwrite=True, kind=None)  # never over or inside the teacher
        check_output(teacher, state_dir, overwrite=True, flag="--state-dir", kind=None)
        check_same_vocabulary(teacher, source, trust_remote_code=s.trust_remote_code)
    targets = resolve_targets(source, s.lora_targets) if s.lora_rank else ()
    if s.lora_rank and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise UserError("--lora-rank is not supported under FSDP; heal in one process or data parallel")
    return _Extras(teacher, {"teacher_hash": teacher_hash, "lora_targets": targets}, note)


def _start(
    log, state: TrainState, data: HealData, recipe: HealRecipe, evaluate, model, *, source: Path, accelerator
) -> None:
    """A fresh run: the `start` line of its log (source, recipe, data and how the run is distributed),
    then the held-out evaluation of `model` before training (`state.eval_before`, logged at step 0)."""
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
    state.eval_before = evaluate(model)
    if state.eval_before is not None:
        log.write(event="eval", step=0, **state.eval_before)


def _heal_record(
    s: HealSettings,
    state: TrainState,
    recipe: HealRecipe,
    data: HealData,
    *,
    source: Path,
    accelerator,
    final_loss: float,
    eval_after: dict | None,
    state_dir: Path,
    teacher: Path | None,
) -> dict:
    """The run's conversion record (kind `heal`): settings (`device`: where it trained, "cpu" or "cuda"),
    progress, data, losses, evaluations, clocks; the teacher's path and weights hash (None: labels only)
    and LoRA's rank and modules (None: the weights trained)."""
    return conversion_record(
        kind="heal",
        source=source,
        source_hash=recipe.source_hash,
        settings={**s.record(), "device": accelerator.device.type},
        steps=state.step,
        tokens=state.tokens,
        schedule=recipe.schedule,
        global_batch=recipe.global_batch,
        trainable_parameters=state.trainable_parameters,
        num_processes=accelerator.num_processes,
        train_data=dict(
            corpus=data.train_corpus.name, sha256=data.train_corpus.sha256, tokens=data.train_tokens
        ),
        final_loss=final_loss,
        eval_before=state.eval_before,
        eval_after=eval_after,
        **state.clocks(),
        state_dir=str(state_dir),
        teacher=str(teacher) if teacher else None,
        teacher_hash=recipe.teacher_hash,
        lora=(
            dict(rank=recipe.lora_rank, targets=recipe.lora_targets.split(",")) if recipe.lora_rank else None
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_arguments(p, HealSettings)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def heal_and_report() -> None:
        result = heal(settings_from_args(HealSettings, args), progress=not args.no_progress)
        from accelerate import PartialState

        if PartialState().is_main_process:
            before, after = result["eval_before"], result["eval_after"]
            ppl = ""
            if before and after:
                ppl = f" | held-out ppl {before['perplexity']:.3f} -> {after['perplexity']:.3f}"
            print(
                f"healed {result['source']} -> {result['output']}: {result['steps']} steps, "
                f"{result['tokens']} tokens, final loss {result['final_loss']:.4f}{ppl} | "
                f"{result['train_seconds']:.1f} s training"
            )

    return run_command(PROG, heal_and_report)


if __name__ == "__main__":
    raise SystemExit(main())
