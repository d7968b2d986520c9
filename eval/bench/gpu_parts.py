"""The parts of `hf-attn bench gpu`: their registry, the adapter protocol, the markdown rendering, and the
child-process entry that runs one part (or dry-runs them all).

Adapter protocol (`Adapter`, listed in the `ADAPTERS` dict of the part's module):
    defaults   settings of the part; `--set PART.KEY=JSON` replaces one
    columns    (header, row key, format spec) per markdown column; the row keys are the part's row schema
    plan       settings -> one line per case or step; checks the settings, files, imports and argument lists
               without a GPU (the dry run) and raises ValueError / ImportError / OSError when it cannot
    run        (settings, emit) -> None; measures on the GPU, `emit(row)` per row as soon as it is measured
               and `emit(meta=...)` for part-level facts (chosen values, device figures)
Rows reach the runner as JSON lines in a file: a part that fails or runs out of time keeps what it measured.

    python -m hf_attn.eval.bench.gpu_parts run PART SETTINGS_JSON ROWS_FILE
    python -m hf_attn.eval.bench.gpu_parts dry-run SETTINGS_JSON     (SETTINGS_JSON: {part: {key: value}})

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
    module: str  # the module (under hf_attn.eval.bench) whose ADAPTERS has this part
    about: str
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
    for p in (
        Part(
            "kernel-tests", "gpu_checks", "the compiled MLA kernel tests (pytest, skipped without CUDA)", 150
        ),
        Part("mla-kernel", "gpu_kernel", "MLA decode kernel: tuning, GB/s vs copy, vs PyTorch and GQA", 420),
        Part(
            "attention", "gpu_attention", "hf_attn_grouped vs sdpa vs flash_attention_2, prefill/decode", 150
        ),
        Part("model-decode", "gpu_train", "whole-model decode tok/s: MLA absorbed / expanded vs source", 120),
        Part("heal", "gpu_train", "healing tokens/s and MFU: one GPU (heal vs bare loop), FSDP", 240),
        Part("engine", "gpu_checks", "`hf-attn bench engine` where this checkout has it", 60),
        Part("calibration", "gpu_train", "calibrated GQA / MLA and refine on a 7B-shaped checkpoint", 570),
    )
}
# The whole suite in three commands of at most 10 minutes each (each group's limits add up to <= 570 s).
COMMANDS = (("kernel-tests", "mla-kernel"), ("attention", "model-decode", "heal", "engine"), ("calibration",))


def adapter(name: str) -> Adapter:
    return importlib.import_module(f"hf_attn.eval.bench.{PARTS[name].module}").ADAPTERS[name]


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
    """Markdown table of `rows` with `columns` ((header, key, format spec), ...); missing values: n/a."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key), spec) for _, key, spec in columns) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- child


class Emitter:
    """Writes a part's rows and meta as JSON lines, checking every row against the part's schema."""

    def __init__(self, path: str, keys: set[str]):
        self.file = open(path, "a")  # noqa: SIM115 (closed by close())
        self.keys = keys

    def __call__(self, row: dict | None = None, *, meta: dict | None = None) -> None:
        if row is not None:
            unknown = sorted(set(row) - self.keys)
            if unknown:
                raise KeyError(f"row keys {unknown} are not in the part's schema")
            self.write({"row": row})
        if meta is not None:
            self.write({"meta": meta})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def run_part(name: str, overrides: dict, rows_file: str) -> None:
    part = adapter(name)
    settings = resolve_settings(name, overrides)
    from hf_attn.tooling.cli import sigterm_exits_cleanly

    emit = Emitter(rows_file, part.keys())
    try:
        emit.write({"columns": [list(c) for c in part.columns], "settings": settings})
        with (
            sigterm_exits_cleanly()
        ):  # a time limit's SIGTERM still runs the part's cleanup (scratch folders)
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
        "usage: python -m hf_attn.eval.bench.gpu_parts run PART SETTINGS_JSON ROWS_FILE | dry-run SETTINGS",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
