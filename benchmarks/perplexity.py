"""Throughput of the perplexity evaluation against the bare model's forward pass at the same window size.

Both sides run the same model on the same windows of *Persuasion* (`--windows` disjoint windows of
`--context-length` tokens), one window per forward, under `torch.inference_mode()`:
- bare: `model(input_ids=window, use_cache=False)`, full logits, nothing else (no loss, no labels);
- eval: `hf_attn.tooling.perplexity.evaluate_perplexity` (logits only for the scored positions, chunked
  cross-entropy, float64 accumulation, bookkeeping).
The two alternate `--repeats` times after one warm-up window; each side's best (shortest) pass is reported,
the most robust statistic on a shared machine, plus every pass. Target: eval >= 95% of bare tokens/s.

    python -m benchmarks.perplexity [--model PATH] [--attn-implementation sdpa] [--context-length 1024]
        [--windows 8] [--repeats 3] [--load-dtype float32] [--threads N] [--output FILE.json]

`--load-dtype` is the dtype the weights are loaded in (`--dtype` is its deprecated spelling).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hf_attn.eval.perplexity import evaluate_perplexity
from hf_attn.tooling import loading
from hf_attn.tooling.cli import ArgumentParser, add_deprecated_alias, run_command
from hf_attn.tooling.corpus import load_corpus, tokenize
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json

PROG = "python -m benchmarks.perplexity"
WRITER = "hf-attn benchmarks.perplexity"  # its JSON's written_by: an hf-attn output (the output guard)


def bare_forward_seconds(model, windows: torch.Tensor) -> float:
    """Seconds for `model(window)` over every row of `windows` (W, L), one window per forward."""
    with torch.inference_mode():
        start = time.perf_counter()
        for row in windows:
            model(input_ids=row.unsqueeze(0), use_cache=False)
        if row.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def bench_perplexity(
    model_path: str | Path | None = None,
    *,
    attn_implementation: str | None = "sdpa",
    context_length: int = 1024,
    windows: int = 8,
    repeats: int = 3,
    load_dtype: str = "float32",
) -> dict:
    check_number("--context-length", context_length, minimum=2, inclusive=True, integer=True)
    check_number("--windows", windows, minimum=1, inclusive=True, integer=True)
    check_number("--repeats", repeats, minimum=1, inclusive=True, integer=True)
    loading.check_attn_implementation(attn_implementation)
    model_path = str(loading.resolve_model(model_path))
    config = loading.check_checkpoint_complete(model_path)
    limit = loading.max_positions(config)
    if limit is not None and context_length > limit:
        raise UserError(f"--context-length {context_length} exceeds the model's {limit} positions")
    tokenizer = loading.load_tokenizer(model_path)
    ids = tokenize(tokenizer, load_corpus())  # checked before the weights load
    loading.check_token_ids(ids, loading.vocab_size(config), tokenizer=tokenizer)
    n = windows * context_length
    if ids.numel() < n:
        raise UserError(
            f"the corpus has {ids.numel()} tokens, fewer than --windows {windows} x --context-length "
            f"{context_length}; ask for fewer or shorter windows"
        )
    model = loading.load_causal_lm(model_path, attn_implementation=attn_implementation, dtype=load_dtype)
    if torch.cuda.is_available():
        model.to("cuda")
    device = loading.model_device(model)
    ids = ids[:n].to(device)
    batch = ids.view(windows, context_length)  # (W, L)

    bare_forward_seconds(model, batch[:1])  # warm-up
    bare, evals, ppl = [], [], None
    for _ in range(repeats):
        bare.append(bare_forward_seconds(model, batch))
        res = evaluate_perplexity(model, ids, context_length=context_length, progress=False)
        evals.append(res.seconds)
        ppl = res.perplexity
    bare_tps, eval_tps = n / min(bare), n / min(evals)
    return {
        "model": model_path,
        "attn_implementation": model.config._attn_implementation,
        "dtype": loading.dtype_name(model.dtype),
        "device": str(device),
        "context_length": context_length,
        "windows": windows,
        "tokens": n,
        "repeats": repeats,
        "bare_forward_seconds": bare,
        "eval_seconds": evals,
        "bare_forward_tokens_per_second": bare_tps,
        "eval_tokens_per_second": eval_tps,
        "ratio": eval_tps / bare_tps,
        "perplexity": ppl,
        "versions": loading.library_versions(),
    }


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    dtype_flag = {"type": str, "choices": list(loading.DTYPES)}
    p.add_argument("--load-dtype", default="float32", help="dtype the weights are loaded in", **dtype_flag)
    add_deprecated_alias(p, "--dtype", new_flag="--load-dtype", dest="load_dtype", **dtype_flag)
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    p.add_argument("--output", default=None, help="also write the JSON record here (default: print only)")
    args = p.parse_args(argv)

    def bench() -> None:
        check_number("--threads", args.threads, minimum=1, inclusive=True, integer=True)
        if args.output is not None:
            check_output(None, args.output, overwrite=True, kind="json")
        if args.threads:
            torch.set_num_threads(args.threads)
        record = bench_perplexity(
            args.model,
            attn_implementation=args.attn_implementation,
            context_length=args.context_length,
            windows=args.windows,
            repeats=args.repeats,
            load_dtype=args.load_dtype,
        )
        if args.output is not None:
            write_json(args.output, record, prog=WRITER)
        print(
            f"bare forward {record['bare_forward_tokens_per_second']:.1f} tokens/s, perplexity evaluation "
            f"{record['eval_tokens_per_second']:.1f} tokens/s: ratio {record['ratio']:.3f} "
            f"({record['windows']} windows of {record['context_length']}, best of {record['repeats']}, "
            f"{record['versions']['torch_threads']} threads)"
        )

    return run_command(PROG, bench)


if __name__ == "__main__":
    raise SystemExit(main())
