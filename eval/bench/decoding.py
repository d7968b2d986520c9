"""The one decode-timing protocol of the benchmarks (`hf-attn bench decode`,
`python -m benchmarks.mla_decode`).

    B: batch rows   P: prompt tokens   V: vocabulary

Prompt: token ids of the corpus (*Persuasion*, consecutive slices so rows differ and need no padding) for
real checkpoints; random ids only where a benchmark has random weights and no tokenizer. Prefill: the prompt
(B, P) goes into the model's own cache in chunks of `chunk` tokens (bounds the attention scores of
implementations that materialise them), `logits_to_keep=1`. Decode: greedy single-token forward calls with
the cache; the first `warmup` steps are not timed, each of the next `steps` is timed alone (synchronised on
CUDA), and decode tokens/s = B / median step time (the median ignores a step that a busy machine preempted).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from hf_attn.models.llama_mla.modeling_llama_mla import CACHE_ARG, CACHE_FIELD  # transformers 5.23 or 5.24
from hf_attn.tooling import loading
from hf_attn.tooling.corpus import load_corpus, tokenize

WARMUP = 2


def corpus_ids(model_path: str) -> torch.Tensor:
    """(N,) token ids of the default corpus under the checkpoint's tokenizer, every one within the model's
    embedding (`loading.check_token_ids`)."""
    tokenizer = loading.load_tokenizer(model_path)
    ids = tokenize(tokenizer, load_corpus())
    loading.check_token_ids(ids, loading.vocab_size(loading.load_config(model_path)), tokenizer=tokenizer)
    return ids


def prompt_rows(ids: torch.Tensor, batch_size: int, length: int) -> torch.Tensor:
    """(B, P) consecutive slices of the corpus ids `ids` (N,)."""
    if ids.numel() < batch_size * length:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than {batch_size} x {length}")
    return ids[: batch_size * length].view(batch_size, length)  # (N,) -> (B, P)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, *, chunk: int = 1024, cache=None):
    """Run `ids` (B, P) into `cache` (a new one if None) in chunks; return (cache, logits (B, V) of the last
    position)."""
    for start in range(0, ids.shape[1], chunk):
        window = ids[:, start : start + chunk]
        out = model(input_ids=window, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        cache = getattr(out, CACHE_FIELD)
    return cache, out.logits[:, -1]  # (B, 1, V) -> (B, V)


@dataclasses.dataclass(frozen=True)
class DecodeTiming:
    """Timed greedy decode steps: seconds of each timed step and the generated ids (B, warmup + steps)."""

    batch_size: int
    step_seconds: tuple[float, ...]
    generated: torch.Tensor

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Decode tokens/s of the whole batch: B / median step time."""
        return self.batch_size / self.median_step_seconds

    @property
    def seconds(self) -> float:
        """Wall seconds of the timed steps together."""
        return sum(self.step_seconds)


@torch.inference_mode()
def time_decode(model, cache, token: torch.Tensor, *, steps: int, warmup: int = WARMUP) -> DecodeTiming:
    """`warmup` untimed then `steps` timed greedy steps of one token per row, from `token` (B, 1) on `cache`
    (which grows by warmup + steps positions)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"decode steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    device = token.device
    times, generated = [], []
    for step in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=token, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        cache = getattr(out, CACHE_FIELD)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1, V) -> (B, 1)
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        generated.append(token)
    return DecodeTiming(token.shape[0], tuple(times), torch.cat(generated, dim=1))  # (B, warmup + steps)
