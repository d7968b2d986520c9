"""Corpus perplexity with sliding windows (the Transformers perplexity guide), on one or many processes.

Protocol: the corpus is tokenized once into N tokens. Window w covers tokens [w*stride, w*stride + L) (the
last one is cut at N; windows stop once one reaches the end). Token j is predicted from the tokens before it
in its window; each window scores only the tokens that no earlier window scored (all others get label -100),
so every token but the first is scored once when stride < L, and with stride == L (disjoint windows, the
protocol of GPTQ / SparseGPT / TransMLA) the first token of every window is context only. Corpus perplexity
= exp(sum of token NLL / number of scored tokens), the NLL summed in float64.

Speed: windows of equal shape are batched; only the scored positions reach the LM head (`logits_to_keep`), and
the cross-entropy runs over row chunks so no second full-vocabulary tensor is ever alive.

Many processes (`accelerate launch -m eval.perplexity ...`): the batches are dealt round-robin to the
processes and (NLL sum, token count) is summed with one reduce; the result equals the single-process one.

    python -m eval.perplexity --model PATH_OR_HUB_ID [--attn-implementation NAME]
        [--text FILE ... | --dataset NAME [--dataset-config C] [--split S] [--text-column COL]]
        [--context-length 1024] [--stride 1024] [--max-tokens N] [--batch-size B]
        [--dtype float32|bfloat16|float16] [--device-map auto] [--output results.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from hf_attn.eval.kv_cache import kv_bytes_per_token, measured_kv_bytes_per_token
from hf_attn.tooling import loading
from hf_attn.tooling.cli import error
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.perplexity import check_window, evaluate_perplexity

PROG = "hf-attn perplexity"


def run(
    *,
    model: str | Path | None = None,
    attn_implementation: str | None = None,
    texts: list[str | Path] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "test",
    text_column: str = "text",
    context_length: int = 1024,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 1,
    dtype: str = "float32",
    device_map: str | None = None,
    output: str | Path | None = None,
    progress: bool = True,
    accelerator=None,
) -> dict:
    """Load model and corpus, evaluate; return the JSON record (written to `output` by the main process)."""
    stride = check_window(context_length, stride)
    torch_dtype = loading.parse_dtype(dtype)
    loading.check_attn_implementation(attn_implementation)
    corpus = load_corpus(
        texts, dataset=dataset, dataset_config=dataset_config, split=split, text_column=text_column
    )
    model_path = str(loading.resolve_model(model))
    config = loading.load_config(model_path)
    limit = loading.max_positions(config)
    if limit is not None and context_length > limit:
        raise ValueError(
            f"context length {context_length} exceeds the model's maximum positions ({limit}); "
            f"use --context-length <= {limit}"
        )
    tokenizer = loading.load_tokenizer(model_path)
    input_ids = tokenize(tokenizer, corpus)
    n_tokens = min(input_ids.numel(), max_tokens or input_ids.numel())
    if n_tokens < context_length:  # fail before loading the weights (evaluate_perplexity checks again)
        raise ValueError(
            f"The corpus {corpus.name} has {n_tokens} tokens, fewer than one window of {context_length}; "
            "use a longer text, a larger --max-tokens or a smaller --context-length"
        )

    if accelerator is None:
        from accelerate import Accelerator

        # cpu=True where there is no accelerator: then `accelerate launch --multi_gpu --num_processes N` (or
        # torchrun) starts N CPU processes that accelerate joins with gloo (MULTI_CPU); else they stay apart.
        accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    lm = loading.load_causal_lm(
        model_path, attn_implementation=attn_implementation, dtype=torch_dtype, device_map=device_map
    )
    if device_map is None:
        lm.to(accelerator.device)
    result = evaluate_perplexity(
        lm,
        input_ids,
        context_length=context_length,
        stride=stride,
        batch_size=batch_size,
        max_tokens=max_tokens,
        accelerator=accelerator,
        progress=progress,
    )
    try:
        kv = kv_bytes_per_token(lm.config, torch_dtype).to_dict()
    except ValueError:
        kv = None
    record = {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "model_type": lm.config.model_type,
        "attn_implementation": lm.config._attn_implementation,
        "dtype": loading.dtype_name(torch_dtype),
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "corpus_tokens": int(input_ids.numel()),
        "max_tokens": max_tokens,
        "tokens_scored": result.tokens_scored,
        "context_length": result.context_length,
        "stride": result.stride,
        "windows": result.windows,
        "batch_size": batch_size,
        "nll_sum": result.nll_sum,
        "perplexity": result.perplexity,
        "seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second,
        "tokens_forwarded": result.tokens_forwarded,
        "processes": accelerator.num_processes,
        "device": str(accelerator.device) if device_map is None else f"device_map={device_map}",
        "kv_bytes_per_token": kv,
        "kv_bytes_per_token_measured": measured_kv_bytes_per_token(lm).to_dict(),
        "versions": loading.library_versions(),
    }
    if output is not None and accelerator.is_main_process:
        write_json(record, output)
    return record


def write_json(record: dict, output: str | Path) -> None:
    """Write a JSON file atomically (temp file + rename)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(output)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    p.add_argument("--attn-implementation", default=None, help="eager, sdpa, hf_attn_grouped, ...")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--text", nargs="+", default=None, metavar="FILE", help="text file(s) (default: Persuasion)"
    )
    src.add_argument("--dataset", default=None, help="datasets id, e.g. wikitext")
    p.add_argument("--dataset-config", default=None, help="e.g. wikitext-2-raw-v1")
    p.add_argument("--split", default="test")
    p.add_argument("--text-column", default="text")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--stride", type=int, default=None, help="default: the context length (disjoint windows)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=list(loading.DTYPES))
    p.add_argument("--device-map", default=None, help='e.g. "auto" to spread a large model over devices')
    p.add_argument("--output", default=None, help="write the JSON record here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        record = run(
            model=args.model,
            attn_implementation=args.attn_implementation,
            texts=args.text,
            dataset=args.dataset,
            dataset_config=args.dataset_config,
            split=args.split,
            text_column=args.text_column,
            context_length=args.context_length,
            stride=args.stride,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device_map=args.device_map,
            output=args.output,
            progress=not args.no_progress,
        )
    except (ValueError, OSError, KeyError) as err:
        return error(PROG, err)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(
            f"perplexity {record['perplexity']:.4f} | {record['tokens_scored']} tokens of {record['corpus']} "
            f"(sha256 {record['corpus_sha256'][:12]}) | context {record['context_length']} stride "
            f"{record['stride']} | {record['attn_implementation']} {record['dtype']} | "
            f"{record['seconds']:.1f} s, {record['tokens_per_second']:.1f} tokens/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
