"""Decode benchmark: tokens/s of greedy decoding after a long prompt, for any checkpoint and attention
implementation, with peak memory. A benchmark (run it once, read the JSON), not a test.

Each measurement follows the decode protocol of `eval/bench/decoding.py`: batch `B` prompts of `P` corpus
tokens prefilled in chunks of `--prefill-chunk` (timed apart), then greedy single-token steps:
`decoding.WARMUP` untimed, `new_tokens - 1` timed (the first new token comes from the prefill); decode
tokens/s = B / median step time. The loop is written out rather than `generate()` so that prefill and
decode are timed apart; it is the same greedy computation. Peak memory: `eval/bench/memory.py`.

    python -m eval.bench.decode [--model PATH] [--attn-implementation NAME ...]
        [--prompt-tokens 1024 4096 8192] [--batch-sizes 1 4] [--new-tokens 32] [--load-dtype float32]
        [--prefill-chunk 1024] [--quick] [--output FILE.json]
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_attn.eval.bench import decoding
from hf_attn.eval.bench.memory import PeakMemory
from hf_attn.eval.kv_cache import cache_tensor_bytes, kv_bytes_per_token
from hf_attn.tooling import loading
from hf_attn.tooling.cli import ArgumentParser, add_deprecated_alias, run_command
from hf_attn.tooling.devices import resolve_device
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json

PROG = "hf-attn bench decode"

PROMPTS, BATCHES, NEW_TOKENS = (1024, 4096, 8192), (1, 4), 32
QUICK_PROMPTS, QUICK_BATCHES, QUICK_NEW_TOKENS = (128,), (1, 4), 8


def _model(model_path: str, attn_implementation: str | None, dtype: torch.dtype):
    """The loaded model, reused across calls while the checkpoint's files are unchanged."""
    files = sorted(Path(model_path).iterdir()) if Path(model_path).is_dir() else []
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _load_model(model_path, attn_implementation, dtype, stamp)


@functools.lru_cache(maxsize=1)
def _load_model(model_path: str, attn_implementation: str | None, dtype: torch.dtype, stamp: tuple):
    lm = loading.load_causal_lm(model_path, attn_implementation=attn_implementation, dtype=dtype)
    return lm.to(resolve_device("auto"))


def bench_decode(
    model_path: str | Path | None = None,
    *,
    attn_implementation: str | None = None,
    prompt_tokens: int = 1024,
    batch_size: int = 1,
    new_tokens: int = NEW_TOKENS,
    load_dtype: str | torch.dtype = "float32",
    prefill_chunk: int = 1024,
) -> dict:
    """Greedy decoding speed after a `prompt_tokens`-token prompt at `batch_size`; returns the JSON record.
    The numbers must be positive integers (`run` and the study's `check_settings` check them)."""
    warmup = decoding.WARMUP
    model_path = str(loading.resolve_model(model_path))
    torch_dtype = loading.parse_dtype(load_dtype)
    limit = loading.max_positions(loading.load_config(model_path))
    if limit is not None and prompt_tokens + new_tokens + warmup > limit:
        raise UserError(
            f"prompt + new + warmup tokens ({prompt_tokens} + {new_tokens} + {warmup}) exceed the model's "
            f"maximum positions ({limit}); use shorter prompts"
        )
    prompts = decoding.prompt_rows(decoding.corpus_ids(model_path), batch_size, prompt_tokens)  # (B, P)
    model = _model(model_path, attn_implementation, torch_dtype)
    device = loading.model_device(model)
    prompts = prompts.to(device)
    steps = new_tokens - 1  # the first new token comes from the prefill

    with torch.inference_mode(), PeakMemory(device) as memory:
        decoding.sync(device)
        start = time.perf_counter()
        cache, logits = decoding.prefill(model, prompts, chunk=prefill_chunk)
        token = logits.argmax(-1, keepdim=True)  # (B, V) -> (B, 1)
        decoding.sync(device)
        prefill_seconds = time.perf_counter() - start
        timing = decoding.time_decode(model, cache, token, steps=steps, warmup=warmup) if steps else None
        kv_measured = cache_tensor_bytes(cache)
    generated = token if timing is None else torch.cat([token, timing.generated], dim=1)  # (B, 1 + steps)
    try:
        kv_per_token = kv_bytes_per_token(model.config, torch_dtype).total
    except ValueError:
        kv_per_token = None
    return {
        "model": model_path,
        "attn_implementation": model.config._attn_implementation,
        "dtype": loading.dtype_name(torch_dtype),
        "device": str(device),
        "prompt_tokens": prompt_tokens,
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "prefill_chunk": prefill_chunk,
        "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_second": batch_size * prompt_tokens / prefill_seconds,
        "decode_seconds": timing and timing.seconds,
        "decode_steps": steps,
        "decode_warmup_steps": warmup if steps else 0,
        "decode_median_step_seconds": timing and timing.median_step_seconds,
        "decode_tokens_per_second": timing and timing.tokens_per_second,
        "decode_tokens_per_second_per_sequence": timing and 1 / timing.median_step_seconds,
        "peak_memory_bytes": memory.peak,
        "memory_before_bytes": memory.before,
        "memory_method": memory.method,
        "kv_cache_bytes_measured": kv_measured,
        "kv_bytes_per_token": kv_per_token,
        "first_generated_ids": generated[0, :8].tolist(),
        "torch_threads": torch.get_num_threads(),
    }


def run(
    *,
    model: str | Path | None = None,
    attn_implementations: list[str | None] | None = None,
    prompt_tokens: tuple[int, ...] = PROMPTS,
    batch_sizes: tuple[int, ...] = BATCHES,
    new_tokens: int = NEW_TOKENS,
    load_dtype: str = "float32",
    prefill_chunk: int = 1024,
    output: str | Path | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Every (attention implementation, prompt, batch) measurement; `on_result` sees each as it lands."""
    names = attn_implementations or [None]
    for name in names:
        loading.check_attn_implementation(name)
    numbers = [("--prompt-tokens", p) for p in prompt_tokens] + [("--batch-sizes", b) for b in batch_sizes]
    for flag, value in [*numbers, ("--new-tokens", new_tokens), ("--prefill-chunk", prefill_chunk)]:
        check_number(flag, value, minimum=1, inclusive=True, integer=True)
    loading.parse_dtype(load_dtype)
    if output is not None:
        check_output(None, output, overwrite=True, kind="json")
    model_path = str(loading.resolve_model(model))
    config = loading.check_checkpoint_complete(model_path)
    limit = loading.max_positions(config)
    longest = max(prompt_tokens) + new_tokens + decoding.WARMUP
    if limit is not None and longest > limit:
        raise UserError(
            f"--prompt-tokens {max(prompt_tokens)} + --new-tokens {new_tokens} + {decoding.WARMUP} warm-up "
            f"tokens exceed the model's {limit} positions; use shorter prompts"
        )
    decoding.corpus_ids(model_path)  # the prompts' tokens fit the embedding: checked before any run
    fixed = {"new_tokens": new_tokens, "load_dtype": load_dtype, "prefill_chunk": prefill_chunk}
    results = []
    for name, p, b in itertools.product(names, prompt_tokens, batch_sizes):
        r = bench_decode(model_path, attn_implementation=name, prompt_tokens=p, batch_size=b, **fixed)
        results.append(r)
        if on_result is not None:
            on_result(r)
    record = {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "results": results,
        "versions": loading.library_versions(),
    }
    if output is not None:
        write_json(output, record, prog=PROG)
    return record


def result_line(r: dict) -> str:
    """One measurement as the line `hf-attn bench decode` prints."""
    decode = r["decode_tokens_per_second"] or float("nan")
    return (
        f"{r['attn_implementation']:>16} prompt {r['prompt_tokens']:>5} batch {r['batch_size']}: "
        f"decode {decode:8.2f} tokens/s, "
        f"prefill {r['prefill_tokens_per_second']:8.1f} tokens/s, "
        f"peak memory {r['peak_memory_bytes'] / 2**20:8.1f} MiB, "
        f"KV cache {r['kv_cache_bytes_measured'] / 2**20:7.1f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory or hub id (default: the embedded SmolLM2)")
    p.add_argument("--attn-implementation", action="append", default=None, help="repeatable")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help=f"default {PROMPTS}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=f"default {BATCHES}")
    p.add_argument("--new-tokens", type=int, default=None, help=f"default {NEW_TOKENS}")
    dtype_flag = {"type": str, "choices": list(loading.DTYPES)}
    p.add_argument("--load-dtype", default="float32", help="dtype the weights are loaded in", **dtype_flag)
    add_deprecated_alias(p, "--dtype", new_flag="--load-dtype", dest="load_dtype", **dtype_flag)
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill forward")
    p.add_argument(
        "--quick", action="store_true", help=f"prompt {QUICK_PROMPTS}, {QUICK_NEW_TOKENS} new tokens"
    )
    p.add_argument("--output", default=None, help="also write the JSON record here (default: print only)")
    args = p.parse_args(argv)
    defaults = (
        (QUICK_PROMPTS, QUICK_BATCHES, QUICK_NEW_TOKENS) if args.quick else (PROMPTS, BATCHES, NEW_TOKENS)
    )
    return run_command(
        PROG,
        lambda: run(
            model=args.model,
            attn_implementations=args.attn_implementation,
            prompt_tokens=tuple(args.prompt_tokens or defaults[0]),
            batch_sizes=tuple(args.batch_sizes or defaults[1]),
            new_tokens=defaults[2] if args.new_tokens is None else args.new_tokens,
            load_dtype=args.load_dtype,
            prefill_chunk=args.prefill_chunk,
            output=args.output,
            on_result=lambda r: print(result_line(r), flush=True),
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
