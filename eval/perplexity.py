"""Corpus perplexity with sliding windows (the Transformers perplexity guide), on one or many processes.

The protocol (windows, scoring, batching, the (NLL, count) reduce across processes) is
`hf_attn.tooling.perplexity`; this module is its command line, `hf-attn perplexity` (settings: one dataclass,
`PerplexitySettings`; `accelerate launch -m eval.perplexity ...` runs it on many processes).

    python -m eval.perplexity --model PATH_OR_HUB_ID [--attn-implementation NAME]
        [--text FILE ... | --dataset NAME [--dataset-config C] [--split S] [--text-column COL]]
        [--context-length 1024] [--stride 1024] [--max-tokens N] [--batch-size B]
        [--load-dtype float32|bfloat16|float16] [--device auto|cpu|cuda | --device-map auto]
        [--output results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from hf_attn.eval.kv_cache import kv_bytes_per_token, measured_kv_bytes_per_token
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import (
    ArgumentParser,
    add_settings_arguments,
    run_command,
    setting,
    settings_from_args,
)
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICES, announce_device, resolve_device
from hf_attn.tooling.errors import UserError, check_number, user_input
from hf_attn.tooling.files import check_output, check_text_files, sha256_file, write_json
from hf_attn.tooling.perplexity import evaluate_perplexity

PROG = "hf-attn perplexity"


@dataclasses.dataclass(frozen=True)
class PerplexitySettings:
    """What `run` evaluates and how; `hf-attn perplexity`'s options are built from these fields."""

    model: str | None = setting(None, help="checkpoint directory or hub id (default: the embedded SmolLM2)")
    attn_implementation: str | None = setting(None, help="eager, sdpa, hf_attn_grouped, ...")
    texts: list[str] | None = setting(
        None, help="text file(s) (default: Persuasion)", flag="--text", metavar="FILE", exclusive="corpus"
    )
    dataset: str | None = setting(None, help="datasets id, e.g. wikitext", exclusive="corpus")
    dataset_config: str | None = setting(None, help="e.g. wikitext-2-raw-v1")
    split: str = setting("test")
    text_column: str = setting("text")
    context_length: int = setting(1024)
    stride: int | None = setting(None, help="default: the context length (disjoint windows)")
    max_tokens: int | None = setting(None, help="evaluate only the first N tokens")
    batch_size: int = setting(1)
    load_dtype: str = setting(
        "float32",
        help="dtype the weights are loaded in",
        choices=list(loading.DTYPES),
        deprecated_flags=("--dtype",),
    )
    device: str = setting(DEFAULT_DEVICE, help=DEVICE_HELP, choices=DEVICES)
    device_map: str | None = setting(
        None, help='e.g. "auto" to spread a large model over devices (then --device is not used)'
    )
    output: str | None = setting(
        None, help="write the JSON record here (replaces only a JSON record hf-attn wrote; default: none)"
    )
    progress: bool = setting(True, help="no progress bar")


def calibrated_on(history: list[dict], files: list[Path]) -> list[str]:
    """Which of the scored `files` a step of a checkpoint's conversion history (`config.json["hf_attn"]
    ["history"]`) calibrated on, by sha256, as "NAME (STEP)": a perplexity on them is not held out."""
    if not history:
        return []
    digests = {sha256_file(f): Path(f).name for f in files}
    hits = {
        f"{digests[entry['sha256']]} ({step.get('kind', '?')})"
        for step in history
        for entry in (step.get("calibration") or {}).get("files", [])
        if entry.get("sha256") in digests
    }
    return sorted(hits)


def validate(settings: PerplexitySettings) -> str:
    """Every option checked before any work, nothing loaded or written: UserError naming the first bad one.
    Returns the model's directory (or hub id) resolved."""
    s = settings
    check_number("--context-length", s.context_length, minimum=2, inclusive=True, integer=True)
    check_number("--stride", s.stride, minimum=1, inclusive=True, integer=True)
    check_number("--max-tokens", s.max_tokens, minimum=2, inclusive=True, integer=True)
    check_number("--batch-size", s.batch_size, minimum=1, inclusive=True, integer=True)
    if s.stride is not None and s.stride > s.context_length:
        raise UserError(
            f"--stride {s.stride} exceeds --context-length {s.context_length}; use a smaller stride"
        )
    loading.parse_dtype(s.load_dtype)
    loading.check_attn_implementation(s.attn_implementation)
    resolve_device(s.device)  # --device cuda without CUDA: one line, before any loading
    if s.texts:
        check_text_files(s.texts, "--text")
    if s.output is not None:
        check_output(None, s.output, overwrite=True, flag="--output", kind="json")
    model_path = str(loading.resolve_model(s.model))
    config = loading.check_checkpoint_complete(model_path)
    limit = loading.max_positions(config)
    if limit is not None and s.context_length > limit:
        raise UserError(
            f"--context-length {s.context_length} exceeds the model's maximum positions ({limit}); "
            f"use --context-length <= {limit}"
        )
    return model_path


def run(settings: PerplexitySettings, *, accelerator=None) -> dict:
    """Validate, load model and corpus, evaluate; return the JSON record (written to `output` by the main
    process). The model must load completely (`loading.load_causal_lm`)."""
    s = settings
    model_path = validate(s)
    torch_dtype = loading.parse_dtype(s.load_dtype)
    with user_input():  # a dataset that cannot be read, an empty text
        corpus = load_corpus(
            s.texts,
            dataset=s.dataset,
            dataset_config=s.dataset_config,
            split=s.split,
            text_column=s.text_column,
        )
    config = loading.load_config(model_path)
    scored_files = [] if s.dataset else [Path(f) for f in s.texts] if s.texts else assets.eval_text_files()
    leaks = calibrated_on((getattr(config, "hf_attn", None) or {}).get("history", []), scored_files)
    tokenizer = loading.load_tokenizer(model_path)
    input_ids = tokenize(tokenizer, corpus)
    loading.check_token_ids(input_ids, loading.vocab_size(config), tokenizer=tokenizer)
    n_tokens = min(input_ids.numel(), s.max_tokens or input_ids.numel())
    if n_tokens < s.context_length:  # fail before loading the weights (evaluate_perplexity checks again)
        raise UserError(
            f"The corpus {corpus.name} has {n_tokens} tokens, fewer than one window of {s.context_length}; "
            "use a longer text, a larger --max-tokens or a smaller --context-length"
        )

    if accelerator is None:
        from accelerate import Accelerator

        # cpu=True where --device resolves to the CPU (auto: no CUDA device): then `accelerate launch
        # --multi_gpu --num_processes N` (or torchrun) starts N CPU processes that accelerate joins with gloo
        # (MULTI_CPU); else they stay apart. On CUDA, accelerate puts each process on its own GPU.
        accelerator = Accelerator(cpu=resolve_device(s.device).type == "cpu")
    lm = loading.load_causal_lm(
        model_path, attn_implementation=s.attn_implementation, dtype=torch_dtype, device_map=s.device_map
    )
    if s.device_map is None:
        lm.to(accelerator.device)
        if accelerator.is_main_process:  # the model loaded: the command's one line saying where it runs
            announce_device(accelerator.device)
    result = evaluate_perplexity(
        lm,
        input_ids,
        context_length=s.context_length,
        stride=s.stride,
        batch_size=s.batch_size,
        max_tokens=s.max_tokens,
        accelerator=accelerator,
        progress=s.progress,
    )
    record = _record(s, model_path, lm, torch_dtype, corpus, input_ids, result, accelerator, leaks)
    if leaks and accelerator.is_main_process:
        print(
            f"{PROG}: warning: {model_path} was calibrated on the text it is scored on ({', '.join(leaks)}): "
            "this perplexity is not a held-out measurement",
            file=sys.stderr,
        )
    if s.output is not None and accelerator.is_main_process:
        write_json(s.output, record, prog=PROG)
    return record


def _record(
    s: PerplexitySettings, model_path, lm, dtype, corpus, input_ids, result, accelerator, leaks
) -> dict:
    """The JSON record of one evaluation: the model and its KV cache per token, the corpus (name, hash,
    tokens), the protocol (context, stride, windows), the result, where it ran and the library versions.

    Args:
        model_path: the resolved checkpoint; lm: the loaded model; dtype: its load dtype.
        corpus: the evaluation text; input_ids: (N,) its tokens; result: `evaluate_perplexity`'s.
        accelerator: the processes it ran on; leaks: the scored files the model was calibrated on.
    """
    try:
        kv = kv_bytes_per_token(lm.config, dtype).to_dict()
    except ValueError:
        kv = None
    return {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "model_type": lm.config.model_type,
        "attn_implementation": lm.config._attn_implementation,
        "dtype": loading.dtype_name(dtype),
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "corpus_tokens": int(input_ids.numel()),
        "max_tokens": s.max_tokens,
        **{key: getattr(result, key) for key in ("tokens_scored", "context_length", "stride", "windows")},
        "batch_size": s.batch_size,
        **{key: getattr(result, key) for key in ("nll_sum", "perplexity", "seconds", "tokens_per_second")},
        "tokens_forwarded": result.tokens_forwarded,
        "processes": accelerator.num_processes,
        "device": str(accelerator.device) if s.device_map is None else f"device_map={s.device_map}",
        "kv_bytes_per_token": kv,
        "kv_bytes_per_token_measured": measured_kv_bytes_per_token(lm).to_dict(),
        "calibrated_on_scored_text": leaks,
        "versions": loading.library_versions(),
    }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_settings_arguments(p, PerplexitySettings)
    return p


def summary(record: dict) -> str:
    """The one line `hf-attn perplexity` prints."""
    return (
        f"perplexity {record['perplexity']:.4f} | {record['tokens_scored']} tokens of {record['corpus']} "
        f"(sha256 {record['corpus_sha256'][:12]}) | context {record['context_length']} stride "
        f"{record['stride']} | {record['attn_implementation']} {record['dtype']} | "
        f"{record['seconds']:.1f} s, {record['tokens_per_second']:.1f} tokens/s"
    )


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(PerplexitySettings, build_parser().parse_args(argv))

    def evaluate() -> None:
        record = run(settings)
        from accelerate import PartialState

        if PartialState().is_main_process:
            print(summary(record))

    return run_command(PROG, evaluate)


if __name__ == "__main__":
    raise SystemExit(main())
