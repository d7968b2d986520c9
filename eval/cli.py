"""`hf-attn`: the one command-line tool. Each subcommand is a module's `main(argv) -> int`, imported only when
it runs; the documented `python -m ...` module commands are the same functions.

    hf-attn convert gqa|mla|expand ...   hf-attn heal|refine ...  hf-attn perplexity ...
    hf-attn study ...                    hf-attn assets
    hf-attn bench attention|decode|heal|mla-decode|perplexity|stream ...
    hf-attn --version                    hf-attn convert --help / hf-attn bench --help
"""

from __future__ import annotations

import importlib
import sys

from hf_attn.tooling.cli import run_command

# subcommand -> (module with main(argv) -> int, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert gqa": ("hf_attn.conversion.gqa", "MHA/GQA -> GQA/MQA by mean or calibrated pooling"),
    "convert mla": (
        "hf_attn.conversion.mla",
        "MHA/GQA -> MLA (llama_mla): partial RoPE + a joint low-rank latent",
    ),
    "convert expand": ("hf_attn.conversion.expand", "GQA/MQA -> MHA (or more KV heads), exactly"),
    "export": ("hf_attn.conversion.export", "llama_mla (DeepSeek layout) -> deepseek_v3, exactly"),
    "heal": ("hf_attn.conversion.heal", "short uptraining of a converted checkpoint (accelerate)"),
    "refine": ("hf_attn.conversion.refine", "layer-local refit of a conversion to its source (calibration)"),
    "perplexity": ("hf_attn.eval.perplexity", "corpus perplexity with sliding windows (accelerate)"),
    "harness": ("hf_attn.eval.harness", "lm-eval-harness on any checkpoint (local or hub tasks)"),
    "study": ("hf_attn.eval.study", "convert, evaluate, heal every variant and write the report"),
    "engine-check": ("hf_attn.eval.engine.check", "an export served by vLLM vs transformers and its source"),
    "assets": ("hf_attn.tooling.assets", "fetch the embedded default (SmolLM2, Austen, the Python docs)"),
    "bench attention": (
        "hf_attn.eval.bench.attention",
        "hf_attn_grouped vs sdpa / eager attention functions",
    ),
    "bench decode": ("hf_attn.eval.bench.decode", "decode tokens/s and KV bytes of whole models"),
    "bench heal": ("hf_attn.eval.bench.heal", "healing throughput and quality-vs-time curves"),
    "bench mla-decode": ("hf_attn.eval.bench.mla_decode", "MLA absorbed vs expanded decode"),
    "bench perplexity": ("hf_attn.eval.bench.perplexity", "perplexity evaluation vs a bare forward loop"),
    "bench mla-kernel": ("hf_attn.eval.bench.mla_kernel", "the Triton MLA decode kernel (GPU)"),
    "bench mla-kernel-registers": ("hf_attn.eval.bench.mla_kernel_registers", "the kernel's sm_90 registers"),
    "bench scale": (
        "hf_attn.eval.bench.scale",
        "every converter on Llama-2-7B / Llama-3-8B-shaped checkpoints",
    ),
    "bench engine": ("hf_attn.eval.engine.bench", "source vs MLA export in vLLM: KV capacity, throughput"),
    "bench stream": ("hf_attn.eval.bench.stream", "peak memory of the streamed mean-pooling conversion"),
    "bench stages": ("hf_attn.eval.bench.stages", "a conversion's time per stage beside its FLOP bound"),
    "bench gpu": ("hf_attn.eval.bench.gpu", "every GPU measurement, each part with its own time limit"),
}
PROG = "hf-attn"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} <command> [options]   ({PROG} <command> --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    """The subcommand named by the first one or two words of argv, and the rest; None if there is none."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, argv[words:]
    return None


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("hf-attn")
    except importlib.metadata.PackageNotFoundError:  # a checkout that is not installed
        return "unknown (not installed)"


def _group_usage(group: str) -> str:
    """`hf-attn convert --help`: the subcommands of one group."""
    names = {name: text for name, (_, text) in COMMANDS.items() if name.split()[0] == group}
    width = max(map(len, names))
    lines = [
        f"usage: {PROG} {group} <command> [options]   ({PROG} {group} <command> --help)",
        "",
        "commands:",
    ]
    return "\n".join(lines + [f"  {name:<{width}}  {text}" for name, text in names.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {_version()}")
        return 0
    groups = {name.split()[0] for name in COMMANDS if " " in name}
    if argv[0] in groups and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(_group_usage(argv[0]), file=sys.stdout if len(argv) > 1 else sys.stderr)
        return 0 if len(argv) > 1 else 2
    found = resolve(argv)
    if found is None:
        groups = sorted({name.split()[0] for name in COMMANDS})
        print(
            f"{PROG}: error: unknown command {' '.join(argv[:2])!r}; choose one of: {', '.join(groups)} "
            f"(`{PROG} --help` lists them)",
            file=sys.stderr,
        )
        return 2
    name, rest = found
    module = importlib.import_module(COMMANDS[name][0])
    # every subcommand: one error path (Ctrl-C: 130, SIGTERM: 143, both after their cleanup)
    return run_command(f"{PROG} {name}", lambda: module.main(rest))


if __name__ == "__main__":
    raise SystemExit(main())
