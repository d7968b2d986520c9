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
import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eval import common
from eval.corpus import load_corpus, tokenize
from eval.kv_cache import kv_bytes_per_token, measured_kv_bytes_per_token

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

    def to_dict(self) -> dict:
        return asdict(self)


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


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def batch_nll(
    model, input_ids: torch.Tensor, batch: list[Window], device, *, keep_logits: bool | None = None
) -> tuple[float, int]:
    """(sum of NLL in float64, tokens scored) of one batch of equally shaped windows."""
    ids = torch.stack([input_ids[w.begin : w.end] for w in batch]).to(device)  # (B, T)
    offset = batch[0].score_from - batch[0].begin  # first scored position inside the window
    targets = ids[:, offset:]  # (B, K) with K = T - offset
    if keep_logits is None:
        keep_logits = _accepts_logits_to_keep(model)
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

    With an `accelerate.Accelerator` of several processes, each evaluates its share of the windows and the
    (NLL, count) pairs are summed; without one, this process evaluates every window.
    """
    stride = check_window(context_length, stride)
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
    limit = common.max_positions(model.config)
    if limit is not None and context_length > limit:
        raise ValueError(
            f"context length {context_length} exceeds the model's maximum positions ({limit}); "
            f"use --context-length <= {limit}"
        )

    windows = plan_windows(n, context_length, stride)
    batches = plan_batches(windows, batch_size)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = batches[rank::world]
    device = common.model_device(model)
    keep_logits = _accepts_logits_to_keep(model)
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
            bar.set_postfix(ppl=f"{math.exp(nll_sum / count):.3f}")
    if accelerator is not None and world > 1:
        sums = torch.tensor([nll_sum, count, forwarded], dtype=torch.float64, device=accelerator.device)
        nll_sum, count, forwarded = accelerator.reduce(sums, reduction="sum").tolist()
        count, forwarded = int(count), int(forwarded)
    seconds = time.perf_counter() - start
    assert count == sum(w.end - w.score_from for w in windows), (count, len(windows))
    return PerplexityResult(
        nll_sum=nll_sum,
        tokens_scored=count,
        perplexity=math.exp(nll_sum / count),
        context_length=context_length,
        stride=stride,
        windows=len(windows),
        seconds=seconds,
        tokens_per_second=forwarded / seconds,
        tokens_forwarded=forwarded,
    )


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
    torch_dtype = common.parse_dtype(dtype)
    common.check_attn_implementation(attn_implementation)
    corpus = load_corpus(
        texts, dataset=dataset, dataset_config=dataset_config, split=split, text_column=text_column
    )
    model_path = common.resolve_model(model)
    config = common.load_config(model_path)
    limit = common.max_positions(config)
    if limit is not None and context_length > limit:
        raise ValueError(
            f"context length {context_length} exceeds the model's maximum positions ({limit}); "
            f"use --context-length <= {limit}"
        )
    tokenizer = common.load_tokenizer(model_path)
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
    lm = common.load_causal_lm(
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
        "checkpoint_hash": common.model_hash(model_path),
        "model_type": lm.config.model_type,
        "attn_implementation": lm.config._attn_implementation,
        "dtype": common.dtype_name(torch_dtype),
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
        "versions": common.library_versions(),
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
    p = argparse.ArgumentParser(prog="python -m eval.perplexity", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES))
    p.add_argument("--device-map", default=None, help='e.g. "auto" to spread a large model over devices')
    p.add_argument("--output", default=None, help="write the JSON record here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
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
    except (ValueError, FileNotFoundError) as err:
        common.fail("eval.perplexity", err)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(
            f"perplexity {record['perplexity']:.4f} | {record['tokens_scored']} tokens of {record['corpus']} "
            f"(sha256 {record['corpus_sha256'][:12]}) | context {record['context_length']} stride "
            f"{record['stride']} | {record['attn_implementation']} {record['dtype']} | "
            f"{record['seconds']:.1f} s, {record['tokens_per_second']:.1f} tokens/s"
        )
    return record


if __name__ == "__main__":
    main()
