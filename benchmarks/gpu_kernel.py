"""`python -m benchmarks.gpu` part mla-kernel: the Triton MLA decode kernel, tuned, against the GPU's copy
bandwidth, `llama_mla`'s PyTorch absorbed and expanded paths, and the source model's GQA decode attention.

Reuses `benchmarks/mla_kernel.py` (timing with CUDA events and an L2 flush, the copy bandwidth, the layer and
GQA measurements of one case) and adds per case (shape, dtype, batch B, context S; T = 1):
- tuning: every (block_n, num_warps, num_splits) of the settings timed on the kernel alone (`tune_repeats`
  calls each), the fastest re-timed (`repeats` calls); the chosen values go into the row and into the part's
  meta (`best_launch`, per case);
- with `expanded` (default off): `LlamaMLAAttention.expanded_attention` (per-head K/V from the latent).
Shapes: SmolLM2's MLA ranks at 50% and 25% of its cache (d_c 120, r 12 and d_c 48, r 8, per-head RoPE keys;
README's curve) with SmolLM2's GQA as the source, and 512 + 64 (one shared 64-wide RoPE key, FlashMLA's
layout) on Llama-3-8B's heads with Llama-3-8B's GQA as the source.
Goals: the tuned kernel at >= 70% of the copy bandwidth from 8k context; the layer through the kernel >= 2x
faster than through the PyTorch absorbed path; from 4k context faster than the source's GQA decode attention
(the faster of sdpa and hf_attn_grouped).
"""

from __future__ import annotations

import inspect

import torch

from benchmarks import mla_kernel as mk
from benchmarks.gpu_parts import Adapter

# name -> (shape, RoPE pairs, RoPE layout); the GQA source has the shape's heads, KV heads and head dim
SHAPES = {  # most wanted first: a part cut short by its time limit keeps these rows
    "llama3-8b-512+64": (mk.Shape(heads=32, kv_heads=8, head_dim=128, kv_lora_rank=512), 32, "shared"),
    "smollm2-mla50": (mk.Shape(heads=9, kv_heads=3, head_dim=64, kv_lora_rank=120), 12, "per-head"),
    "smollm2-mla25": (mk.Shape(heads=9, kv_heads=3, head_dim=64, kv_lora_rank=48), 8, "per-head"),
}
DEFAULTS = dict(  # sized for the loan profile: 8 cases, 12 tuning launches each, the expanded path left out
    shapes=["llama3-8b-512+64", "smollm2-mla50"], contexts=[8192, 32768], batch=[1, 32], dtypes=["bfloat16"],
    block_n=[32, 64], num_warps=[4, 8], splits=[8, 32, 128], tune_repeats=5, repeats=20, warmup=3,
    expanded=False,
)  # fmt: skip
TARGET_VS_GQA_FROM = 4096
OOM = (torch.OutOfMemoryError,)


def plan(settings: dict) -> list[str]:
    """Check the settings and that each shape's layer and the kernel's tuning arguments exist (CPU)."""
    s = settings
    for key in ("shapes", "dtypes"):
        allowed = SHAPES if key == "shapes" else mk.DTYPES
        bad = [v for v in s[key] if v not in allowed]
        if bad:
            raise ValueError(f"mla-kernel.{key}: unknown {bad}; choose from {list(allowed)}")
    for key in ("contexts", "batch", "splits", "num_warps"):
        if not s[key] or any(not isinstance(v, int) or v < 1 for v in s[key]):
            raise ValueError(f"mla-kernel.{key} must be a list of positive integers, got {s[key]}")
    if any(b < 16 or b & (b - 1) for b in s["block_n"]):
        raise ValueError(f"mla-kernel.block_n must be powers of two >= 16, got {s['block_n']}")
    if not isinstance(s["expanded"], bool):
        raise ValueError(f"mla-kernel.expanded must be true or false, got {s['expanded']!r}")
    if s["tune_repeats"] < 1 or s["repeats"] < 1 or s["warmup"] < 0:
        raise ValueError("mla-kernel.tune_repeats and repeats must be >= 1, warmup >= 0")
    from hf_attn.kernels.mla_decode import mla_decode

    missing = {"num_splits", "block_n", "num_warps"} - set(inspect.signature(mla_decode).parameters)
    if missing:
        raise ValueError(f"mla_decode has no tuning arguments {sorted(missing)}")
    lines = []
    for name in s["shapes"]:
        shape, pairs, layout = SHAPES[name]
        if layout == "shared" and not mk.layer_has_shared_rope():
            raise ValueError(f"shape {name} needs llama_mla's shared RoPE layout, which this runtime lacks")
        mk.mla_layer(shape, pairs, torch.float32, "cpu", shared_rope=layout == "shared")  # the config builds
        width = shape.kv_lora_rank + (shape.kv_heads if layout == "per-head" else 1) * 2 * pairs
        top = max(s["batch"]) * max(s["contexts"]) * width * 2 / 2**20
        configs = len(s["block_n"]) * len(s["num_warps"]) * len(s["splits"])
        lines.append(
            f"{name}: Hq {shape.heads}, Hkv {shape.kv_heads}, d {shape.head_dim}, d_c {shape.kv_lora_rank}, "
            f"RoPE {layout} 2r={2 * pairs}; {len(s['dtypes']) * len(s['batch']) * len(s['contexts'])} cases, "
            f"<= {configs} tuning configs each; largest cache {top:.0f} MiB (16-bit)"
        )
    return lines


def _inputs(shape, pairs, layout, B, S, dtype, device):
    """Random decode inputs: q_rope (B,Hkv,G,1,2r), q_nope (B,Hkv,G,1,d-2r), q_latent (B,Hkv,G,1,d_c),
    latent (B,1,S,d_c), k_rope (B,1,S,Hr*2r)."""
    Hkv, d, dc, R = shape.kv_heads, shape.head_dim, shape.kv_lora_rank, 2 * pairs
    G, Hr = shape.heads // Hkv, Hkv if layout == "per-head" else 1
    rnd = mk._random(device, dtype)
    return dict(
        q_rope=rnd(B, Hkv, G, 1, R), q_nope=rnd(B, Hkv, G, 1, d - R), q_latent=rnd(B, Hkv, G, 1, dc),
        latent=rnd(B, 1, S, dc, scale=dc**-0.5), k_rope=rnd(B, 1, S, Hr * R),
    )  # fmt: skip


@torch.inference_mode()
def tune(shape, pairs, layout, B, S, dtype, settings, flush) -> dict:
    """The fastest (block_n, num_warps, num_splits) of the settings for the kernel alone, re-timed."""
    from hf_attn.kernels.mla_decode import mla_decode

    x = _inputs(shape, pairs, layout, B, S, dtype, flush.device)
    args = (x["q_rope"], x["q_latent"], x["latent"], x["k_rope"])
    best, failed = None, 0
    for block_n in settings["block_n"]:
        for warps in settings["num_warps"]:
            for splits in settings["splits"]:
                if splits > -(-S // block_n):
                    continue
                kw = dict(scaling=shape.head_dim**-0.5, block_n=block_n, num_warps=warps, num_splits=splits)
                try:
                    ms = mk.median_ms(lambda kw=kw: mla_decode(*args, **kw), warmup=1,
                                      repeats=settings["tune_repeats"], flush=flush)  # fmt: skip
                except OOM:
                    raise
                except Exception:  # noqa: BLE001 (a config that does not compile or launch: skipped, counted)
                    failed += 1
                    continue
                if best is None or ms < best[0]:
                    best = (ms, kw)
    if best is None:
        return {"tune_failed": failed}
    ms = mk.median_ms(lambda: mla_decode(*args, **best[1]), warmup=settings["warmup"],
                      repeats=settings["repeats"], flush=flush)  # fmt: skip
    kw = best[1]
    return dict(tuned_us=ms * 1e3, tuned_block_n=kw["block_n"], tuned_warps=kw["num_warps"],
                tuned_splits=kw["num_splits"], tune_failed=failed)  # fmt: skip


@torch.inference_mode()
def expanded_ms(shape, pairs, layout, B, S, dtype, settings, flush) -> float:
    """Time of `LlamaMLAAttention.expanded_attention` (per-head K/V from the latent, then sdpa)."""
    x = _inputs(shape, pairs, layout, B, S, dtype, flush.device)
    layer = mk.mla_layer(shape, pairs, dtype, flush.device, shared_rope=layout == "shared")
    layer.config._attn_implementation = "sdpa"
    args = (x["q_rope"], x["q_nope"], x["latent"], x["k_rope"], None)
    return mk.median_ms(lambda: layer.expanded_attention(*args), warmup=settings["warmup"],
                        repeats=settings["repeats"], flush=flush)  # fmt: skip


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def case_row(name, dtype_name, B, S, settings, flush, copy_gbps) -> dict:
    """One row: default and tuned kernel, layer through kernel / PyTorch / expanded, GQA sdpa / grouped."""
    shape, pairs, layout = SHAPES[name]
    dtype = mk.DTYPES[dtype_name]
    row = dict(shape=name, dtype=dtype_name, batch=B, context=S, d_c=shape.kv_lora_rank,
               rope=f"{shape.kv_heads if layout == 'per-head' else 1}x{2 * pairs}")  # fmt: skip
    errors = []
    steps = (
        ("base", lambda: mk.bench_case(name=name, shape=shape, rope_pairs=pairs, rope_layout=layout, batch=B,
                                       context=S, dtype=dtype, warmup=settings["warmup"],
                                       repeats=settings["repeats"], flush=flush)),
        ("tune", lambda: tune(shape, pairs, layout, B, S, dtype, settings, flush)),
        ("expanded", lambda: dict(expanded_ms=expanded_ms(shape, pairs, layout, B, S, dtype, settings,
                                                          flush)) if settings["expanded"] else {}),
    )  # fmt: skip
    got = {}
    for step, fn in steps:
        try:
            got.update(fn())
        except OOM as err:
            errors.append(f"{step}: out of memory ({str(err).splitlines()[0][:80]})")
        torch.cuda.empty_cache()
    us = {k: got[k] * 1e3 if got.get(k) is not None else None
          for k in ("kernel_ms", "layer_triton_ms", "layer_torch_ms", "expanded_ms", "sdpa_ms",
                    "hf_attn_grouped_ms")}  # fmt: skip
    nbytes = got.get("cache_bytes")
    tuned_us = got.get("tuned_us")
    tuned_gbps = nbytes / (tuned_us * 1e-6) / 1e9 if nbytes and tuned_us else None
    gqa = min((v for v in (us["sdpa_ms"], us["hf_attn_grouped_ms"]) if v is not None), default=None)
    row.update(
        cache_mib=nbytes / 2**20 if nbytes else None, kernel_us=us["kernel_ms"],
        kernel_gbps=got.get("kernel_gbps"),
        copy_pct=_ratio(100 * got["kernel_gbps"], copy_gbps) if got.get("kernel_gbps") else None,
        tuned=(f"{got['tuned_block_n']}/{got['tuned_warps']}/{got['tuned_splits']}" if tuned_us else None),
        tuned_us=tuned_us, tuned_gbps=tuned_gbps, tuned_copy_pct=_ratio(100 * tuned_gbps, copy_gbps)
        if tuned_gbps else None, triton_us=us["layer_triton_ms"], torch_us=us["layer_torch_ms"],
        vs_torch=_ratio(us["layer_torch_ms"], us["layer_triton_ms"]), expanded_us=us["expanded_ms"],
        vs_expanded=_ratio(us["expanded_ms"], us["layer_triton_ms"]), sdpa_us=us["sdpa_ms"],
        grouped_us=us["hf_attn_grouped_ms"], vs_gqa=_ratio(gqa, us["layer_triton_ms"]),
        layer_max_rel_diff=got.get("layer_max_rel_diff"), tuned_block_n=got.get("tuned_block_n"),
        tuned_warps=got.get("tuned_warps"), tuned_splits=got.get("tuned_splits"),
        tune_failed=got.get("tune_failed"), error="; ".join(errors) or None,
    )  # fmt: skip
    row["goals"] = goals(row)
    return row


def goals(row: dict) -> str:
    """'met', or the goals this row misses (bandwidth from 8k, 2x PyTorch, faster than GQA from 4k)."""
    missed = []
    if (
        row["context"] >= mk.TARGET_FROM_CONTEXT
        and (row["tuned_copy_pct"] or 0) < 100 * mk.TARGET_COPY_FRACTION
    ):
        missed.append("bandwidth")
    if (row["vs_torch"] or 0) < mk.TARGET_LAYER_SPEEDUP:
        missed.append("2x PyTorch")
    if row["context"] >= TARGET_VS_GQA_FROM and (row["vs_gqa"] or 0) <= 1:
        missed.append("vs GQA")
    return "met" if not missed else "not met: " + ", ".join(missed)


def run(settings: dict, emit) -> None:
    import hf_attn  # noqa: F401  (registers hf_attn_grouped)

    if not torch.cuda.is_available():
        raise RuntimeError("mla-kernel needs a CUDA GPU")
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    copy = mk.copy_bandwidth_gbps(device, warmup=settings["warmup"], repeats=settings["repeats"], flush=flush)
    emit(meta={"device": torch.cuda.get_device_name(device), "copy_gbps": copy, "versions": mk._versions()})
    best = {}  # "shape dtype B S" -> the tuned launch "block_n/num_warps/num_splits" (also in each row)
    for name in settings["shapes"]:
        for dtype_name in settings["dtypes"]:
            for B in settings["batch"]:
                for S in settings["contexts"]:
                    row = case_row(name, dtype_name, B, S, settings, flush, copy)
                    emit(row)
                    best[f"{name} {dtype_name} B={B} S={S}"] = row["tuned"]
                    emit(meta={"best_launch": best})


COLUMNS = (
    ("shape", "shape", ""), ("dtype", "dtype", ""), ("B", "batch", "d"), ("S", "context", "d"),
    ("cache MiB", "cache_mib", ".1f"), ("kernel us", "kernel_us", ".1f"), ("GB/s", "kernel_gbps", ".0f"),
    ("% copy", "copy_pct", ".0f"), ("tuned bn/warps/splits", "tuned", ""), ("tuned us", "tuned_us", ".1f"),
    ("tuned % copy", "tuned_copy_pct", ".0f"), ("layer Triton us", "triton_us", ".1f"),
    ("PyTorch absorbed us", "torch_us", ".1f"), ("x PyTorch", "vs_torch", ".2f"),
    ("expanded us", "expanded_us", ".1f"), ("x expanded", "vs_expanded", ".2f"),
    ("GQA sdpa us", "sdpa_us", ".1f"),
    ("GQA grouped us", "grouped_us", ".1f"), ("x GQA", "vs_gqa", ".2f"), ("goals", "goals", ""),
)  # fmt: skip
ADAPTERS = {
    "mla-kernel": Adapter(
        defaults=DEFAULTS,
        columns=COLUMNS,
        plan=plan,
        run=run,
        extra_keys=(
            "d_c",
            "rope",
            "tuned_gbps",
            "layer_max_rel_diff",
            "tuned_block_n",
            "tuned_warps",
            "tuned_splits",
            "tune_failed",
            "error",
        ),
    )  # fmt: skip
}
