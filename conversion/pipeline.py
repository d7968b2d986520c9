"""The one composition of the conversion stages: closed form -> refinement -> export.

    from hf_attn.conversion.pipeline import convert
    from hf_attn.conversion.specs import GQASpec, MLASpec, RefineSpec
    convert(GQASpec(num_kv_heads=1), src=None, dst="mqa")        # calibrated pooling + 32 refinement steps
    convert(MLASpec(kv_budget=0.5), src=None, dst="mla", refine=RefineSpec(steps=0))   # the closed form

`hf-attn convert gqa | mla | expand` (`conversion.cli`), the study (`eval/study.py`) and the experiments run
their conversions through `convert`, with the defaults of the specs (`conversion.specs`). The stages: the
closed form (`gqa.convert_gqa`, `mla.convert_to_mla` or `gqa.expand.expand_checkpoint`, exact: never
refined), with `refine.steps` > 0 the layer-local refinement against the source (`conversion.refine`) on the
conversion's calibration text and device, then `export` (`conversion.export`, "deepseek_v3" of a
DeepSeek-layout MLA). Every spec is validated when built and the output is checked before any work; a closed
form that is refined or exported is written to a scratch directory beside the output and deleted, so only the
last stage's checkpoint is written to `dst`, atomically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path

from hf_attn.conversion.checkpoint.io import latest_record
from hf_attn.conversion.export.deepseek import export_checkpoint
from hf_attn.conversion.gqa.convert import convert_gqa
from hf_attn.conversion.gqa.expand import expand_checkpoint
from hf_attn.conversion.mla.calibration import Calibration
from hf_attn.conversion.mla.convert import convert_to_mla
from hf_attn.conversion.refine import RefineSettings, refine
from hf_attn.conversion.specs import (
    DEFAULT_CORPUS,
    EXPORT_TARGETS,
    CalibrationSpec,
    ConverterSpec,
    ExpandSpec,
    GQASpec,
    MLASpec,
    RefineSpec,
    WriteSpec,
)
from hf_attn.tooling import loading
from hf_attn.tooling.errors import UserError, one_line
from hf_attn.tooling.files import check_output, scratch_directory

CLOSED_FORM_SOURCE = "the closed form of the record before (not kept)"  # the refinement record's `source`
SPECS = {"gqa": GQASpec, "mla": MLASpec, "expand": ExpandSpec}  # a conversion kind -> its spec
CLOSED_FORMS: dict[type, Callable[..., Path]] = {  # a spec -> fn(spec, src=, dst=, calibration=, write=)
    GQASpec: convert_gqa,
    MLASpec: convert_to_mla,
    ExpandSpec: lambda spec, *, calibration, **kw: expand_checkpoint(spec, **kw),  # no calibration
}


@dataclass(frozen=True)
class Converted:
    """What `convert` wrote."""

    path: Path  # the output checkpoint
    closed_form: dict  # the closed-form stage's conversion record
    refined: dict | None = None  # the refinement's record (None: not refined)
    exported: str | None = None  # the export target (None: not exported)


def last_record(out: str | Path) -> dict:
    """The newest conversion record of the checkpoint at `out` (config.json["hf_attn"])."""
    return latest_record(loading.read_config(out))


def convert(
    spec: ConverterSpec,
    *,
    src: str | Path | None,
    dst: str | Path,
    calibration: CalibrationSpec = CalibrationSpec(),
    refine: RefineSpec = RefineSpec(),
    write: WriteSpec = WriteSpec(),
    export: str | None = None,
    progress: bool = False,
    calibration_pass: Calibration | None = None,
) -> Converted:
    """Write `dst`: the source checkpoint `src` (None: the embedded SmolLM2) converted as `spec` says, then
    refined (`refine.steps` > 0; never an expansion) and exported (`export`, e.g. "deepseek_v3").

    calibration_pass: an MLA calibration already run on the same text (`mla.calibrate`) to reuse.
    progress: the refinement's progress bars."""
    if export is not None and export not in EXPORT_TARGETS:
        raise UserError(f"unknown export {export!r}; choose one of {', '.join(EXPORT_TARGETS)}")
    extra = {"calibration_pass": calibration_pass} if calibration_pass is not None else {}
    closed_form_to = partial(CLOSED_FORMS[type(spec)], spec, src=src, calibration=calibration, **extra)
    output = check_output(loading.resolve_model(src), dst, overwrite=write.overwrite)
    steps = 0 if isinstance(spec, ExpandSpec) else refine.steps
    if steps == 0 and export is None:
        path = closed_form_to(dst=output, write=write)
        return Converted(path, last_record(path))
    output.parent.mkdir(parents=True, exist_ok=True)  # (where the output goes; the scratch sits beside it)
    with scratch_directory(".hf-attn-closed-form-", dir=output.parent) as scratch:
        last = closed_form_to(dst=Path(scratch) / "closed-form", write=replace(write, overwrite=False))
        closed_form, refined = last_record(last), None
        if steps:
            refined_dir = output if export is None else Path(scratch) / "refined"
            refined = _refine(
                last,
                refined_dir,
                src=src,
                spec=refine,
                calibration=calibration,
                write=write,
                progress=progress,
            )
            last = refined_dir
        if export is not None:
            export_checkpoint(src=last, dst=output, to=export, overwrite=write.overwrite)
    return Converted(output, closed_form, refined, export)


def _refine(
    closed: Path,
    dst: Path,
    *,
    src,
    spec: RefineSpec,
    calibration: CalibrationSpec,
    write: WriteSpec,
    progress: bool,
) -> dict:
    """`hf-attn refine` of the closed form at `closed` into `dst` (against the source `src`, `convert`'s
    calibration, its write overwrite and progress): the refinement's record."""
    settings = RefineSettings(
        model=str(closed),
        output=str(dst),
        source=None if src is None else str(src),
        calibration_tokens=spec.tokens,
        **{f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "tokens"},  # steps, target, ...
        calibration_text=list(calibration.text) if calibration.text else None,
        calibration_corpus=calibration.corpus or DEFAULT_CORPUS,
        calibration_window=calibration.window,
        device=calibration.device,
        overwrite=write.overwrite,
    )
    try:
        return refine(settings, progress=progress, source_name=CLOSED_FORM_SOURCE, calibration=calibration)
    except UserError as err:  # name the stage: its flags are --refine-steps / --refine-tokens
        raise UserError(
            f"the refinement (--refine-steps {spec.steps} --refine-tokens {spec.tokens}): {one_line(err)}"
        ) from err


def specs_from_options(
    kind: str, options: dict, *, calibration: CalibrationSpec = CalibrationSpec()
) -> tuple[ConverterSpec, CalibrationSpec]:
    """The converter spec of `kind` ("gqa", "mla", "expand") and the calibration from keyword options (a
    study variant's): `calibration_tokens` / `_window` / `_text` / `_corpus` override `calibration`'s
    fields, the other keys are the spec's; UserError naming an unknown key."""
    spec_type = SPECS[kind]
    names = {f.name for f in fields(spec_type)}
    cal_names = {f"calibration_{f.name}": f.name for f in fields(CalibrationSpec)}
    unknown = sorted(set(options) - names - set(cal_names))
    if unknown:
        raise UserError(f"unknown {kind} options {unknown}; known: {sorted(names | set(cal_names))}")
    cal = {cal_names[k]: v for k, v in options.items() if k in cal_names}
    spec = spec_type(**{k: v for k, v in options.items() if k in names})
    return spec, replace(calibration, **cal)
