"""Healing, the training state: the accelerator (data parallel or FSDP, also on CPU), the model, optimizer and
scheduler of a fresh or resumed run (`TrainState`), and the full state dicts of a sharded run."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hf_attn.conversion.checkpoint.io import copy_side_files
from hf_attn.conversion.refine_fit import param_groups
from hf_attn.conversion.training import lora
from hf_attn.conversion.training.data import ChunkOrder, HealData, HealSettings
from hf_attn.conversion.training.recipe import (
    FSDP_CONFIG,
    LOG_FILE,
    PRECISIONS,
    STATE_FILE,
    HealRecipe,
    JsonLog,
    check_writable,
    find_checkpoints,
    load_model,
    rng_state,
    select_trainable,
    set_rng_state,
)
from hf_attn.conversion.training.teacher import load_teacher
from hf_attn.tooling.devices import DEFAULT_DEVICE, resolve_device
from hf_attn.tooling.errors import one_line
from hf_attn.tooling.files import atomic_directory


def make_accelerator(autocast_dtype: str, grad_accum: int, device: str = DEFAULT_DEVICE):
    """The run's Accelerator: on the CPU where `--device` resolves to it (`devices.resolve_device`), else on
    the accelerator's device (`accelerate launch` places each process: cuda:<local rank>)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cpu, mixed = resolve_device(device).type == "cpu", PRECISIONS[autocast_dtype]
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision") != mixed:
        # heal() called again in this process with another precision: accelerate keeps one per process, so
        # drop it (private but stable API) and keep the distributed setup (PartialState).
        AcceleratorState._reset_state(reset_partial_state=False)
    try:
        accelerator = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=grad_accum, cpu=cpu)
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
    # the global batch decides the trajectory; how it is split over processes does not
    diff = [d for d in recipe.mismatch(saved["recipe"]) if not d.startswith(("batch_size", "num_processes"))]
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
    teacher: torch.nn.Module | None = None  # frozen, never saved (teacher.load_teacher); None: labels only

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def clocks(self) -> dict:
        return {"train_seconds": self.train_seconds, "train_cpu_seconds": self.train_cpu_seconds}

    def add_eval(self, result: dict, log: JsonLog) -> None:
        """Keep a held-out evaluation in `evals` with the step, tokens and clocks, and log it."""
        self.evals.append({"step": self.step, "tokens": self.tokens, **self.clocks(), **result})
        log.write(event="eval", **self.evals[-1])

    def restore(self, saved: dict, accelerator, *, optimizer: bool = True) -> None:
        """Counters, optimizer (unless `optimizer=False`: sharded runs load it after `prepare`, see
        `restore_sharded_optimizer`), scheduler and this process's RNG (of `accelerator`'s process index) from
        a saved trainer state."""
        if optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        for name in ("step", "tokens", "train_seconds", "train_cpu_seconds", "eval_before", "evals"):
            setattr(self, name, saved[name])
        if len(saved["rng"]) == accelerator.num_processes:
            set_rng_state(saved["rng"][accelerator.process_index])

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
    base: Path | None = None,
    teacher: Path | None = None,
) -> TrainState:
    """Model (float32 master weights) from `start_dir` (`build_student`; with LoRA the adapters of
    `start_dir` on the frozen `base`), AdamW on the trainable parameters, the schedule and the seeded data
    order from the saved position; restored from `saved` when resuming. `teacher`: the frozen teacher's
    checkpoint (`teacher.load_teacher`), replicated on every process."""
    net = build_student(start_dir, settings, recipe, source=base or start_dir, resuming=saved is not None)
    sharded = is_sharded(accelerator)
    if sharded and not accelerator.is_fsdp2:  # FSDP1: the optimizer must see the wrapped (flat) parameters
        if recipe.relative_lr is not None:
            raise ValueError(
                f"--relative-lr {recipe.relative_lr} needs each tensor whole, and FSDP1 flattens them; use "
                "FSDP2 (the shipped heal_fsdp.yaml) or --lr"
            )
        net = accelerator.prepare(net)
    params = [p for p in net.parameters() if p.requires_grad]
    groups = param_groups(
        params, lr=None if recipe.relative_lr is not None else recipe.lr, relative_lr=recipe.relative_lr
    )
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, recipe.lr_factor)
    state = TrainState(net, optimizer, scheduler, params, loader=None)
    if saved is not None:
        state.restore(saved, accelerator, optimizer=not sharded)
    order = ChunkOrder(len(data.chunks), seed=settings.seed, start=state.step * recipe.global_batch)
    loader = DataLoader(data.chunks, batch_size=settings.batch_size, sampler=order)  # batches (B, L)
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
    if teacher is not None:
        state.teacher = load_teacher(teacher, settings, device=accelerator.device)
    return state


def build_student(
    start_dir: Path, settings: HealSettings, recipe: HealRecipe, *, source: Path, resuming: bool
) -> torch.nn.Module:
    """The trained model, float32: the checkpoint `start_dir` with the chosen trainable parameters; with
    LoRA the frozen `source` with adapters, those saved in the checkpoint `start_dir` when resuming."""
    net = load_model(
        source if recipe.lora_rank else start_dir,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        gradient_checkpointing=settings.gradient_checkpointing,
    )
    if recipe.lora_rank:
        adapters = start_dir if resuming else None
        return lora.wrap(net, rank=recipe.lora_rank, targets=recipe.lora_targets, adapter_dir=adapters)
    select_trainable(net, settings.trainable)
    return net


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


def full_optimizer_state(net, optimizer) -> dict:
    """Collective: the optimizer state of a sharded model as full tensors keyed by parameter name, on the
    main process (others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # (accelerate's AcceleratedOptimizer wraps it)
    return get_optimizer_state_dict(net, optimizer, options=options)


def restore_sharded_optimizer(net, optimizer, full_state: dict) -> None:
    """Collective: load a `full_optimizer_state` into the optimizer of a sharded model (every process read
    the same file, so each keeps its own shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(net, getattr(optimizer, "optimizer", optimizer), full_state, options=options)
