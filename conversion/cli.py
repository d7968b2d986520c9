"""The command line of the converters (`hf-attn convert expand | gqa | mla`): a parser built from the specs
(`conversion.specs`, each flag with the spec's default) and one run through the pipeline
(`conversion.pipeline.convert`), on the one error path (`hf_attn.tooling.cli`): a bad value is one line
naming the flag and the fix, exit status 2, checked before any work, nothing written.
"""

from __future__ import annotations

import argparse
import time

from hf_attn.conversion import pipeline
from hf_attn.conversion.gqa import convert as gqa
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.mla import convert as mla
from hf_attn.conversion.refine import refine_summary
from hf_attn.conversion.specs import (
    CalibrationSpec,
    ExpandSpec,
    GQASpec,
    MLASpec,
    RefineSpec,
    WriteSpec,
    add_spec_arguments,
    spec_from_args,
)
from hf_attn.tooling.cli import ArgumentParser, run_command

# the spec classes of a converter's command besides its own, and the prefixes of their parsed values
STAGES = {"calibration": CalibrationSpec, "refine": RefineSpec, "write": WriteSpec}


def build_parser(prog: str, doc: str, spec: type) -> argparse.ArgumentParser:
    """--model (default: the embedded SmolLM2), --output and the flags of `spec` and of its stages."""
    parser = ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded SmolLM2)")
    parser.add_argument("--output", required=True, help="the converted checkpoint's directory")
    add_spec_arguments(parser, spec, prefix="spec")
    for prefix, stage in STAGES.items():
        if spec is not ExpandSpec or stage is WriteSpec:  # (the exact expansion: the write flags only)
            add_spec_arguments(parser, stage, prefix=prefix)
    return parser


def specs_from_args(spec: type, args: argparse.Namespace) -> dict:
    """The keyword arguments of `pipeline.convert` from parsed arguments (each spec validated)."""
    return {prefix: spec_from_args(s, args, prefix=prefix) for prefix, s in {"spec": spec, **STAGES}.items()}


def describe(converted: pipeline.Converted) -> str:
    """One line on what `pipeline.convert` wrote."""
    record = converted.closed_form
    line = {"gqa": gqa.describe, "mla": mla.describe, "expand": expand.describe}[record["kind"]](record)
    if converted.refined is not None:
        line += f", refined ({refine_summary(converted.refined)})"
    return line


def main(prog: str, doc: str, spec: type, argv: list[str] | None = None) -> int:
    """Parse `argv`, run the pipeline, print one line: exit status 0, or 2 for bad input."""
    args = build_parser(prog, doc, spec).parse_args(argv)

    def convert_and_report() -> None:
        start = time.perf_counter()
        specs = specs_from_args(spec, args)  # (an expansion is never refined: `pipeline.convert`)
        converted = pipeline.convert(
            specs.pop("spec"), src=args.model, dst=args.output, progress=True, **specs
        )
        print(f"{describe(converted)} in {time.perf_counter() - start:.1f} s: {converted.path}")

    return run_command(prog, convert_and_report)


def gqa_main(argv: list[str] | None = None) -> int:
    """`hf-attn convert gqa` (`python -m conversion.gqa`)."""
    return main(gqa.PROG, gqa.__doc__, GQASpec, argv)


def mla_main(argv: list[str] | None = None) -> int:
    """`hf-attn convert mla` (`python -m conversion.mla`)."""
    return main(mla.PROG, mla.__doc__, MLASpec, argv)


def expand_main(argv: list[str] | None = None) -> int:
    """`hf-attn convert expand` (`python -m conversion.expand`)."""
    return main(expand.PROG, expand.__doc__, ExpandSpec, argv)
