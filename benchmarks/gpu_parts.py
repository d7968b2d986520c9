"""The parts and profiles of `python -m benchmarks.gpu`: their registry, the adapter protocol, the budget
check, the markdown rendering, and the child-process entry that runs one part (or dry-runs them all).

A part has a planned duration (`plan_s`: seconds on one GPU, its process start, imports and Triton compilation
included; measured where the part has run) and a time limit (`limit_s`: it is stopped there and keeps the rows
it has). A profile is one command: its parts in order of value, then optional parts that run only if their
planned seconds are left. `budget_problems` fails a profile whose planned seconds (SETUP_S + STOP_S + its
parts') exceed its budget; the dry run and the tests check every profile with it.

Adapter protocol (`Adapter`, listed in the `ADAPTERS` dict of the part's module):
    defaults   settings of the part; `--set PART.KEY=JSON` replaces one
    columns    (header, row key, format spec) per markdown column; the row keys are the part's row schema
    plan       settings -> one line per case or step; checks the settings, files, imports and argument lists
               without a GPU (the dry run) and raises ValueError / ImportError / OSError when it cannot
    run        (settings, emit) -> None; measures on the GPU, `emit(row)` per row as soon as it is measured
               and `emit(meta=...)` for part-level facts (chosen values, device figures)
Rows reach the runner as JSON lines appended to one file (each line names its part), flushed at once: a part
that fails, runs out of time or is killed keeps what it measured.

    python -m benchmarks.gpu_parts run PART SETTINGS_JSON ROWS_FILE
    python -m benchmarks.gpu_parts dry-run SETTINGS_JSON     (SETTINGS_JSON: {part: {key: value}})

Registry and rendering use the standard library only (the runner imports them before the wheels are set up).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Part:
    name: str
    module: str  # the module (under benchmarks) whose ADAPTERS has this part
    about: str
    plan_s: int  # planned seconds: measured on one H200 (2026-11-27) where it ran, rounded up
    limit_s: int  # default time limit of its child process


@dataclass(frozen=True)
class Adapter:
    defaults: dict
    columns: tuple[tuple[str, str, str], ...]
    plan: Callable[[dict], list[str]]
    run: Callable[[dict, Callable], None]
    extra_keys: tuple[str, ...] = field(default=())  # row keys kept in the JSON but not in the table

    def keys(self) -> set[str]:
        return {key for _, key, _ in self.columns} | set(self.extra_keys)


PARTS = {
    p.name: p
    for p in (  # name, module, about, planned s, limit s
        Part("kernel-tests", "gpu_checks", "MLA kernel and layer-fit tests (skip without CUDA)", 80, 110),
        Part("mla-kernel", "gpu_kernel", "MLA decode kernel: GB/s vs copy, PyTorch, GQA; tuning", 40, 80),
        Part("capacity", "gpu_capacity", "decode tokens/s at equal KV memory: MHA vs MLA 512+64", 25, 60),
        Part("recipe", "gpu_recipe", "default convert mla on CUDA, 2 layers of Llama-3-8B", 85, 130),
        Part("attention", "gpu_attention", "hf_attn_grouped vs sdpa (and flash), prefill / decode", 15, 45),
        Part("heal", "gpu_train", "healing tokens/s and MFU, one GPU: heal, bare loop, a teacher", 40, 100),
        Part("fsdp", "gpu_train", "healing under FSDP (the shipped config), one process per GPU", 45, 90),
        Part("recipe-gqa", "gpu_recipe", "convert gqa (MQA) on CUDA, 2 layers of Llama-3-8B", 75, 120),
        Part("recipe-deep", "gpu_recipe", "default convert mla on CUDA, 8 layers of Llama-3-8B", 200, 300),
        Part("heal-lora", "gpu_train", "LoRA heal of 8B: peak GPU memory, with or without teacher", 200, 300),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Profile:
    name: str
    about: str
    budget_s: int  # wall seconds of the whole command: wheel setup, parts, stopping and writing
    parts: tuple[str, ...]  # in order of value; their planned seconds must fit the budget
    if_time: tuple[str, ...] = ()  # then these, each only if its planned seconds are left


SETUP_S = 20  # planned: installing the carried wheels and probing the machine
STOP_S = 10  # kept back from the budget: stopping a part at the deadline and writing the results
PROFILES = {
    p.name: p
    for p in (
        Profile("loan", "the essential figures in one command of at most 5 minutes (the default)", 300,
                ("kernel-tests", "mla-kernel", "capacity", "recipe"), ("attention",)),
        Profile("extended", "the rest, a second command of at most 8 minutes", 480,
                ("heal", "fsdp", "recipe-gqa", "recipe-deep")),
        Profile("memory", "LoRA healing's GPU memory at 8B, a third command of at most 5 minutes", 300,
                ("heal-lora",)),
    )
}  # fmt: skip


def planned_s(profile: Profile) -> int:
    """Planned wall seconds of a profile's command without its optional parts."""
    return SETUP_S + STOP_S + sum(PARTS[name].plan_s for name in profile.parts)


def budget_problems(profile: Profile) -> list[str]:
    """Why the profile's planned work cannot fit its budget by the parts' own estimates ([] when it fits)."""
    names = profile.parts + profile.if_time
    problems = [f"{profile.name}: unknown part {n!r}" for n in names if n not in PARTS]
    if problems:
        return problems
    if planned_s(profile) > profile.budget_s:
        plan = " + ".join(f"{n} {PARTS[n].plan_s}" for n in profile.parts)
        problems.append(f"{profile.name}: planned {planned_s(profile)} s (setup {SETUP_S} + stop {STOP_S} + "
                        f"{plan}) > its budget {profile.budget_s} s")  # fmt: skip
    for name in names:
        if PARTS[name].limit_s < PARTS[name].plan_s:
            problems.append(f"{name}: limit {PARTS[name].limit_s} s < its planned {PARTS[name].plan_s} s")
    return problems


def adapter(name: str) -> Adapter:
    return importlib.import_module(f"benchmarks.{PARTS[name].module}").ADAPTERS[name]


def resolve_settings(name: str, overrides: dict) -> dict:
    """The part's defaults with `overrides` applied; ValueError naming an unknown key."""
    defaults = adapter(name).defaults
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"--set {name}.{unknown[0]}: unknown setting; {name} has {sorted(defaults)}")
    return {**defaults, **overrides}


def _cell(value, spec: str) -> str:
    if value is None:
        return "n/a"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def render_table(columns, rows: list[dict]) -> str:
    """Markdown table of `rows` with `columns` ((header, key, format spec), ...); missing values: n/a.
    (Not `hf_attn.tooling.tables`: importing it would import the runtime, before the wheels are set up.)"""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key), spec) for _, key, spec in columns) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- child


class Emitter:
    """Appends a part's rows and meta as JSON lines tagged with the part's name (one file for all parts),
    flushed at once, checking every row against the part's schema."""

    def __init__(self, path: str, keys: set[str], part: str):
        self.file = open(path, "a")  # noqa: SIM115 (closed by close())
        self.path, self.keys, self.part = path, keys, part

    def __call__(self, row: dict | None = None, *, meta: dict | None = None) -> None:
        if row is not None:
            unknown = sorted(set(row) - self.keys)
            if unknown:
                raise KeyError(f"row keys {unknown} are not in the part's schema")
            self.write({"row": row})
        if meta is not None:
            self.write({"meta": meta})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({"part": self.part, **record}, default=str) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def run_part(name: str, overrides: dict, rows_file: str) -> None:
    part = adapter(name)
    settings = resolve_settings(name, overrides)
    from hf_attn.tooling.cli import sigterm_exits_cleanly

    emit = Emitter(rows_file, part.keys(), name)
    try:
        emit.write({"columns": [list(c) for c in part.columns], "settings": settings})
        with sigterm_exits_cleanly():  # a time limit's SIGTERM still runs the part's cleanup
            part.run(settings, emit)
    finally:
        emit.close()


def dry_run(overrides: dict[str, dict]) -> list[dict]:
    """Every named part's plan, columns checked against its schema and rendered once; errors per part."""
    out = []
    for name, extra in overrides.items():
        try:
            part = adapter(name)
            settings = resolve_settings(name, extra)
            lines = part.plan(settings)
            placeholder = {key: None for key in part.keys()}
            render_table(part.columns, [placeholder])
            out.append(dict(part=name, ok=True, plan=lines, settings=settings))
        except Exception as err:  # noqa: BLE001 (recorded per part: the dry run names every broken part)
            out.append(dict(part=name, ok=False, error=f"{type(err).__name__}: {err}"))
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) == 4:
        run_part(argv[1], json.loads(argv[2]), argv[3])
        return 0
    if argv[:1] == ["dry-run"] and len(argv) == 2:
        for record in dry_run(json.loads(argv[1])):
            print(json.dumps(record, default=str), flush=True)
        return 0
    print(
        "usage: python -m benchmarks.gpu_parts run PART SETTINGS_JSON ROWS_FILE | dry-run SETTINGS",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
