"""`hf-attn`: the one command-line tool. Each subcommand is a module's `main(argv) -> int`, imported only when
it runs; the documented `python -m ...` module commands are the same functions.

    hf-attn convert gqa|mla|expand ...   hf-attn heal|refine|export ...   hf-attn perplexity|harness ...
    hf-attn study ...                    hf-attn engine-check ...         hf-attn assets
    hf-attn bench decode ...             hf-attn --version                hf-attn convert --help

The project's own benchmarks (GPU suite, scale, stages, the engine benchmark, ...) are not installed: they run
from a checkout as `python -m benchmarks.<name>` (benchmarks/README.md)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

from hf_attn.tooling.cli import error, run_command

# subcommand -> ("module" with main(argv) -> int, or "module:function" naming it; one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert gqa": ("hf_attn.conversion.cli:gqa_main", "MHA/GQA -> GQA/MQA by mean or calibrated pooling"),
    "convert mla": (
        "hf_attn.conversion.cli:mla_main",
        "MHA/GQA -> MLA (llama_mla): partial RoPE + a joint low-rank latent",
    ),
    "convert expand": ("hf_attn.conversion.cli:expand_main", "GQA/MQA -> MHA (or more KV heads), exactly"),
    "export": ("hf_attn.conversion.export.deepseek", "llama_mla (DeepSeek layout) -> deepseek_v3, exactly"),
    "heal": ("hf_attn.conversion.training.heal", "short uptraining of a converted checkpoint (accelerate)"),
    "refine": ("hf_attn.conversion.refine", "layer-local refit of a conversion to its source (calibration)"),
    "perplexity": ("hf_attn.eval.perplexity", "corpus perplexity with sliding windows (accelerate)"),
    "harness": ("hf_attn.eval.harness", "lm-eval-harness on any checkpoint (local or hub tasks)"),
    "study": ("hf_attn.eval.study", "convert, evaluate, heal every variant and write the report"),
    "engine-check": ("hf_attn.eval.engine.check", "an export served by vLLM vs transformers and its source"),
    "assets": ("hf_attn.tooling.assets", "fetch the embedded default (SmolLM2, Austen, the Python docs)"),
    "bench decode": ("hf_attn.eval.bench.decode", "decode tokens/s and KV bytes of whole models"),
}
# the project's own benchmarks, run from a checkout (benchmarks/, not installed): "bench NAME" -> the module
# there, benchmarks.NAME with dashes as underscores
_BENCHMARK_NAMES = (
    "attention heal mla-decode perplexity mla-kernel mla-kernel-registers scale engine stream stages gpu"
).split()
BENCHMARKS = {f"bench {n}": f"benchmarks.{n.replace('-', '_')}" for n in _BENCHMARK_NAMES}
PROG = "hf-attn"


def _usage(group: str | None = None) -> str:
    """`hf-attn --help`, or with `group` (`hf-attn convert --help`) the subcommands of that group."""
    names = {name: text for name, (_, text) in COMMANDS.items() if group in (None, name.split()[0])}
    width = max(map(len, names))
    prog, more = (f"{PROG} {group}", "") if group else (PROG, " for its options")
    lines = [f"usage: {prog} <command> [options]   ({prog} <command> --help{more})", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in names.items()]
    if group is None:
        lines += [
            "",
            "the project's own benchmarks: python -m benchmarks.<name> from a checkout (benchmarks/)",
        ]
    return "\n".join(lines)


def command_main(name: str):
    """The `main(argv) -> int` of the subcommand `name` (its module imported now)."""
    module, _, function = COMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), function or "main")


def resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    """The subcommand named by the first one or two words of argv, and the rest; None if there is none."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, argv[words:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        try:
            version = importlib.metadata.version("hf-attn")
        except importlib.metadata.PackageNotFoundError:  # a checkout that is not installed
            version = "unknown (not installed)"
        print(f"{PROG} {version}")
        return 0
    groups = {name.split()[0] for name in COMMANDS if " " in name}
    if argv[0] in groups and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(_usage(argv[0]), file=sys.stdout if len(argv) > 1 else sys.stderr)
        return 0 if len(argv) > 1 else 2
    found, words = resolve(argv), " ".join(argv[:2])
    if found is None and words in BENCHMARKS:
        where = f"python -m {BENCHMARKS[words]} (from a checkout)"
        return error(PROG, f"{words!r} is not an {PROG} command; it runs as {where}")
    if found is None:
        groups = ", ".join(sorted({name.split()[0] for name in COMMANDS}))
        return error(PROG, f"unknown command {words!r}; choose one of: {groups} (`{PROG} --help` lists them)")
    name, rest = found
    command = command_main(name)
    # every subcommand: one error path (Ctrl-C: 130, SIGTERM: 143, both after their cleanup)
    return run_command(f"{PROG} {name}", lambda: command(rest))


if __name__ == "__main__":
    raise SystemExit(main())
