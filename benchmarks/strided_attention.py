"""The refinement's strided attention against PyTorch's fused attention under the same mask (fwd + bwd).

A refinement step with `--loss-stride 2` computes the attention for every 2nd query of a 1,024-token window
over the keys each query sees (`conversion.refine_fit.strided_queries_attention`: query chunks over the keys
up to their last query, explicit matmuls, a float32 softmax). The reference is what it replaced: one
`scaled_dot_product_attention` call of every strided query over every key under a boolean causal mask, with
the grouped K/V heads (`enable_gqa`). Both run under the refinement's autocast (`--dtype`) on random tensors
of a model's attention shape; the figure is the median of `--repeats` forward + backward passes.

    python -m benchmarks.strided_attention [--shapes smollm2 llama-3-8b] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import statistics
import time

import torch

from hf_attn.conversion.refine_fit import autocast, strided_queries_attention
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import check_number
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.strided_attention"
SHAPES = {  # (query heads, KV heads, head dim) of each model's attention
    "smollm2": (9, 3, 64),
    "llama-3-8b": (32, 8, 128),
}


def fused(query, key, value, rows):
    """The replaced computation: every strided query over every key, one fused call under a causal mask."""
    t = query.shape[2]
    at = torch.arange(t)[rows][:, None]  # (Tq, 1)
    mask = torch.arange(t)[None] <= at  # (Tq, T)
    return torch.nn.functional.scaled_dot_product_attention(
        query[:, :, rows], key, value, attn_mask=mask, enable_gqa=True
    )


def seconds(fn, shape: tuple, window: int, stride: int, dtype: str, repeats: int) -> float:
    """Median seconds of fn's forward + backward at `shape` (Hq, Hkv, D) on one `window`."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, h, window, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]
    rows = slice(0, None, stride)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        with autocast(torch.device("cpu"), dtype):
            out = fn(*tensors, rows)
        out.float().pow(2).mean().backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the step dtype")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)

    def bench() -> None:
        for flag in ("--window", "--stride", "--repeats"):
            check_number(flag, getattr(args, flag[2:]), minimum=1, inclusive=True, integer=True)
        if args.threads is not None:
            check_number("--threads", args.threads, minimum=1, inclusive=True, integer=True)
            torch.set_num_threads(args.threads)
        ours = lambda q, k, v, rows: strided_queries_attention(None, q, k, v, None, query_rows=rows)[0]  # noqa: E731
        rows = []
        for name in args.shapes:
            shape = (SHAPES[name], args.window, args.stride, args.dtype, args.repeats)
            a, b = seconds(fused, *shape), seconds(ours, *shape)
            rows.append([name, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{a / b:.2f}x"])
        threads = torch.get_num_threads()
        print(f"{args.dtype}, window {args.window}, one query in {args.stride}, {threads} threads")
        print(markdown_table(["shape", "fused, mask (ms)", "strided (ms)", "speed-up"], rows, align="lrrr"))

    return run_command(PROG, bench)


if __name__ == "__main__":
    raise SystemExit(main())
