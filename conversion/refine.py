"""Layer-local refinement of a converted checkpoint against its source: calibration text only, no labels.

    hf-attn refine --model CONVERTED --output DIR [--source SRC] [--steps 32] [--relative-lr 0.01 | --lr LR]
        [--loss-stride 4] [--step-dtype bfloat16|float32] [--target layer|attention]
        [--calibration-tokens 4096] [--calibration-window 1024]
        [--calibration-corpus austen|python-docs|mix | --calibration-text FILE...] [--overwrite]

or in one command with the conversion: `hf-attn convert gqa|mla ... --refine-steps N` (the same refinement,
`--refine-tokens` calibration tokens of the conversion's calibration text and windows, written atomically to
--output).

The closed-form converters (`conversion.gqa`, `conversion.mla`) fit every layer to the SOURCE model's
activations with a local metric, so their errors compound through the layers. This step corrects that the way
block-reconstruction post-training methods do (BRECQ, OmniQuant), not the way healing does (no next-token
loss, no labels, no optimizer state kept): both models run side by side over the calibration windows, one
decoder layer at a time, and the converted layer's attention parameters are fitted so that, fed the hidden
states the converted layers before it produce, it returns the hidden states the SOURCE layer returns on its
own stream:

    x_src  (N, T, E)  source hidden states entering layer i (N windows of T tokens, E hidden size)
    x_conv (N, T, E)  converted hidden states entering layer i (the refined layers 0..i-1 applied)
    t = source_layer_i(x_src)                       target, (N, T, E)
    minimise  mean_tokens |rms(conv_layer_i(x_conv)) - rms(t)|^2     rms(h) = h / sqrt(mean(h^2))

over the converted layer's `self_attn` parameters only (the MLP and norms are frozen; the gradient passes
through the MLP), `steps` Adam steps of one window each; rms() compares what the next layer's RMSNorm reads,
so the few huge residual-stream dimensions do not dominate. One layer's fit (the positions a step's loss
covers, the `step_dtype` of its matmuls, the rule that keeps a layer only if its error drops) is
`conversion.refine_fit`. Then x_conv and x_src move on; on the CPU the threads follow the cores other
processes leave free (`conversion.checkpoint.threads`). The parameter shapes never change, so the output has
the converted checkpoint's format (a DeepSeek-layout `llama_mla` stays exportable).

Both models are read from their safetensors one decoder layer at a time (`layerwise.LayerwiseModel`), in fp32
on `--device`: memory is one layer of each model plus 3 N T E floats of hidden states, whatever the depth (a
7B pair fits one GPU). Refitted layers wait in a scratch directory (`shards.SpilledLayers`) until the
output is streamed: every other tensor is copied from the converted checkpoint as it is.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint.calibration import calibration_record, source_ids
from hf_attn.conversion.checkpoint.io import (
    add_record,
    conversion_record,
    names_in_file_order,
    read_config,
    read_tensor,
    save_streamed,
)
from hf_attn.conversion.checkpoint.layerwise import LayerwiseModel
from hf_attn.conversion.checkpoint.shards import SpilledLayers
from hf_attn.conversion.checkpoint.threads import CoreShare
from hf_attn.conversion.refine_fit import (
    FitRule,
    LayerFit,
    autocast,
    fit_layer,
    frozen_linears_to,
    halves,
    resolve_step_dtype,
    targets_of,
)
from hf_attn.conversion.specs import (
    DEFAULT_CORPUS,
    DEFAULT_WINDOW,
    LOSS_STRIDE,
    REFINE_STEPS,
    REFINE_TARGETS,
    REFINE_TOKENS,
    RELATIVE_LR,
    STEP_DTYPE,
    STEP_DTYPES,
    CalibrationSpec,
)
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import (
    ArgumentParser,
    add_settings_arguments,
    check_choices,
    run_command,
    setting,
    settings_from_args,
)
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, warn_emulated_bfloat16
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, checkpoint_hash, scratch_directory

PROG = "hf-attn refine"
CONVERSION_KINDS = ("gqa", "mla")  # records whose `source` a refinement defaults to


@dataclass(frozen=True)
class RefineSettings:
    """Every option of `hf-attn refine` (its flags are built from these fields)."""

    model: str = setting(
        help="the converted checkpoint (llama_mla, or a pooled Llama-family model)", required=True
    )
    output: str = setting(help="directory of the refined checkpoint", required=True)
    source: str | None = setting(
        None, help="the checkpoint it was converted from (default: the source its conversion record names)"
    )
    steps: int = setting(REFINE_STEPS, help="Adam steps per decoder layer, one calibration window each")
    relative_lr: float = setting(
        RELATIVE_LR, help="each tensor's Adam learning rate as a fraction of the tensor's RMS (scale-free)"
    )
    lr: float | None = setting(
        None, help="one absolute Adam learning rate for every tensor instead (e.g. 1e-4)"
    )
    target: str = setting(
        REFINE_TARGETS[0],
        choices=REFINE_TARGETS,
        help="what each layer matches: the source layer's output, or the residual stream after its attention "
        "(cheaper steps that skip the MLP, a little less accurate)",
    )
    loss_stride: int = setting(
        LOSS_STRIDE,
        help="each step's loss on every k-th position of its window (the MLP runs on those alone)",
    )
    step_dtype: str = setting(
        STEP_DTYPE,
        choices=("auto", *STEP_DTYPES),
        help="dtype of the refinement's matmuls: steps, targets, errors (autocast; the hidden states carried "
        "from layer to layer and the errors stay float32); auto: bfloat16 on a GPU or an AVX-512 CPU, "
        "where it runs natively, else float32",
    )
    calibration_tokens: int = setting(REFINE_TOKENS, help="calibration tokens (disjoint windows)")
    calibration_window: int = setting(DEFAULT_WINDOW, help="tokens per calibration window (a step each)")
    calibration_corpus: str = setting(
        DEFAULT_CORPUS,
        help="calibration text (never an evaluation text)",
        choices=assets.CORPORA,
        exclusive="calibration text",
    )
    calibration_text: list[str] | None = setting(
        None,
        help="calibration text files instead of a corpus (a file listed k times: k shares)",
        metavar="FILE",
        exclusive="calibration text",
    )
    device: str = setting(
        DEFAULT_DEVICE, help=f"where the two models' layers run, in fp32 ({DEVICE_HELP})", choices=DEVICES
    )
    overwrite: bool = setting(False, help="replace an existing --output")

    def calibration(self) -> CalibrationSpec:
        """The calibration text, tokens, window and device of these settings as a CalibrationSpec (which
        checks them: UserError naming the first bad one)."""
        text = tuple(self.calibration_text) if self.calibration_text else None
        return CalibrationSpec(
            text=text,
            corpus=None if text else self.calibration_corpus,
            tokens=self.calibration_tokens,
            window=self.calibration_window,
            device=self.device,
        )


def refine_layers(
    *,
    source: LayerwiseModel,
    converted: LayerwiseModel,
    windows: torch.Tensor,
    steps: int,
    lr: float | None = None,
    relative_lr: float | None = None,
    target: str = REFINE_TARGETS[0],
    loss_stride: int = LOSS_STRIDE,
    step_dtype: str = STEP_DTYPE,
    keep: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    progress: bool = True,
) -> list[LayerFit]:
    """Refine `converted` against `source` (as deep) layer by layer (see the module docstring; one layer's
    fit: `refine_fit`); windows (N >= 1, T) token ids. keep(i, tensors) receives the refitted `self_attn`
    tensors of every layer whose error they lower ("q_proj.weight", ...); nothing is written here."""
    with torch.no_grad():
        x_src = [source.embed(w).unsqueeze(0) for w in windows]  # N x (1, T, E)
        x_conv = [converted.embed(w).unsqueeze(0) for w in windows]  # N x (1, T, E)
    step_dtype = resolve_step_dtype(step_dtype, x_src[0].device)
    if step_dtype == "bfloat16":  # (auto picks it only where it is native)
        warn_emulated_bfloat16(x_src[0].device, "--refine-step-dtype")
    rule = FitRule(
        steps, lr=lr, relative_lr=relative_lr, target=target, loss_stride=loss_stride, step_dtype=step_dtype
    )
    src_cache, conv_cache, fits = {}, {}, []
    bar = tqdm(range(converted.num_layers), desc="refine", unit="layer", disable=not progress)
    with CoreShare() as share:
        for i in bar:
            share.update()
            layer, kwargs = source.load_layer(i), source.layer_kwargs(x_src[0], i, src_cache)
            frozen_linears_to(layer, rule.step_dtype)
            with torch.no_grad(), stages.stage("refine targets"), autocast(x_src[0].device, rule.step_dtype):
                mids, x_src = (list(h) for h in zip(*(halves(layer, x, kwargs) for x in x_src)))
            source.free_layer(i)
            targets = targets_of(mids, x_src, rule.target)
            del mids
            layer, kwargs = converted.load_layer(i), converted.layer_kwargs(x_conv[0], i, conv_cache)
            layer.requires_grad_(False)  # fit_layer trains self_attn alone
            frozen_linears_to(layer, rule.step_dtype, skip=layer.self_attn)
            fit, x_conv = fit_layer(i, layer, x_conv, targets, kwargs, rule)
            fits.append(fit)
            if fit.kept and keep is not None:
                keep(i, {k: v.detach().cpu() for k, v in layer.self_attn.state_dict().items()})
            bar.set_postfix(error=f"{fit.error_before:.3g}->{fit.error_after:.3g}")
            converted.free_layer(i)
    return fits


def resolve_source(model_dir: Path, source: str | None) -> Path:
    """The model `model_dir` was converted from: `source` if given, else the source of the last gqa / mla
    conversion its record names. UserError when the recorded source is gone or changed, or when `source` is
    not the recorded one (by the hash of its weights); without a record, `source` is taken as given."""
    history = (read_config(model_dir).get("hf_attn") or {}).get("history", [])
    records = [r for r in history if r.get("kind") in CONVERSION_KINDS]
    recorded = (Path(records[-1]["source"]), records[-1]["source_hash"]) if records else None
    if source is None:
        if recorded is None:
            raise UserError(
                f"{model_dir} records no gqa/mla conversion; pass --source (the model it came from)"
            )
        source_dir, recorded_hash = recorded
        if not source_dir.is_dir():
            raise UserError(f"the recorded source {source_dir} is gone; pass --source")
        if checkpoint_hash(source_dir) != recorded_hash:
            raise UserError(f"the recorded source {source_dir} changed since the conversion; pass --source")
        return source_dir
    source_dir = loading.resolve_model(source)
    if recorded is not None and checkpoint_hash(source_dir) != recorded[1]:
        raise UserError(
            f"--source {source_dir} is not the model {model_dir} was converted from (its record names "
            f"{recorded[0]}, weights sha256 {recorded[1][:12]}); pass that one, or omit --source"
        )
    return source_dir


def check_settings(s: RefineSettings, calibration: CalibrationSpec | None = None) -> CalibrationSpec:
    """The options checked before any work: UserError naming the first bad one. Returns the calibration:
    `calibration` if given, else the settings' (`RefineSettings.calibration`)."""
    check_choices(s)
    check_number("--steps", s.steps, minimum=1, inclusive=True, integer=True)
    check_number("--loss-stride", s.loss_stride, minimum=1, inclusive=True, integer=True)
    check_number("--lr", s.lr)
    check_number("--relative-lr", s.relative_lr)
    return s.calibration() if calibration is None else calibration


def refine(
    settings: RefineSettings,
    *,
    progress: bool = True,
    source_name: str | None = None,
    calibration: CalibrationSpec | None = None,
) -> dict:
    """Refine `settings.model` into `settings.output`; returns the record appended to its history, whose
    `source` is `source_name` if given (a model that is not kept, e.g. a closed form in a scratch directory),
    else the model's path. `calibration`: the text and window of the refinement, a CalibrationSpec already
    checked (a conversion's; its `calibration_tokens` still come from the settings); default the settings'
    calibration options. Every option, both checkpoints (complete weights) and the output are checked
    before any work."""
    s = settings
    calibration = check_settings(s, calibration)
    model_dir = loading.resolve_model(s.model)
    output = check_output(model_dir, s.output, overwrite=s.overwrite)
    source_dir = resolve_source(model_dir, s.source)
    check_output(source_dir, output, overwrite=True)
    loading.check_checkpoint_complete(model_dir)
    loading.check_checkpoint_complete(source_dir)
    source = LayerwiseModel(source_dir, device=s.device)
    converted = LayerwiseModel(model_dir, device=s.device)
    cs, cc = source.config, converted.config
    for name in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if getattr(cs, name) != getattr(cc, name):
            raise UserError(
                f"{name} differs: source {getattr(cs, name)}, converted {getattr(cc, name)}; "
                "pass the --source this checkpoint was converted from"
            )
    ids, window = source_ids(model_dir, calibration, s.calibration_tokens), calibration.window
    n = max(1, len(ids) // window)  # (one shorter window if there are fewer tokens)
    windows = ids[: n * window].view(n, -1) if len(ids) >= window else ids[None]  # (N, T)
    torch.manual_seed(0)
    with scratch_directory("hf-attn-refine-") as scratch, stages.recording():  # the record's stage_seconds
        refitted = SpilledLayers(Path(scratch), converted.index)
        start = time.perf_counter()
        fits = refine_layers(
            source=source,
            converted=converted,
            windows=windows,
            steps=s.steps,
            lr=s.lr,
            relative_lr=None if s.lr is not None else s.relative_lr,
            target=s.target,
            loss_stride=s.loss_stride,
            step_dtype=s.step_dtype,
            keep=refitted.__setitem__,
            progress=progress,
        )
        seconds = time.perf_counter() - start
        record = conversion_record(
            kind="refine",
            source=source_name or str(model_dir),
            source_hash=checkpoint_hash(model_dir),
            settings={
                **{k: v for k, v in asdict(s).items() if k not in ("model", "output", "overwrite")},
                "device": converted.device.type,  # where it ran (--device auto resolved)
                "step_dtype": resolve_step_dtype(s.step_dtype, converted.device),  # (auto resolved)
            },
            reference=str(source_dir),
            calibration=calibration_record(calibration, windows.numel()),
            layers=[asdict(f) for f in fits],
            seconds=round(seconds, 1),
        )

        def config() -> dict:  # once the weights are written: the stages include the write
            record["stage_seconds"] = stages.snapshot()
            return add_record(read_config(model_dir), record)

        with stages.stage("write"):
            save_streamed(
                src_dir=model_dir,
                dst=output,
                tensors=_refined_tensors(converted.index, refitted),
                config=config,
                overwrite=s.overwrite,
            )
    return record


def _refined_tensors(index: dict, refitted: SpilledLayers):
    """The converted checkpoint's tensors in file order, a refitted layer's `self_attn` ones replaced."""
    for name in names_in_file_order(index):
        match = _ATTENTION.fullmatch(name)
        if match and int(match[1]) in refitted:
            yield name, refitted[int(match[1])][match[2]]
        else:
            yield name, read_tensor(index[name])


_ATTENTION = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_arguments(parser, RefineSettings)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def refine_and_report() -> None:
        record = refine(settings_from_args(RefineSettings, args), progress=not args.no_progress)
        print(
            f"refined {record['source']} -> {args.output}: {refine_summary(record)} in "
            f"{record['seconds']:.0f} s"
        )

    return run_command(PROG, refine_and_report)


def refine_summary(record: dict) -> str:
    """'K/L layers changed, mean layer error a -> b' of a refinement record."""
    layers = record["layers"]
    before = sum(f["error_before"] for f in layers) / len(layers)
    after = sum(f["error_after"] for f in layers) / len(layers)
    kept = sum(f["kept"] for f in layers)
    return f"{kept}/{len(layers)} layers changed, mean layer error {before:.4g} -> {after:.4g}"


if __name__ == "__main__":
    raise SystemExit(main())
