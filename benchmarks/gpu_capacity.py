"""`python -m benchmarks.gpu` part capacity: what MLA's smaller KV cache buys in decode throughput on one GPU.

The source: the Llama-2-7B shape (MHA, 32 query and 32 KV heads of 128) with `layers` decoder layers and
random bf16 weights (decode speed depends on shapes only), under sdpa. Its MLA conversion's shape: 512 latent
numbers plus one shared 64-wide RoPE key per token and layer (`kv_lora_rank` 512, `rope_pairs` 32, the
DeepSeek layout), random MLA attention weights, decoding on the absorbed path (the Triton kernel on CUDA).

One KV-cache budget, `kv_gib_per_layer` at `context` cached tokens (default 2 GiB per layer at 8k: 64 GiB for
the full 32 layers, what an 80 GB GPU holds beside the 7B model's 13.5 GB of bf16 weights), fixes each model's
batch: the largest B with B x context x (cached bytes per token and layer) within it. Each model then decodes
greedily from a cache of `context` random entries per row (a DynamicCache, as `generate` uses: both models
append alike), `warmup` untimed and `new_tokens` timed steps (the protocol of eval/bench/decoding.py; tokens/s
= B / median step time). A third row runs the MLA model at the source's batch: the step time at equal batch.
Goal: at equal KV memory, MLA tokens/s >= 5x the source's.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_parts import Adapter

DEFAULTS = dict(shape="llama-2-7b", layers=2, context=8192, kv_gib_per_layer=2.0, kv_lora_rank=512,
                rope_pairs=32, new_tokens=16, warmup=2, dtype="bfloat16")  # fmt: skip
TARGET_RATIO = 5.0
_DROP = ("model_type", "architectures", "transformers_version", "auto_map", "dtype", "torch_dtype", "hf_attn")


def configs(settings: dict):
    """(source LlamaConfig, LlamaMLAConfig of its 512 + 64 shape) for the settings, checked."""
    from transformers import LlamaConfig

    from benchmarks import synthetic
    from hf_attn.models.llama_mla import LlamaMLAConfig

    s = settings
    if s["shape"] not in synthetic.SHAPES:
        raise ValueError(f"capacity.shape: unknown {s['shape']!r}; choose from {sorted(synthetic.SHAPES)}")
    for key in ("layers", "context", "kv_lora_rank", "new_tokens"):
        if not isinstance(s[key], int) or s[key] < 1:
            raise ValueError(f"capacity.{key} must be a positive integer, got {s[key]!r}")
    if not isinstance(s["warmup"], int) or s["warmup"] < 0 or not s["kv_gib_per_layer"] > 0:
        raise ValueError("capacity.warmup must be an integer >= 0 and kv_gib_per_layer > 0")
    if s["dtype"] not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"capacity.dtype must be bfloat16, float16 or float32, got {s['dtype']!r}")
    source = LlamaConfig.from_dict(synthetic.llama_config({**synthetic.SHAPES[s["shape"]],
                                                           "num_hidden_layers": s["layers"]}))  # fmt: skip
    fields = {k: v for k, v in source.to_dict().items() if k not in _DROP}
    mla = LlamaMLAConfig(**fields, kv_lora_rank=s["kv_lora_rank"], rope_pairs=s["rope_pairs"],
                         rope_layout="shared", source_model_type="llama")  # fmt: skip
    return source, mla


def batch_for(config, settings: dict) -> tuple[int, int]:
    """(cached numbers per token and layer, the largest batch whose cache fits the budget at `context`)."""
    from hf_attn.eval.kv_cache import numbers_per_token_per_layer

    numbers = int(numbers_per_token_per_layer(config))
    per_row = settings["context"] * numbers * getattr(torch, settings["dtype"]).itemsize
    return numbers, int(settings["kv_gib_per_layer"] * 2**30 // per_row)


def plan(settings: dict) -> list[str]:
    lines = []
    for name, config in zip(("source (MHA, sdpa)", "MLA (absorbed)"), configs(settings)):
        numbers, batch = batch_for(config, settings)
        if batch < 1:
            raise ValueError(f"capacity: {settings['kv_gib_per_layer']} GiB per layer holds no {name} row of "
                             f"{settings['context']} tokens; raise kv_gib_per_layer")  # fmt: skip
        lines.append(
            f"{name}: {numbers} numbers per token and layer -> batch {batch} at {settings['context']}"
        )
    return lines


@torch.inference_mode()
def random_cache(model, batch: int, context: int, device):
    """A DynamicCache of `context` random entries per row in every layer, shaped as the model caches (one
    probe step finds the shapes: (B, heads, 1, width) per layer for keys and values)."""
    from transformers import DynamicCache

    from hf_attn.models.llama_mla.modeling_llama_mla import CACHE_FIELD

    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1)
    probe = getattr(model(input_ids=ids, use_cache=True, logits_to_keep=1), CACHE_FIELD)
    shapes = [(layer.keys.shape, layer.values.shape, layer.keys.dtype) for layer in probe.layers]
    del probe
    cache, gen = DynamicCache(config=model.config), torch.Generator(device=device).manual_seed(0)
    for i, (k, v, dtype) in enumerate(shapes):
        keys, values = ((*s[:2], context, s[-1]) for s in (k, v))  # (B, heads, S, width)
        cache.update(torch.randn(keys, generator=gen, device=device, dtype=dtype),
                     torch.randn(values, generator=gen, device=device, dtype=dtype), i)  # fmt: skip
    return cache


def decode_row(name: str, model, config, batch: int, settings: dict, device) -> dict:
    """One row: greedy decode tokens/s of `model` at `batch` rows of `context` cached tokens."""
    from hf_attn.eval.bench import decoding

    numbers, _ = batch_for(config, settings)
    itemsize = getattr(torch, settings["dtype"]).itemsize
    kv_bytes = batch * settings["context"] * numbers * itemsize * config.num_hidden_layers
    row = dict(model=name, numbers=numbers, batch=batch, context=settings["context"], kv_gib=kv_bytes / 2**30)
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        cache = random_cache(model, batch, settings["context"], device)
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1)
        timing = decoding.time_decode(
            model, cache, token, steps=settings["new_tokens"], warmup=settings["warmup"]
        )
        del cache
        row.update(step_ms=1e3 * timing.median_step_seconds, tokens_per_s=timing.tokens_per_second)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0][:120]}"
    return row


def build(config, settings: dict, device):
    """The model of `config` with random weights in the settings' dtype on `device`, for decoding."""
    from transformers import AutoModelForCausalLM

    from hf_attn.models.llama_mla import LlamaMLAForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, settings["dtype"])
    with torch.device(device):
        if config.model_type == "llama_mla":
            model = LlamaMLAForCausalLM(config).to(dtype)
            model.set_attn_implementation("sdpa")
            model.config.mla_attention_path = "absorbed"  # never falls back: a mask it cannot take fails
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def measure(settings: dict, emit, device) -> None:
    """The three rows (source at its batch, MLA at its batch, MLA at the source's batch), each emitted."""
    source_config, mla_config = configs(settings)
    _, source_batch = batch_for(source_config, settings)
    _, mla_batch = batch_for(mla_config, settings)
    model = build(source_config, settings, device)
    source = decode_row("source MHA (sdpa)", model, source_config, source_batch, settings, device)
    emit(source)
    del model
    model = build(mla_config, settings, device)
    mla = f"MLA {settings['kv_lora_rank']}+{2 * settings['rope_pairs']}"
    for name, batch in ((f"{mla} (absorbed)", mla_batch), (f"{mla}, the source's batch", source_batch)):
        row = decode_row(name, model, mla_config, batch, settings, device)
        if row.get("tokens_per_s") and source.get("tokens_per_s"):
            row["vs_source"] = row["tokens_per_s"] / source["tokens_per_s"]
        if batch == mla_batch:
            met = row.get("vs_source", 0) >= TARGET_RATIO
            row["goal"] = "met" if met else f"not met (< {TARGET_RATIO:g}x)"
        emit(row)


def run(settings: dict, emit) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("capacity needs a CUDA GPU")
    import hf_attn  # noqa: F401  (registers llama_mla)
    from hf_attn.models.llama_mla.modeling_llama_mla import triton_mla_decode

    device = torch.device("cuda")
    kernel = triton_mla_decode(torch.empty(1, device=device)) is not None
    emit(meta={"device": torch.cuda.get_device_name(), "triton_kernel": kernel, "settings": settings})
    measure(settings, emit, device)


ADAPTERS = {
    "capacity": Adapter(
        defaults=DEFAULTS,
        columns=(
            ("model", "model", ""),
            ("numbers / token / layer", "numbers", "d"),
            ("batch", "batch", "d"),
            ("context", "context", "d"),
            ("KV GiB", "kv_gib", ".2f"),
            ("step ms", "step_ms", ".2f"),
            ("tokens/s", "tokens_per_s", ".0f"),
            ("x source", "vs_source", ".2f"),
            ("peak GiB", "peak_gib", ".1f"),
            ("goal (>= 5x)", "goal", ""),
            ("error", "error", ""),
        ),  # fmt: skip
        plan=plan,
        run=run,
    )
}
