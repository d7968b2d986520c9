"""Parser pieces shared by the converters (`hf-attn convert expand | gqa | mla`).

Converters are keyword-only functions; their `main(argv) -> int` only builds a parser from these pieces and
calls `run`, which goes through the one error path (`hf_attn.tooling.cli`: one line, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from hf_attn.conversion import calibration as cal
from hf_attn.conversion import layerwise
from hf_attn.conversion.checkpoint import latest_record
from hf_attn.conversion.refine import RefineSettings, refine, refine_summary
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import ArgumentParser, add_deprecated_alias, add_settings_arguments, run_command
from hf_attn.tooling.errors import check_number, user_input
from hf_attn.tooling.files import check_output, check_text_files, scratch_directory


def converter_parser(prog: str, doc: str, *, output_help: str) -> argparse.ArgumentParser:
    """A parser with --model (default: the embedded SmolLM2) and --output; described by `doc`'s first line."""
    parser = ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded SmolLM2)")
    parser.add_argument("--output", required=True, help=output_help)
    return parser


def add_calibration_arguments(parser: argparse.ArgumentParser, *, default_tokens: int) -> None:
    """--calibration-text FILE... or --calibration-corpus NAME; --calibration-tokens/-window N; and where the
    layer-by-layer calibration forward runs: --device, --forward-dtype (`layerwise.ForwardSettings`)."""
    text = parser.add_mutually_exclusive_group()
    text.add_argument(
        "--calibration-text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="calibration text files, equal token shares, a file listed k times k shares (default: "
        "--calibration-corpus mix)",
    )
    text.add_argument(
        "--calibration-corpus",
        choices=assets.CORPORA,
        default=None,
        help="an embedded calibration corpus instead of files: austen (five novels), python-docs (five "
        "sections of the Python 3.11 docs) or mix (equal token shares of both; the default)",
    )
    parser.add_argument("--calibration-tokens", type=int, default=default_tokens, help="calibration tokens")
    parser.add_argument(
        "--calibration-window", type=int, default=cal.DEFAULT_WINDOW, help="tokens per calibration forward"
    )
    add_settings_arguments(parser, layerwise.ForwardSettings)


def add_write_arguments(parser: argparse.ArgumentParser) -> None:
    """--save-dtype (cast of the written weights; the old `--dtype` still works) and --overwrite."""
    parser.add_argument(
        "--save-dtype",
        default=None,
        help="dtype of the written floating weights (float32, bfloat16, float16; default: the source's)",
    )
    add_deprecated_alias(parser, "--dtype", new_flag="--save-dtype", dest="save_dtype")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that hf-attn wrote (a checkpoint)",
    )


CLOSED_FORM_SOURCE = "the closed form of the record before (not kept)"  # `--refine-steps`: refine's `source`


def add_refine_arguments(parser: argparse.ArgumentParser) -> None:
    """--refine-steps N (0: the closed form only) and --refine-tokens: `hf-attn refine` in one command."""
    parser.add_argument(
        "--refine-steps",
        type=int,
        default=0,
        help="then refine every layer against the source with N Adam steps (hf-attn refine; 0: off, the "
        f"default; hf-attn refine's default: {RefineSettings.steps}; the study's: 8)",
    )
    parser.add_argument(
        "--refine-tokens",
        type=int,
        default=RefineSettings.calibration_tokens,
        help=f"calibration tokens of the refinement (default {RefineSettings.calibration_tokens})",
    )


def calibration_options(args: argparse.Namespace) -> dict:
    """The converter keywords of `add_calibration_arguments`."""
    return {
        "calibration_files": args.calibration_text,
        "calibration_corpus": args.calibration_corpus,  # resolved to files by `run` (fetching may fail there)
        "calibration_tokens": args.calibration_tokens,
        "calibration_window": args.calibration_window,
        "device": args.device,
        "forward_dtype": args.forward_dtype,
    }


def last_record(out: Path) -> dict:
    """The newest conversion record of the checkpoint at `out` (the end of config.json["hf_attn"]["history"])."""
    return latest_record(json.loads((Path(out) / "config.json").read_text()))


def check_options(args: argparse.Namespace) -> None:
    """The options every converter shares, checked before any work (nothing is read or written beyond
    headers): UserError naming the first bad one. The converter checks its own options and the source."""
    if getattr(args, "calibration_tokens", None) is not None:
        check_number("--calibration-tokens", args.calibration_tokens, minimum=1, inclusive=True, integer=True)
        check_number("--calibration-window", args.calibration_window, minimum=1, inclusive=True, integer=True)
        if args.calibration_text:
            check_text_files(args.calibration_text, "--calibration-text")
        with user_input():
            layerwise.resolve_forward(args.device, args.forward_dtype)
    if getattr(args, "refine_steps", None) is not None:
        check_number("--refine-steps", args.refine_steps, inclusive=True, integer=True)
        check_number("--refine-tokens", args.refine_tokens, minimum=1, inclusive=True, integer=True)
    if args.save_dtype is not None:
        loading.parse_dtype(args.save_dtype, "--save-dtype")
    source = loading.resolve_model(args.model)
    check_output(source, args.output, overwrite=args.overwrite)


def run(
    prog: str, convert: Callable, args: argparse.Namespace, *, describe: Callable[[Path], str], **options
) -> int:
    """convert(src=--model, dst=--output, dtype=--save-dtype, overwrite=--overwrite, **options): 0 or 2."""

    def convert_and_report() -> None:
        start = time.perf_counter()
        check_options(args)
        kwargs = dict(options)
        if kwargs.pop("calibration_corpus", None) is not None:
            kwargs["calibration_files"] = assets.calibration_corpus_files(options["calibration_corpus"])
        steps = getattr(args, "refine_steps", 0)
        if steps == 0:
            out = convert(
                src=args.model, dst=args.output, dtype=args.save_dtype, overwrite=args.overwrite, **kwargs
            )
            print(f"{describe(out)} in {time.perf_counter() - start:.1f} s: {out}")
            return
        refine_settings = _refine_settings(args, kwargs)  # checks its values before the conversion
        output = check_output(loading.resolve_model(args.model), args.output, overwrite=args.overwrite)
        with scratch_directory(".hf-attn-closed-form-", dir=output.parent) as scratch:
            closed = convert(
                src=args.model, dst=Path(scratch) / "closed-form", dtype=args.save_dtype, **kwargs
            )
            summary = describe(closed)
            record = refine(
                dataclasses.replace(refine_settings, model=str(closed)),
                progress=True,
                source_name=CLOSED_FORM_SOURCE,
            )
        print(
            f"{summary}, refined ({refine_summary(record)}) in {time.perf_counter() - start:.1f} s: {output}"
        )

    return run_command(prog, convert_and_report)


def _refine_settings(args: argparse.Namespace, kwargs: dict):
    """The `hf-attn refine` settings of `--refine-steps`: the conversion's calibration text, on --device."""
    files = kwargs.get("calibration_files")
    return RefineSettings(
        model="",  # the closed form, once written
        output=args.output,
        source=args.model,
        steps=args.refine_steps,
        calibration_tokens=args.refine_tokens,
        calibration_text=None if files is None else [str(f) for f in files],
        device=args.device,
        overwrite=args.overwrite,
    )
