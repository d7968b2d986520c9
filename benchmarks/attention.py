"""Attention-function benchmark: `hf_attn_grouped` vs transformers' `sdpa` and `eager`, called as models do.

Protocol: for every query length T, KV length S, group size G (KV heads fixed, default 3: G = 3 is SmolLM2's
shape with 9 query heads, G = 9 has 27) and padding (none, or the first quarter of the cache is left padding),
each implementation gets the mask that its registered mask function builds for T new tokens against a cache
of S (`AttentionMaskInterface[name]`, q_offset = S - T, batch `--batch`) and is called as the Llama attention
layer calls it: `fn(module, query, key, value, mask, scaling=D**-0.5, dropout=0.0)`, with a stand-in module
(num_key_value_groups, is_causal=True, training=False), query (B, Hq, T, D) as the model's transposed view
and key/value (B, Hkv, S, D) contiguous as a DynamicCache holds them. Masks are built once, outside the
timing (a model builds one per forward and shares it across layers).

Time: the fastest of the samples taken after `--warmup` calls (the one least disturbed by other processes on
a shared machine; the JSON also has the median). A sample times enough back-to-back calls to last >= 20 ms and
reports the time per call; there are `--repeats` samples, more for short calls (up to 50, >= 1 s of samples
per implementation); implementations are interleaved sample by sample so that load hits them alike.
Peak memory: one more call under the torch profiler (`profile_memory=True`); the peak of torch's CPU
allocator ("Total Allocated") during the call minus its value before: every tensor the call allocates,
temporaries included, inputs and mask excluded.

"sdpa mode" says how transformers' sdpa treats the groups: natively (no mask: enable_gqa; one query token:
pack_gqa), by repeating K/V (`repeat_kv`: any mask with T > 1), or through repeat_kv where that is a free
stride-0 view (one KV head). Target: grouped within 10% of sdpa where sdpa copies nothing; >= 2x faster and
>= 2x less peak memory where it repeats K/V. The load average is recorded: the machine may be shared.

    python -m benchmarks.attention [--quick] [--query-lengths 1 16 512] [--kv-lengths 1024 4096 16384]
        [--group-sizes 3 9] [--kv-heads 3] [--head-dim 64] [--batch 1] [--dtype float32]
        [--repeats 5] [--warmup 1] [--threads 1] [--output results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_attn.tooling.cli import ArgumentParser, parse_with_quick, run_command
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json
from hf_attn.tooling.loading import dtype_name, library_versions, parse_dtype
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.attention"
WRITER = "hf-attn benchmarks.attention"  # its JSON's written_by: an hf-attn output (the output guard)

GROUPED = "hf_attn_grouped"
IMPLEMENTATIONS = (GROUPED, "sdpa", "eager")
MIN_SAMPLE_S = 0.02
MIN_TIME_S = 1.0
MAX_SAMPLES = 50
QUICK = {"query_lengths": [1, 16], "kv_lengths": [1024], "group_sizes": [3, 9], "repeats": 3}


def attention_function(name: str):
    """The function a model calls for `name` (transformers' own for sdpa / eager, the registered one else)."""
    return {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}.get(
        name
    ) or ALL_ATTENTION_FUNCTIONS[name]


def model_mask(name: str, *, batch: int, q_length: int, kv_length: int, padding: int, dtype: torch.dtype):
    """The mask that `name`'s registered mask function builds for T new tokens against a cache of S."""
    padding_mask = None
    if padding:
        padding_mask = torch.ones(batch, kv_length, dtype=torch.bool)
        padding_mask[:, :padding] = False  # (B, S): left padding
    return ALL_MASK_ATTENTION_FUNCTIONS[name](
        batch_size=batch,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=kv_length - q_length,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=padding_mask,
        allow_is_causal_skip=True,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def sdpa_mode(mask, key, value, q_length: int, group_size: int) -> str:
    """How transformers' sdpa_attention_forward treats the groups for this call (its own decision rule)."""
    if group_size == 1 or use_gqa_in_sdpa(mask, key, value) or q_length == 1:
        return "native"
    return "view" if key.shape[1] == 1 else "repeat_kv"  # one KV head: repeat_kv is a stride-0 view


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the C++ profiler's start/stop lines (written straight to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_allocated_bytes(call) -> int:
    """Peak bytes that `call()` holds in torch's CPU allocator beyond what was allocated before it."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with _quiet_stderr():
            prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - before


def _describe(mask) -> str | None:
    return None if mask is None else f"{dtype_name(mask.dtype)} {tuple(mask.shape)}"


def bench_case(*, T, S, G, padded, kv_heads, head_dim, batch, dtype, repeats, warmup, seed=0) -> list[dict]:
    """Time and peak memory of every implementation for one (T, S, G, padding) case: one row each."""
    Hkv, heads = kv_heads, kv_heads * G
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, T, heads, head_dim, generator=gen, dtype=dtype)  # (B, T, Hq, D)
    query = query.transpose(1, 2)  # (B, Hq, T, D), the model's view
    key = torch.randn(batch, Hkv, S, head_dim, generator=gen, dtype=dtype)  # (B, Hkv, S, D)
    value = torch.randn(batch, Hkv, S, head_dim, generator=gen, dtype=dtype)  # (B, Hkv, S, D)
    module = SimpleNamespace(num_key_value_groups=G, is_causal=True, training=False, layer_idx=0)
    padding = S // 4 if padded else 0
    calls, masks = {}, {}
    for name in IMPLEMENTATIONS:
        fn = attention_function(name)
        masks[name] = model_mask(name, batch=batch, q_length=T, kv_length=S, padding=padding, dtype=dtype)
        calls[name] = lambda fn=fn, m=masks[name]: fn(module, query, key, value, m, scaling=head_dim**-0.5)

    outs, inner, sample_s = {}, {}, {}
    for name, call in calls.items():  # also the first warmup call
        start = time.perf_counter()
        outs[name] = call()[0].float()
        elapsed = max(time.perf_counter() - start, 1e-6)
        inner[name] = max(1, math.ceil(MIN_SAMPLE_S / elapsed))
        sample_s[name] = inner[name] * elapsed
    # Short calls get more samples (up to MAX_SAMPLES, >= MIN_TIME_S each): the fastest is then undisturbed.
    samples = max(repeats, min(MAX_SAMPLES, math.ceil(MIN_TIME_S / max(sample_s.values()))))
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for name in IMPLEMENTATIONS[1:]:  # a sanity check, not a test: every query row sees real keys here
        assert torch.allclose(outs[GROUPED], outs[name], atol=tol, rtol=tol), name
    del outs
    times = {name: [] for name in IMPLEMENTATIONS}
    for i in range(warmup - 1 + samples):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(inner[name]):
                call()
            if i >= warmup - 1:
                times[name].append((time.perf_counter() - start) / inner[name])
    mode = sdpa_mode(masks["sdpa"], key, value, T, G)
    return [
        {
            "implementation": name,
            "query_length": T,
            "kv_length": S,
            "group_size": G,
            "query_heads": heads,
            "kv_heads": Hkv,
            "padding": padding,
            "sdpa_mode": mode,
            "mask": _describe(masks[name]),
            "median_ms": 1e3 * statistics.median(times[name]),
            "min_ms": 1e3 * min(times[name]),
            "samples": samples,
            "calls_per_sample": inner[name],
            "peak_mib": peak_allocated_bytes(calls[name]) / 2**20,
        }
        for name in IMPLEMENTATIONS
    ]


def check_options(*, query_lengths, kv_lengths, group_sizes, kv_heads, head_dim, batch, repeats, warmup):
    """UserError naming the flag and the value for a length, count or size that is not a positive integer, or
    a query length longer than a KV length (the new tokens are part of the cache)."""
    for flag, values in (("--query-lengths", query_lengths), ("--kv-lengths", kv_lengths),
                         ("--group-sizes", group_sizes)):  # fmt: skip
        if not values:
            raise UserError(f"{flag} needs at least one value")
        for value in values:
            check_number(flag, value, minimum=1, inclusive=True, integer=True)
    for flag, value in (("--kv-heads", kv_heads), ("--head-dim", head_dim), ("--batch", batch),
                        ("--repeats", repeats), ("--warmup", warmup)):  # fmt: skip
        check_number(flag, value, minimum=1, inclusive=True, integer=True)
    if max(query_lengths) > min(kv_lengths):
        raise UserError(
            f"--query-lengths {max(query_lengths)} exceeds --kv-lengths {min(kv_lengths)}: every query "
            "length must be <= every KV length (the new tokens are part of the cache)"
        )


def run(
    *,
    query_lengths,
    kv_lengths,
    group_sizes,
    kv_heads=3,
    head_dim=64,
    batch=1,
    dtype="float32",
    repeats=5,
    warmup=1,
) -> dict:
    dtype = parse_dtype(dtype, "--dtype")
    sizes = dict(kv_heads=kv_heads, head_dim=head_dim, batch=batch, repeats=repeats, warmup=warmup)
    check_options(query_lengths=query_lengths, kv_lengths=kv_lengths, group_sizes=group_sizes, **sizes)
    cases = [
        (T, S, G, p) for S in kv_lengths for G in group_sizes for T in query_lengths for p in (False, True)
    ]
    load_before = os.getloadavg()
    rows = []
    for T, S, G, padded in tqdm(cases, desc="bench_attention", unit="case"):
        rows += bench_case(T=T, S=S, G=G, padded=padded, kv_heads=kv_heads, head_dim=head_dim, batch=batch,
                           dtype=dtype, repeats=repeats, warmup=warmup)  # fmt: skip
    return {
        "benchmark": "attention function time per call (min and median ms) and peak allocated memory (MiB)",
        "dtype": dtype_name(dtype),
        "batch": batch,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "repeats": repeats,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "versions": library_versions(),
        "rows": rows,
    }


def summarize(record: dict) -> list[dict]:
    """Per case: the three implementations side by side, ratios to sdpa, whether the goal is met."""
    by = {}
    for r in record["rows"]:
        key = (r["query_length"], r["kv_length"], r["group_size"], r["padding"])
        by.setdefault(key, {})[r["implementation"]] = r
    out = []
    for (T, S, G, padding), rs in by.items():
        ours, sdpa, eager = rs[GROUPED], rs["sdpa"], rs["eager"]
        speed = sdpa["min_ms"] / ours["min_ms"]
        memory = sdpa["peak_mib"] / max(ours["peak_mib"], 1e-9)
        if sdpa["sdpa_mode"] != "repeat_kv":
            met = ours["min_ms"] <= 1.10 * sdpa["min_ms"]
        else:
            met = speed >= 2.0 and memory >= 2.0
        out.append(
            dict(
                T=T,
                S=S,
                G=G,
                padding=padding,
                mode=sdpa["sdpa_mode"],
                ours=ours,
                sdpa=sdpa,
                eager=eager,
                speed_vs_sdpa=speed,
                memory_vs_sdpa=memory,
                speed_vs_eager=eager["min_ms"] / ours["min_ms"],
                target_met=met,
            )  # fmt: skip
        )
    return out


def format_table(record: dict) -> str:
    header = (
        "T | S | G | padding | sdpa mode | grouped ms | sdpa ms | eager ms | grouped MiB | sdpa MiB "
        "| eager MiB | speed vs sdpa | memory vs sdpa | speed vs eager | goal"
    )
    rows = []
    for c in summarize(record):
        o, s, e = c["ours"], c["sdpa"], c["eager"]
        goal = "within 10%" if c["mode"] != "repeat_kv" else ">= 2x, >= 2x"
        rows.append(
            [c["T"], c["S"], c["G"], "left " + str(c["padding"]) if c["padding"] else "none", c["mode"]]
            + [f"{r[key]:.2f}" for key in ("min_ms", "peak_mib") for r in (o, s, e)]
            + [f"{c[key]:.2f}x" for key in ("speed_vs_sdpa", "memory_vs_sdpa", "speed_vs_eager")]
            + [f"{goal}: {'met' if c['target_met'] else 'not met'}"]
        )
    return markdown_table(header.split(" | "), rows, align="rrrll" + "r" * 9 + "l")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a small grid for a smoke run (explicit options still win): {QUICK}",
    )
    p.add_argument("--query-lengths", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--kv-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--group-sizes", type=int, nargs="+", default=[3, 9])
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (default 3, SmolLM2's); Hq = G * this")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--repeats", type=int, default=5, help="minimum timed samples per implementation and case")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared box)"
    )
    p.add_argument("--output", help="write the record (every row, versions, load average) as JSON here")
    return p


def bench(args: argparse.Namespace) -> None:
    """The command's work: every option checked first (nothing measured or written for a bad one), then
    the grid, the table, and the JSON record where `--output` asks."""
    check_number("--threads", args.threads, minimum=1, inclusive=True, integer=True)
    if args.output:
        check_output(None, args.output, overwrite=True, kind="json")
    torch.set_num_threads(args.threads)
    record = run(
        query_lengths=args.query_lengths,
        kv_lengths=args.kv_lengths,
        group_sizes=args.group_sizes,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        batch=args.batch,
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    print(format_table(record))
    print(
        f"\n{record['dtype']}, batch {record['batch']}, {record['kv_heads']} KV heads, head dim "
        f"{record['head_dim']}, {record['threads']} threads, fastest of >= {record['repeats']} samples; "
        f"load average before/after: {record['load_average']['before']} / {record['load_average']['after']}"
    )
    if args.output:
        write_json(args.output, record, prog=WRITER)


def main(argv: list[str] | None = None) -> int:
    args = parse_with_quick(build_parser(), argv, QUICK)  # --quick: the small grid
    return run_command(PROG, lambda: bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
