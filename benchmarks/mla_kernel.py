"""GPU benchmark of the Triton MLA decode kernel (`hf_attn.kernels.mla_decode`) against the GPU's copy
bandwidth, `llama_mla`'s PyTorch absorbed path and the source model's GQA decode attention.

Per case (shape, batch B, context S; one new token per sequence, T = 1; random data in `--dtype`):
- kernel: `mla_decode` alone. Achieved bandwidth = bytes of the cache it reads, B * S * (d_c + Hr * 2r) *
  itemsize, over its time; compared with the GPU's copy bandwidth, measured here as (read + write bytes) /
  time of `dst.copy_(src)` on a 1 GiB tensor.
- layer: `LlamaMLAAttention.absorbed_attention` (W_uk and W_uv products included) through the kernel and
  through today's PyTorch path (`need_weights=True` forces it); the shared RoPE layout only where the runtime
  has it.
- GQA: the source model's decode attention as a layer calls it, `ALL_ATTENTION_FUNCTIONS[name](module, q,
  k, v, None, scaling=d**-0.5, dropout=0.0)` with q (B, Hq, 1, d), k / v (B, Hkv, S, d), for `sdpa` and
  `hf_attn_grouped`; bytes read 2 * B * Hkv * S * d * itemsize.
Timing: CUDA events around each call, the L2 cache flushed (a 256 MiB write) before each, `--warmup` untimed
calls, then the median of `--repeats`. Goals: the kernel at >= 70% of the copy bandwidth from 8k
context on, and the layer through the kernel >= 2x faster than through the PyTorch path.

    python -m benchmarks.mla_kernel [--quick] [--shapes smollm2 llama3-8b] [--batch 1 8 32]
        [--context 1024 2048 4096 8192 16384 32768] [--dtype bfloat16] [--rope-layout per-head shared]
        [--rope-pairs R] [--repeats 20] [--warmup 5] [--output DIR [--overwrite]]

Needs a CUDA GPU and triton (`pip install hf-attn[kernels]`); refuses (exit 2, one line) otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.tooling.cli import ArgumentParser, parse_with_quick, run_command
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, check_replaceable, json_record
from hf_attn.tooling.tables import markdown_table

PROG = "python -m benchmarks.mla_kernel"
WRITER = "hf-attn benchmarks.mla_kernel"  # its JSON's written_by: an hf-attn output (the output guard)
OUTPUT_FILES = ("results.json", "table.md")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ROPE_LAYOUTS = ("per-head", "shared")
GQA_IMPLEMENTATIONS = ("sdpa", "hf_attn_grouped")
TARGET_COPY_FRACTION, TARGET_FROM_CONTEXT, TARGET_LAYER_SPEEDUP = 0.70, 8192, 2.0
QUICK = dict(batch=[1, 8], context=[1024, 8192], repeats=5, warmup=2)


@dataclass(frozen=True)
class Shape:
    """Attention shape of a source model and the latent rank of its MLA conversion."""

    heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int

    def default_rope_pairs(self) -> int:
        """The conversion's cap on kept RoPE pairs: 3/8 of d/2."""
        return (3 * self.head_dim // 2) // 8


SHAPES = {
    "smollm2": Shape(heads=9, kv_heads=3, head_dim=64, kv_lora_rank=256),  # SmolLM2-135M
    "llama3-8b": Shape(heads=32, kv_heads=8, head_dim=128, kv_lora_rank=512),  # Llama-3-8B
}


def median_ms(fn, *, warmup: int, repeats: int, flush: torch.Tensor) -> float:
    """Median over `repeats` CUDA-event timings of fn(), the L2 cache flushed before each call."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_gbps(device, *, warmup: int, repeats: int, flush: torch.Tensor) -> float:
    """(read + write bytes) / time of a 1 GiB device-to-device tensor copy, in GB/s (1e9 bytes)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, flush=flush)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


class _Layer(torch.nn.Module):
    """What an attention function reads off the layer that calls it."""

    def __init__(self, groups: int):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def mla_layer(shape: Shape, rope_pairs: int, dtype: torch.dtype, device, *, shared_rope: bool = False):
    """A `LlamaMLAAttention` with the given shape and random weights (one shared RoPE key if asked)."""
    from hf_attn.models.llama_mla import LlamaMLAConfig
    from hf_attn.models.llama_mla.modeling_llama_mla import LlamaMLAAttention

    cfg = LlamaMLAConfig(
        vocab_size=128, hidden_size=shape.heads * shape.head_dim, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        kv_lora_rank=shape.kv_lora_rank, rope_pairs=rope_pairs,
        **({"rope_layout": "shared"} if shared_rope else {}),
    )  # fmt: skip
    layer = LlamaMLAAttention(cfg, layer_idx=0).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return layer


@torch.inference_mode()
def bench_case(*, name, shape, rope_pairs, rope_layout, batch, context, dtype, warmup, repeats, flush):
    """One row: kernel, layer (Triton / PyTorch) and GQA timings for one shape, batch and context."""
    row = dict(
        shape=name, kv_lora_rank=shape.kv_lora_rank, rope_width=2 * rope_pairs,
        rope_heads=shape.kv_heads if rope_layout == "per-head" else 1, heads=shape.heads,
        kv_heads=shape.kv_heads, head_dim=shape.head_dim, batch=batch, context=context,
    )  # fmt: skip
    time = dict(warmup=warmup, repeats=repeats, flush=flush)
    row.update(_bench_mla(shape, rope_pairs, rope_layout, batch, context, dtype, time))
    torch.cuda.empty_cache()
    row.update(_bench_gqa(shape, batch, context, dtype, time))
    torch.cuda.empty_cache()
    return row


def layer_has_shared_rope() -> bool:
    """Whether this runtime's llama_mla has the shared RoPE-key layout (config.rope_layout = "shared")."""
    from hf_attn.models.llama_mla import LlamaMLAConfig

    return hasattr(LlamaMLAConfig, "num_rope_keys")


def _random(device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    return lambda *size, scale=1.0: torch.randn(*size, generator=gen, device=device, dtype=dtype) * scale


def _bench_mla(shape, rope_pairs, rope_layout, B, S, dtype, time) -> dict:
    """The kernel alone, then the layer's absorbed attention through the kernel and through PyTorch."""
    from hf_attn.kernels.mla_decode import mla_decode

    Hkv, d, dc = shape.kv_heads, shape.head_dim, shape.kv_lora_rank
    G, R, Hr = shape.heads // Hkv, 2 * rope_pairs, Hkv if rope_layout == "per-head" else 1
    rnd = _random(time["flush"].device, dtype)
    latent, k_rope = rnd(B, 1, S, dc, scale=dc**-0.5), rnd(B, 1, S, Hr * R)  # (B,1,S,d_c), (B,1,S,Hr*2r)
    q_rope, q_latent = rnd(B, Hkv, G, 1, R), rnd(B, Hkv, G, 1, dc)  # (B,Hkv,G,1,2r), (B,Hkv,G,1,d_c)
    ms = median_ms(lambda: mla_decode(q_rope, q_latent, latent, k_rope, scaling=d**-0.5), **time)
    cache_bytes = B * S * (dc + Hr * R) * torch.empty((), dtype=dtype).element_size()
    out = dict(kernel_ms=ms, kernel_gbps=cache_bytes / (ms * 1e-3) / 1e9, cache_bytes=cache_bytes)
    out.update(layer_triton_ms=None, layer_torch_ms=None, layer_max_rel_diff=None)
    if rope_layout == "shared" and not layer_has_shared_rope():
        return out
    layer = mla_layer(shape, rope_pairs, dtype, latent.device, shared_rope=rope_layout == "shared")
    args = (q_rope, rnd(B, Hkv, G, 1, d - R), latent, k_rope, None)  # q_nope (B, Hkv, G, 1, d - 2r)
    fast = layer.absorbed_attention(*args, need_weights=False)[0].float()
    slow = layer.absorbed_attention(*args, need_weights=True)[0].float()
    out["layer_max_rel_diff"] = ((fast - slow).abs().max() / slow.abs().max()).item()
    out["layer_triton_ms"] = median_ms(lambda: layer.absorbed_attention(*args, need_weights=False), **time)
    out["layer_torch_ms"] = median_ms(lambda: layer.absorbed_attention(*args, need_weights=True), **time)
    return out


def _bench_gqa(shape, B, S, dtype, time) -> dict:
    """The source model's decode attention under each GQA implementation, called as a layer calls it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    Hq, Hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    rnd = _random(time["flush"].device, dtype)
    query, key, value = rnd(B, Hq, 1, d), rnd(B, Hkv, S, d), rnd(B, Hkv, S, d)
    module = _Layer(Hq // Hkv).eval()
    nbytes = 2 * B * Hkv * S * d * torch.empty((), dtype=dtype).element_size()
    out = {"gqa_cache_bytes": nbytes}
    for impl in GQA_IMPLEMENTATIONS:
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        ms = median_ms(
            lambda fn=fn: fn(module, query, key, value, None, scaling=d**-0.5, dropout=0.0), **time
        )
        out[f"{impl}_ms"], out[f"{impl}_gbps"] = ms, nbytes / (ms * 1e-3) / 1e9
    return out


def summarize(record: dict) -> list[dict]:
    """Per row: derived ratios and whether the goals are met."""
    out = []
    for r in record["rows"]:
        frac = r["kernel_gbps"] / record["copy_gbps"]
        speedup = r["layer_torch_ms"] / r["layer_triton_ms"] if r["layer_triton_ms"] else None
        bw_ok = frac >= TARGET_COPY_FRACTION or r["context"] < TARGET_FROM_CONTEXT
        out.append(
            {
                **r,
                "copy_fraction": frac,
                "layer_speedup": speedup,
                "grouped_vs_sdpa": r["sdpa_ms"] / r["hf_attn_grouped_ms"],
                "mla_layer_vs_sdpa": r["sdpa_ms"] / r["layer_triton_ms"] if r["layer_triton_ms"] else None,
                "targets_met": bw_ok and (speedup is None or speedup >= TARGET_LAYER_SPEEDUP),
            }
        )
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_table(record: dict) -> str:
    """Markdown table of `summarize(record)`; times in microseconds."""
    header = (
        "shape | d_c | RoPE Hr x 2r | B | S | kernel us | kernel GB/s | % of copy | layer Triton us "
        "| layer PyTorch us | layer speedup | GQA sdpa us | GQA grouped us | grouped vs sdpa "
        "| MLA layer vs GQA sdpa | goals"
    )
    rows = []
    for c in summarize(record):
        triton_ms, torch_ms = c["layer_triton_ms"], c["layer_torch_ms"]
        rows.append([
            c["shape"], c["kv_lora_rank"], f"{c['rope_heads']} x {c['rope_width']}", c["batch"], c["context"],
            f"{c['kernel_ms'] * 1e3:.1f}", f"{c['kernel_gbps']:.0f}", f"{c['copy_fraction'] * 100:.0f}%",
            _fmt(triton_ms and triton_ms * 1e3, ".1f"), _fmt(torch_ms and torch_ms * 1e3, ".1f"),
            _fmt(c["layer_speedup"], ".2f", "x"), f"{c['sdpa_ms'] * 1e3:.1f}",
            f"{c['hf_attn_grouped_ms'] * 1e3:.1f}", f"{c['grouped_vs_sdpa']:.2f}x",
            _fmt(c["mla_layer_vs_sdpa"], ".2f", "x"), "met" if c["targets_met"] else "not met",
        ])  # fmt: skip
    return markdown_table(header.split(" | "), rows, align="l" + "r" * 14 + "l")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a small grid (explicit options still win): {QUICK}")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--rope-layout", nargs="+", default=["per-head"], choices=ROPE_LAYOUTS)
    p.add_argument("--rope-pairs", type=int, help="RoPE pairs kept per head (default: 3/8 of d/2)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--output", help="write results.json and table.md into this new directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output directory")
    return p


def check_args(args: argparse.Namespace) -> None:
    """UserError (one line naming the flag, the value and the fix) for a bad value or `--output`."""
    for name in ("batch", "context"):
        for value in getattr(args, name):
            check_number(f"--{name}", value, minimum=1, inclusive=True, integer=True)
    check_number("--repeats", args.repeats, minimum=1, inclusive=True, integer=True)
    check_number("--warmup", args.warmup, minimum=0, inclusive=True, integer=True)
    for name in args.shapes:
        half = SHAPES[name].head_dim // 2
        if args.rope_pairs is not None and not 0 <= args.rope_pairs <= half:
            raise UserError(f"--rope-pairs must be in [0, {half}] for shape {name}, got {args.rope_pairs}")
    if args.output:
        check_output_dir(args.output, overwrite=args.overwrite)


def check_output_dir(output: str, *, overwrite: bool) -> Path:
    """`output` as an absolute path if this command may write it: new, empty, or (with `overwrite`) a
    directory holding only what this command wrote; else UserError / FileExistsError naming it."""
    out = check_output(None, output, overwrite=overwrite, kind=None)
    check_output(None, out, overwrite=True, kind="directory")  # not a file; writable
    if out.is_dir() and any(out.iterdir()):
        others = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_FILES)
        if others:
            raise UserError(
                f"--output {out} holds files this command did not write ({', '.join(others[:3])}); "
                "choose a new directory"
            )
        if (out / "results.json").exists():
            check_replaceable(out / "results.json", "json")
    return out


def run(args: argparse.Namespace) -> dict:
    import hf_attn  # noqa: F401  (registers hf_attn_grouped)

    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    time = dict(warmup=args.warmup, repeats=args.repeats, flush=flush)
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "versions": _versions(),
        "copy_gbps": copy_bandwidth_gbps(device, **time),
        "rows": [],
    }
    for name in args.shapes:
        shape = SHAPES[name]
        pairs = shape.default_rope_pairs() if args.rope_pairs is None else args.rope_pairs
        for layout in args.rope_layout:
            for batch in args.batch:
                for context in args.context:
                    row = bench_case(
                        name=name, shape=shape, rope_pairs=pairs, rope_layout=layout, batch=batch,
                        context=context, dtype=DTYPES[args.dtype], **time,
                    )  # fmt: skip
                    record["rows"].append(row)
                    print(format_table({**record, "rows": [row]}).splitlines()[-1], flush=True)
    return record


def _versions() -> dict:
    import importlib.metadata

    out = {"python": sys.version.split()[0], "cuda": torch.version.cuda}
    for name in ("torch", "triton", "transformers", "hf-attn"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def write_outputs(record: dict, directory: str, *, overwrite: bool) -> None:
    """results.json + table.md into a new directory, atomically."""
    from hf_attn.tooling.files import atomic_directory

    with atomic_directory(directory, overwrite=overwrite) as tmp:
        (tmp / "results.json").write_text(json_record(record, WRITER))
        (tmp / "table.md").write_text(format_table(record) + "\n")


def bench(args: argparse.Namespace) -> None:
    """The command's work: options, `--output` and the GPU checked first, then the grid and the outputs."""
    check_args(args)
    if not torch.cuda.is_available():
        raise UserError("needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine")
    if importlib.util.find_spec("triton") is None:
        raise UserError("needs triton; install it with `pip install hf-attn[kernels]`")
    record = run(args)
    print(format_table(record))
    copy = f"copy bandwidth {record['copy_gbps']:.0f} GB/s (read + write)"
    print(f"\n{record['device']}, {record['dtype']}, {copy}, median of {record['repeats']} calls")
    if args.output:
        write_outputs(record, args.output, overwrite=args.overwrite)


def main(argv: list[str] | None = None) -> int:
    args = parse_with_quick(build_parser(), argv, QUICK)  # --quick: the small grid
    return run_command(PROG, lambda: bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
