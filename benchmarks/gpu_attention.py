"""`python -m benchmarks.gpu` part attention: `hf_attn_grouped` vs `sdpa` vs `flash_attention_2` (where
installed) on the GPU, prefill and decode, GQA and MQA.

The protocol of `benchmarks/attention.py` moved to CUDA: each implementation is called as the Llama layer
calls
it, `fn(module, query, key, value, mask, scaling=d**-0.5, dropout=0.0)`, with the mask its registered mask
function builds for T new tokens against S cached ones (no padding), query (B, Hq, T, d) as the model's
transposed view, key / value (B, Hkv, S, d) contiguous. Time: CUDA events, the L2 flushed before each call,
median of `repeats` (`benchmarks/mla_kernel.median_ms`). Peak memory: `torch.cuda.max_memory_allocated` during
one call minus what was allocated before it (inputs and mask excluded). Each output is checked against sdpa's
(a sanity check, not a test). Decode: T = 1; prefill: T = S (no cache, causal).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.gpu_parts import Adapter

SHAPES = {"gqa": dict(kv_heads=8, groups=4, head_dim=128), "mqa": dict(kv_heads=1, groups=32, head_dim=128)}
IMPLEMENTATIONS = ("hf_attn_grouped", "sdpa", "flash_attention_2")
DEFAULTS = dict(  # 10 cases: what time remains in the loan profile
    shapes=list(SHAPES), decode_contexts=[8192, 32768], decode_batch=[1, 32], prefill_lengths=[4096],
    prefill_batch=[1], dtype="bfloat16", repeats=20, warmup=3,
)  # fmt: skip


def cases(settings: dict) -> list[dict]:
    """(kind, shape, B, T, S) of every measurement, checked."""
    s = settings
    bad = [x for x in s["shapes"] if x not in SHAPES]
    if bad:
        raise ValueError(f"attention.shapes: unknown {bad}; choose from {list(SHAPES)}")
    for key in ("decode_contexts", "decode_batch", "prefill_lengths", "prefill_batch"):
        if any(not isinstance(v, int) or v < 1 for v in s[key]):
            raise ValueError(f"attention.{key} must be positive integers, got {s[key]}")
    if s["dtype"] not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"attention.dtype must be float16, bfloat16 or float32, got {s['dtype']!r}")
    out = []
    for shape in s["shapes"]:
        out += [
            dict(kind="decode", shape=shape, B=B, T=1, S=S)
            for B in s["decode_batch"]
            for S in s["decode_contexts"]
        ]
        out += [
            dict(kind="prefill", shape=shape, B=B, T=L, S=L)
            for B in s["prefill_batch"]
            for L in s["prefill_lengths"]
        ]
    return out


def available() -> dict[str, str | None]:
    """Implementation -> None where usable, else why not (flash_attention_2 needs the flash-attn package)."""
    from transformers.utils import is_flash_attn_2_available

    return {name: None for name in IMPLEMENTATIONS[:2]} | {
        "flash_attention_2": None if is_flash_attn_2_available() else "flash-attn is not installed"
    }


def plan(settings: dict) -> list[str]:
    import hf_attn  # noqa: F401  (registers hf_attn_grouped)
    from benchmarks.attention import attention_function, model_mask

    todo = cases(settings)
    for name, why in available().items():
        if why is None:
            attention_function(name)  # registered under this name
            model_mask(name, batch=1, q_length=1, kv_length=4, padding=0, dtype=torch.float32)
    missing = [f"{k}: {v}" for k, v in available().items() if v]
    return [f"{len(todo)} cases ({sum(c['kind'] == 'decode' for c in todo)} decode)"] + missing


@torch.inference_mode()
def measure(case: dict, settings: dict, flush: torch.Tensor, usable: list[str]) -> dict:
    """Time, peak memory and agreement with sdpa of every usable implementation for one case."""
    from benchmarks.attention import attention_function, model_mask, sdpa_mode
    from benchmarks.mla_kernel import median_ms

    dims, B, T, S = SHAPES[case["shape"]], case["B"], case["T"], case["S"]
    Hkv, G, d = dims["kv_heads"], dims["groups"], dims["head_dim"]
    dtype, device = getattr(torch, settings["dtype"]), flush.device
    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(B, T, Hkv * G, d, generator=gen, device=device, dtype=dtype).transpose(1, 2)
    key = torch.randn(B, Hkv, S, d, generator=gen, device=device, dtype=dtype)  # (B, Hkv, S, d)
    value = torch.randn(B, Hkv, S, d, generator=gen, device=device, dtype=dtype)  # (B, Hkv, S, d)
    module = SimpleNamespace(num_key_value_groups=G, is_causal=True, training=False, layer_idx=0)
    row = dict(kind=case["kind"], shape=case["shape"], heads=f"{Hkv * G}/{Hkv}", batch=B, query=T, context=S)
    reference = None
    for name in sorted(usable, key=lambda n: n != "sdpa"):  # sdpa first: the reference output
        mask = model_mask(name, batch=B, q_length=T, kv_length=S, padding=0, dtype=dtype)
        mask = mask.to(device) if isinstance(mask, torch.Tensor) else mask
        fn = attention_function(name)
        call = lambda fn=fn, mask=mask: fn(module, query, key, value, mask, scaling=d**-0.5, dropout=0.0)  # noqa: E731
        short = {"hf_attn_grouped": "grouped", "sdpa": "sdpa", "flash_attention_2": "flash"}[name]
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = call()[0]
            torch.cuda.synchronize()
            row[f"{short}_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
            if reference is None:
                reference = out.float()
            else:
                row[f"{short}_max_diff"] = (out.float() - reference).abs().max().item()
            del out
            row[f"{short}_us"] = 1e3 * median_ms(call, warmup=settings["warmup"], repeats=settings["repeats"],
                                                 flush=flush)  # fmt: skip
        except torch.OutOfMemoryError:
            row[f"{short}_note"] = "out of memory"
        torch.cuda.empty_cache()
        if name == "sdpa":
            row["sdpa_mode"] = sdpa_mode(mask, key, value, T, G)
    for other in ("sdpa", "flash"):
        if row.get("grouped_us") and row.get(f"{other}_us"):
            row[f"grouped_vs_{other}"] = row[f"{other}_us"] / row["grouped_us"]
    return row


def run(settings: dict, emit) -> None:
    import hf_attn  # noqa: F401

    if not torch.cuda.is_available():
        raise RuntimeError("attention needs a CUDA GPU")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    status = available()
    emit(
        meta={"device": torch.cuda.get_device_name(), "not_available": {k: v for k, v in status.items() if v}}
    )
    usable = [name for name, why in status.items() if why is None]
    for case in cases(settings):
        emit(measure(case, settings, flush, usable))


COLUMNS = (
    ("kind", "kind", ""), ("shape", "shape", ""), ("Hq/Hkv", "heads", ""), ("B", "batch", "d"),
    ("T", "query", "d"),
    ("S", "context", "d"), ("sdpa mode", "sdpa_mode", ""), ("grouped us", "grouped_us", ".1f"),
    ("sdpa us", "sdpa_us", ".1f"), ("flash us", "flash_us", ".1f"), ("grouped MiB", "grouped_mib", ".1f"),
    ("sdpa MiB", "sdpa_mib", ".1f"), ("flash MiB", "flash_mib", ".1f"), ("x sdpa", "grouped_vs_sdpa", ".2f"),
    ("x flash", "grouped_vs_flash", ".2f"),
)  # fmt: skip
ADAPTERS = {
    "attention": Adapter(
        defaults=DEFAULTS,
        columns=COLUMNS,
        plan=plan,
        run=run,
        extra_keys=(
            "grouped_max_diff",
            "flash_max_diff",
            "grouped_note",
            "sdpa_note",
            "flash_note",
            "sdpa_max_diff",
        ),
    )  # fmt: skip
}
