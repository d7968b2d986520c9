"""Corpus perplexity with sliding windows: the pure protocol (window plan, batched NLL, one reduce).

Protocol: the corpus is tokenized once into N tokens. Window w covers tokens [w*stride, w*stride + L) (the
last one is cut at N; windows stop once one reaches the end). Token j is predicted from the tokens before it
in its window; each window scores only the tokens that no earlier window scored (all others get label -100),
so every token but the first is scored once when stride < L, and with stride == L (disjoint windows, the
protocol of GPTQ / SparseGPT / TransMLA) the first token of every window is context only. Corpus perplexity
= exp(sum of token NLL / number of scored tokens), the NLL summed in float64.

The command line (`hf-attn perplexity`, `python -m eval.perplexity`) is `eval.perplexity`; healing's held-out
evaluation calls `evaluate_perplexity` directly.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_attn.tooling import loading
from hf_attn.tooling.errors import UserError

_CE_ROWS = 256  # rows of logits per cross-entropy call: bounds the log-softmax temporary


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window
    end: int  # one past its last token
    score_from: int  # first token whose prediction this window scores (begin < score_from < end)


@dataclass
class PerplexityResult:
    nll_sum: float
    tokens_scored: int
    perplexity: float
    context_length: int
    stride: int
    windows: int
    seconds: float
    tokens_per_second: float  # tokens fed through the model (all window tokens) per wall second
    tokens_forwarded: int = 0


def check_window(context_length: int, stride: int | None) -> int:
    """Validate the window; returns the stride (None -> context_length)."""
    if not isinstance(context_length, int) or context_length < 2:
        raise ValueError(f"context length must be an integer >= 2, got {context_length!r}")
    stride = context_length if stride is None else stride
    if not isinstance(stride, int) or stride <= 0 or stride > context_length:
        raise ValueError(
            f"stride must satisfy 0 < stride <= context length ({context_length}), got {stride!r}"
        )
    return stride


def plan_windows(n_tokens: int, context_length: int, stride: int) -> list[Window]:
    """The windows of the sliding-window protocol (see the module docstring)."""
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context_length, n_tokens)
        score_from = max(prev_end, begin + 1)
        if end > score_from:
            windows.append(Window(begin, end, score_from))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def plan_batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of identical shape (length, scored offset) in batches of <= batch_size."""
    batches: list[list[Window]] = []
    shape = lambda w: (w.end - w.begin, w.score_from - w.begin)  # noqa: E731
    for w in windows:
        if batches and len(batches[-1]) < batch_size and shape(batches[-1][0]) == shape(w):
            batches[-1].append(w)
        else:
            batches.append([w])
    return batches


def batch_nll(
    model, input_ids: torch.Tensor, batch: list[Window], device, *, keep_logits: bool
) -> tuple[float, int]:
    """(sum of NLL in float64, tokens scored) of one batch of equally shaped windows; `keep_logits`: the model
    takes `logits_to_keep`, so only the scored positions reach its LM head."""
    ids = torch.stack([input_ids[w.begin : w.end] for w in batch]).to(device)  # (B, T)
    offset = batch[0].score_from - batch[0].begin  # first scored position inside the window
    targets = ids[:, offset:]  # (B, K) with K = T - offset
    if keep_logits:
        keep = torch.arange(offset - 1, ids.shape[1] - 1, device=device)  # positions predicting the targets
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits  # (B, K, V)
    else:
        logits = model(input_ids=ids, use_cache=False).logits[:, offset - 1 : -1]  # (B, K, V)
    logits = logits.reshape(-1, logits.shape[-1])  # (B*K, V)
    targets = targets.reshape(-1).to(logits.device)  # (B*K,)
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for i in range(0, targets.numel(), _CE_ROWS):
        nll = F.cross_entropy(logits[i : i + _CE_ROWS].float(), targets[i : i + _CE_ROWS], reduction="none")
        total += nll.sum(dtype=torch.float64)
    return total.item(), targets.numel()


def _evaluated_ids(
    model, input_ids: torch.Tensor, *, context_length: int, batch_size: int, max_tokens: int | None
) -> torch.Tensor:
    """The (n,) tokens `evaluate_perplexity` scores: `input_ids` (N,) cut to `max_tokens`; ValueError naming
    the fix for a bad batch size or shape, fewer tokens than one window, or a window longer than the model's
    maximum positions."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids must be one token stream of shape (N,), got shape {tuple(input_ids.shape)}"
        )
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max tokens must be >= 2, got {max_tokens}")
        input_ids = input_ids[:max_tokens]
    n = input_ids.numel()
    if n < context_length:
        raise ValueError(
            f"The corpus has {n} tokens, fewer than one window of {context_length}; "
            "use a longer text, a larger --max-tokens or a smaller --context-length"
        )
    limit = loading.max_positions(model.config)
    if limit is not None and context_length > limit:
        raise ValueError(
            f"context length {context_length} exceeds the model's maximum positions ({limit}); "
            f"use --context-length <= {limit}"
        )
    return input_ids


def _perplexity(nll_sum: float, count: int) -> float:
    """exp(mean NLL); inf where it overflows, NaN for a NaN sum."""
    try:
        return math.exp(nll_sum / count)
    except OverflowError:
        return math.inf


def evaluate_perplexity(
    model,
    input_ids: torch.Tensor,
    *,
    context_length: int = 1024,
    stride: int | None = None,
    batch_size: int = 1,
    max_tokens: int | None = None,
    accelerator=None,
    progress: bool = True,
) -> PerplexityResult:
    """Corpus perplexity of `model` on the token stream `input_ids` (N,) with the sliding-window protocol.

    With an `accelerate.Accelerator` of several processes (`accelerate launch -m eval.perplexity ...`), the
    batches are dealt round-robin to them and (NLL sum, token count) is summed with one reduce: the result
    equals one process's. Without one, this process evaluates every window.
    """
    stride = check_window(context_length, stride)
    input_ids = _evaluated_ids(
        model, input_ids, context_length=context_length, batch_size=batch_size, max_tokens=max_tokens
    )
    windows = plan_windows(input_ids.numel(), context_length, stride)
    batches = plan_batches(windows, batch_size)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = batches[rank::world]
    device = loading.model_device(model)
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    show = progress and (accelerator is None or accelerator.is_main_process)

    from tqdm.auto import tqdm

    if accelerator is not None:
        accelerator.wait_for_everyone()
    start = time.perf_counter()
    nll_sum, count, forwarded = 0.0, 0, 0
    with (
        torch.inference_mode(),
        tqdm(total=sum(len(b) for b in mine), desc="perplexity", disable=not show) as bar,
    ):
        for batch in mine:
            nll, k = batch_nll(model, input_ids, batch, device, keep_logits=keep_logits)
            nll_sum, count = nll_sum + nll, count + k
            forwarded += sum(w.end - w.begin for w in batch)
            bar.update(len(batch))
            bar.set_postfix(ppl=f"{_perplexity(nll_sum, count):.3f}")
    if accelerator is not None and world > 1:
        sums = torch.tensor([nll_sum, count, forwarded], dtype=torch.float64, device=accelerator.device)
        nll_sum, count, forwarded = accelerator.reduce(sums, reduction="sum").tolist()
        count, forwarded = int(count), int(forwarded)
    seconds = time.perf_counter() - start
    assert count == sum(w.end - w.score_from for w in windows), (count, len(windows))
    perplexity = _perplexity(nll_sum, count)
    if not math.isfinite(perplexity):
        dtype = next(model.parameters()).dtype
        fix = "repair the weights" if dtype == torch.float32 else "load it in float32, or repair the weights"
        raise UserError(
            f"the perplexity is not finite (NLL per token {nll_sum / count}): the model's logits overflow or "
            f"are not finite in {loading.dtype_name(dtype)}, and no number is reported for it; {fix}"
        )
    return PerplexityResult(
        nll_sum=nll_sum,
        tokens_scored=count,
        perplexity=perplexity,
        context_length=context_length,
        stride=stride,
        windows=len(windows),
        seconds=seconds,
        tokens_per_second=forwarded / seconds,
        tokens_forwarded=forwarded,
    )
