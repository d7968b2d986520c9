"""The study's configuration: `study.toml`'s profiles (`Settings`, the budgets every row is measured with) and
variants (`Variant`), read and checked by `load_config` before any work."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from hf_attn.conversion import gqa, pipeline
from hf_attn.conversion.checkpoint.io import AttentionGeometry, read_config
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.mla import plan as mla_plan
from hf_attn.conversion.specs import (
    DEFAULT_CORPUS,
    EXPORT_TARGETS,
    RELATIVE_LR,
    CalibrationSpec,
    ExpandSpec,
    GQASpec,
)
from hf_attn.tooling import assets
from hf_attn.tooling.errors import UserError, check_number, one_line, user_input

DEFAULT_CONFIG = Path(__file__).with_name("study.toml")
PROFILES = ("default", "quick")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One profile of `study.toml`: the budgets every row is measured with."""

    eval_tokens: int
    context_length: int
    decode_prompt_tokens: int
    decode_new_tokens: int
    calibration_tokens: int
    heal_minutes: float
    heal_batch_size: int
    task_items: int  # first N items of the local last-word task (eval/tasks), for the accuracy column
    second_corpus_tokens: int = 0  # > 0: also the first N tokens of the Python FAQ (the cross-domain check)
    refine_steps: int = 0  # variants with `refine = true`: `hf-attn refine --steps` after the closed form
    refine_tokens: int = 0  # ... and its `--calibration-tokens` (the default `mix` corpus)
    refine_loss_stride: int = 1  # ... and its `--loss-stride`: a short refinement needs every position
    heal_corpus: str = "austen"  # `hf-attn heal --train-corpus`: austen | python-docs | mix
    # `hf-attn heal --seq-len / --lr / --trainable`; None (left out): heal's default for each checkpoint
    heal_seq_len: int | None = None
    heal_lr: float | None = None
    heal_trainable: str | None = None
    variants: tuple[str, ...] = ()  # the names of the variants this profile runs (empty: all of them)

    @property
    def protocol(self) -> str:
        return (
            f"Persuasion, first {self.eval_tokens} tokens, disjoint {self.context_length}-token windows, "
            f"fp32; decode: batch 1, {self.decode_prompt_tokens}-token prompt, "
            f"{self.decode_new_tokens} new tokens; accuracy: first {self.task_items} items of the local "
            "last-word task (persuasion_lastword, zero-shot, lm-eval)"
        ) + (
            f"; second corpus: the Python 3.11 FAQ, first {self.second_corpus_tokens} tokens, same windows"
            if self.second_corpus_tokens
            else ""
        )

    @property
    def refinement(self) -> str:
        """How rows marked refined were refined (one home for the report and the README)."""
        return (
            f"`hf-attn refine` after the closed form: {self.refine_steps} Adam steps per layer on "
            f"{self.refine_tokens} calibration tokens ({DEFAULT_CORPUS} corpus), the loss on every "
            f"{'position' if self.refine_loss_stride == 1 else f'{self.refine_loss_stride}th position'}, "
            f"learning rate {RELATIVE_LR} x each tensor's RMS, layer-local, no labels"
        )

    def key(self) -> dict:
        """The settings a row's key depends on (an unset second corpus leaves earlier keys unchanged)."""
        out = dataclasses.asdict(self)
        del out["variants"]  # which rows run, not how one is measured
        if not self.second_corpus_tokens:
            del out["second_corpus_tokens"]
        return out


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    label: str
    kind: str  # source | expand | gqa | mla
    heal: bool
    options: dict  # converter keyword options


KINDS = ("source", "expand", "gqa", "mla")
# A variant's name names its checkpoints in the study cache and its rows in --results: a plain file name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


_MAY_BE_ZERO = ("second_corpus_tokens", "refine_steps", "refine_tokens")  # every other number must be > 0


def check_settings(settings: Settings, where: str) -> None:
    """UserError naming the field and the file for a value of the wrong type or out of range."""
    for f in dataclasses.fields(Settings):
        value, kind = getattr(settings, f.name), str(f.type).removesuffix(" | None")
        if value is None and f.default is None:  # left out: the command's own default
            continue
        if f.name == "variants":
            if not all(isinstance(name, str) for name in value):
                raise UserError(f"variants = {list(value)!r} in {where} must be a list of variant names")
        elif kind == "str":
            if not isinstance(value, str):
                raise UserError(f"{f.name} = {value!r} in {where} must be a string")
        else:
            zero = f.name in _MAY_BE_ZERO
            check_number(f"{f.name} in {where}", value, inclusive=zero, integer=kind == "int")
    if settings.heal_corpus not in assets.CORPORA:
        raise UserError(
            f"unknown heal_corpus {settings.heal_corpus!r} in {where}; choose one of {list(assets.CORPORA)}"
        )


def load_config(path: str | Path, profile: str) -> tuple[Settings, list[Variant]]:
    """The settings of `profile` and the variants of the study TOML at `path`; UserError naming the file and
    the entry for anything malformed."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(
            f"--config {path} is not a TOML file ({one_line(err)}); fix it or pass another"
        ) from err
    if not isinstance(raw.get(profile), dict):
        raise UserError(f"profile {profile!r} not in {path}; it has {[k for k in raw if k != 'variants']}")
    fields = {f.name for f in dataclasses.fields(Settings)}
    unknown = set(raw[profile]) - fields
    if unknown:
        raise UserError(
            f"unknown settings {sorted(unknown)} in [{profile}] of {path}; known: {sorted(fields)}"
        )
    required = {f.name for f in dataclasses.fields(Settings) if f.default is dataclasses.MISSING}
    missing = sorted(required - set(raw[profile]))
    if missing:
        raise UserError(f"[{profile}] of {path} lacks the settings {missing}; add them")
    names = raw[profile].get("variants", [])
    if not isinstance(names, list):
        raise UserError(f"variants = {names!r} in [{profile}] of {path} must be a list of variant names")
    settings = Settings(**{**raw[profile], "variants": tuple(names)})
    check_settings(settings, f"[{profile}] of {path}")
    variants = []
    for entry in raw.get("variants", []):
        entry = dict(entry)
        if not isinstance(entry.get("name"), str) or "kind" not in entry:
            raise UserError(f"a [[variants]] entry of {path} lacks a name or a kind: {entry}")
        name, kind = entry.pop("name"), entry.pop("kind")
        if not NAME.fullmatch(name):
            raise UserError(
                f"variant name {name!r} in {path} is not a plain name: use letters, digits, '.', '_' and '-' "
                "(it names the variant's files in the study cache and in --results)"
            )
        if kind not in KINDS:
            raise UserError(f"variant {name!r}: unknown kind {kind!r}; choose one of {KINDS}")
        variants.append(Variant(name, entry.pop("label", name), kind, bool(entry.pop("heal", False)), entry))
    if len({v.name for v in variants}) != len(variants):
        raise UserError(f"variant names in {path} must be unique")
    unknown = sorted(set(settings.variants) - {v.name for v in variants})
    if unknown:
        raise UserError(
            f"variants = {unknown} in [{profile}] of {path} are not [[variants]] of the file; "
            f"choose from {[v.name for v in variants]}"
        )
    if settings.variants:
        variants = [v for v in variants if v.name in settings.variants]
    return settings, variants


def check_variants(variants: list[Variant], settings: Settings, source: Path, where: str) -> None:
    """Every variant's options against the source checkpoint (its attention geometry), before the first
    variant runs: UserError naming the variant and the first bad option."""
    geometry = AttentionGeometry.from_config(read_config(source))
    for v in variants:
        options = dict(v.options)
        export, refine = options.pop("export", None), options.pop("refine", False)
        try:
            if v.kind == "source":
                if v.options:
                    raise UserError(f"a source variant takes no options, got {sorted(v.options)}")
                continue
            if export not in (None, *EXPORT_TARGETS):
                raise UserError(f"unknown export {export!r}; choose one of {', '.join(EXPORT_TARGETS)}")
            if refine and (settings.refine_steps < 1 or settings.refine_tokens < 1):
                raise UserError("refine = true needs refine_steps and refine_tokens >= 1 in the profile")
            with user_input():
                spec, calibration = pipeline.specs_from_options(
                    v.kind, options, calibration=CalibrationSpec(tokens=settings.calibration_tokens)
                )
                if isinstance(spec, GQASpec):
                    gqa.check_pooling(geometry, spec.num_kv_heads)
                elif isinstance(spec, ExpandSpec):
                    expand.check_expansion(geometry, spec.num_kv_heads)
                else:
                    mla_plan.check_spec(spec, calibration, geometry)
        except UserError as err:
            raise UserError(f"variant {v.name!r} in {where}: {one_line(err)}") from err
