"""Decode benchmark: tokens/s of greedy decoding after a long prompt, for any checkpoint and attention
implementation, with peak memory. A benchmark (run it once, read the JSON), not a test.

Each measurement: batch `B` prompts of `P` tokens (consecutive slices of *Persuasion*, so rows differ and
need no padding), prefilled into the model's own KV cache in chunks of `--prefill-chunk` tokens (bounds the
attention scores of implementations that materialise them), then `new_tokens` greedy steps of one token per
row, each a forward with the cache and `logits_to_keep=1`. Decode tokens/s = B * (new_tokens - 1) / decode
seconds (the first new token comes from the prefill, which is timed separately). The loop is written out
rather than `generate()` so that prefill and decode are timed apart; it is the same greedy computation.

Peak memory: on CPU the peak resident set size (VmHWM of /proc/self/status, reset through
/proc/self/clear_refs before each measurement; where that reset is impossible, the process-lifetime
`ru_maxrss`, marked as such); on CUDA `torch.cuda.max_memory_allocated` (reset before each measurement).

    python -m eval.bench_decode [--model PATH] [--attn-implementation NAME ...]
        [--prompt-tokens 1024 4096 8192] [--batch-sizes 1 4] [--new-tokens 32] [--dtype float32]
        [--prefill-chunk 1024] [--quick] [--output bench_decode.json]
"""

from __future__ import annotations

import argparse
import functools
import resource
import time
from pathlib import Path

import torch

from hf_attn.eval.kv_cache import cache_tensor_bytes, kv_bytes_per_token
from hf_attn.tooling import loading
from hf_attn.tooling.cli import error
from hf_attn.tooling.corpus import load_corpus, tokenize

PROG = "hf-attn bench decode"

PROMPTS, BATCHES, NEW_TOKENS = (1024, 4096, 8192), (1, 4), 32
QUICK_PROMPTS, QUICK_BATCHES, QUICK_NEW_TOKENS = (128,), (1, 4), 8


def _model(model_path: str, attn_implementation: str | None, dtype: torch.dtype):
    """The loaded model, reused across calls while the checkpoint's files are unchanged."""
    path = Path(model_path)
    stamp = (
        tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(path.iterdir()))
        if path.is_dir()
        else ()
    )
    return _load_model(model_path, attn_implementation, dtype, stamp)


@functools.lru_cache(maxsize=1)
def _load_model(model_path: str, attn_implementation: str | None, dtype: torch.dtype, stamp: tuple):
    lm = loading.load_causal_lm(model_path, attn_implementation=attn_implementation, dtype=dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return lm.to(device)


def _prompt_ids(model_path: str) -> torch.Tensor:
    return tokenize(loading.load_tokenizer(model_path), load_corpus())


class PeakMemory:
    """Peak memory of this process over a block: RSS high-water mark on CPU, allocated bytes on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @staticmethod
    def _rss_status(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            self.method = "torch.cuda.max_memory_allocated"
            return self
        self.before = self._rss_status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.method = "peak RSS (VmHWM, reset before the measurement)"
        except OSError:
            self.method = "peak RSS (ru_maxrss, whole process lifetime)"
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            hwm = self._rss_status("VmHWM")
            self.peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False


def bench_decode(
    model_path: str | Path | None = None,
    *,
    attn_implementation: str | None = None,
    prompt_tokens: int = 1024,
    batch_size: int = 1,
    new_tokens: int = NEW_TOKENS,
    dtype: str | torch.dtype = "float32",
    prefill_chunk: int = 1024,
) -> dict:
    """Greedy decoding speed after a `prompt_tokens`-token prompt at `batch_size`; returns the JSON record."""
    if prompt_tokens < 1 or batch_size < 1 or new_tokens < 1 or prefill_chunk < 1:
        raise ValueError(
            f"prompt_tokens, batch_size, new_tokens and prefill_chunk must be >= 1, got "
            f"{prompt_tokens}, {batch_size}, {new_tokens}, {prefill_chunk}"
        )
    model_path = str(loading.resolve_model(model_path))
    torch_dtype = loading.parse_dtype(dtype)
    config = loading.load_config(model_path)
    limit = loading.max_positions(config)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise ValueError(
            f"prompt + new tokens ({prompt_tokens} + {new_tokens}) exceed the model's maximum positions "
            f"({limit}); use shorter prompts"
        )
    corpus_ids = _prompt_ids(model_path)
    if corpus_ids.numel() < batch_size * prompt_tokens:
        raise ValueError(
            f"the corpus has {corpus_ids.numel()} tokens, fewer than {batch_size} x {prompt_tokens}"
        )
    model = _model(model_path, attn_implementation, torch_dtype)
    device = loading.model_device(model)
    prompts = corpus_ids[: batch_size * prompt_tokens].view(batch_size, prompt_tokens).to(device)  # (B, P)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode(), PeakMemory(device) as memory:
        start = time.perf_counter()
        cache = None
        for i in range(0, prompt_tokens, prefill_chunk):
            out = model(
                input_ids=prompts[:, i : i + prefill_chunk],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        sync()
        prefill_seconds = time.perf_counter() - start
        generated = [token]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            generated.append(token)
        sync()
        decode_seconds = time.perf_counter() - start
        kv_measured = cache_tensor_bytes(cache)
    steps = new_tokens - 1  # the first new token comes from the prefill
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
        "decode_seconds": decode_seconds,
        "decode_steps": steps,
        "decode_tokens_per_second": batch_size * steps / decode_seconds if steps else None,
        "tokens_per_second": batch_size * steps / decode_seconds if steps else None,  # = decode tokens/s
        "decode_tokens_per_second_per_sequence": steps / decode_seconds if steps else None,
        "peak_memory_bytes": memory.peak,
        "memory_before_bytes": memory.before,
        "memory_method": memory.method,
        "kv_cache_bytes_measured": kv_measured,
        "kv_bytes_per_token": kv_per_token,
        "first_generated_ids": torch.cat(generated, dim=1)[0, :8].tolist(),
        "torch_threads": torch.get_num_threads(),
    }


def run(
    *,
    model: str | Path | None = None,
    attn_implementations: list[str | None] | None = None,
    prompt_tokens: tuple[int, ...] = PROMPTS,
    batch_sizes: tuple[int, ...] = BATCHES,
    new_tokens: int = NEW_TOKENS,
    dtype: str = "float32",
    prefill_chunk: int = 1024,
    output: str | Path | None = None,
) -> dict:
    from hf_attn.eval.perplexity import write_json

    names = attn_implementations or [None]
    for name in names:
        loading.check_attn_implementation(name)
    model_path = str(loading.resolve_model(model))
    results = []
    for name in names:
        for p in prompt_tokens:
            for b in batch_sizes:
                r = bench_decode(
                    model_path,
                    attn_implementation=name,
                    prompt_tokens=p,
                    batch_size=b,
                    new_tokens=new_tokens,
                    dtype=dtype,
                    prefill_chunk=prefill_chunk,
                )
                results.append(r)
                mib = {k: r[k] / 2**20 for k in ("peak_memory_bytes", "kv_cache_bytes_measured")}
                print(
                    f"{r['attn_implementation']:>16} prompt {p:>5} batch {b}: "
                    f"decode {r['decode_tokens_per_second']:8.2f} tokens/s, "
                    f"prefill {r['prefill_tokens_per_second']:8.1f} tokens/s, "
                    f"peak memory {mib['peak_memory_bytes']:8.1f} MiB, "
                    f"KV cache {mib['kv_cache_bytes_measured']:7.1f} MiB",
                    flush=True,
                )
    record = {
        "model": model_path,
        "checkpoint_hash": loading.model_hash(model_path),
        "results": results,
        "versions": loading.library_versions(),
    }
    if output is not None:
        write_json(record, output)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    p.add_argument("--attn-implementation", action="append", default=None, help="repeatable")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help=f"default {PROMPTS}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=f"default {BATCHES}")
    p.add_argument("--new-tokens", type=int, default=None, help=f"default {NEW_TOKENS}")
    p.add_argument("--dtype", default="float32", choices=list(loading.DTYPES))
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument(
        "--quick", action="store_true", help=f"prompt {QUICK_PROMPTS}, {QUICK_NEW_TOKENS} new tokens"
    )
    p.add_argument("--output", default="bench_decode.json")
    args = p.parse_args(argv)
    try:
        run(
            model=args.model,
            attn_implementations=args.attn_implementation,
            prompt_tokens=tuple(args.prompt_tokens or (QUICK_PROMPTS if args.quick else PROMPTS)),
            batch_sizes=tuple(args.batch_sizes or (QUICK_BATCHES if args.quick else BATCHES)),
            new_tokens=args.new_tokens or (QUICK_NEW_TOKENS if args.quick else NEW_TOKENS),
            dtype=args.dtype,
            prefill_chunk=args.prefill_chunk,
            output=args.output,
        )
    except (ValueError, OSError, KeyError) as err:
        return error(PROG, err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
