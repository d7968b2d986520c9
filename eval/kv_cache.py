"""KV-cache accounting: bytes per token, from a config (`kv_bytes_per_token`) and measured from a real cache
after a forward pass (`measured_kv_bytes_per_token`); the two must agree.

Numbers cached per token and attention layer:
- MHA / GQA / MQA: keys and values of every KV head, `2 * Hkv * head_dim`;
- MLA (`model_type == "llama_mla"`, see the checkpoint layout notes): the latent plus the post-RoPE keys of
  the kept rotary pairs, `kv_lora_rank + Hkv * 2 * rope_pairs`.

Sliding-window (and chunked) attention layers are counted like full ones: bytes per token is the price of one
more cached token while the sequence still fits in the window, which is also what a cache measured at a short
length holds. Beyond the window such a layer stops growing; `kv_cache_bytes(config, seq_len)` gives the total
for a given length with that cap applied. Layers that keep no cache of their own (transformers' "dummy" layer
type: KV shared with another layer, MLP/MoE-only layers) count zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hf_attn.models.llama_mla.configuration_llama_mla import LlamaMLAConfig
from hf_attn.models.llama_mla.modeling_llama_mla import CACHE_FIELD  # transformers 5.23 or 5.24
from hf_attn.tooling.loading import dtype_name

_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class KVBytes:
    numbers_per_token_per_layer: float  # cached numbers per token in one attention layer
    per_layer: float  # bytes per token in one attention layer
    total: float  # bytes per token summed over all layers that cache
    layers: int  # layers that hold a cache
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def _layer_windows(config) -> list[int | None]:
    """Per decoder layer: None (full attention), an int (sliding/chunked window), 0 (no cache of its own)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    out = []
    for kind, kw in zip(types, kwargs):
        if kind == "dummy":
            out.append(0)
        elif kind == "full_attention":
            out.append(None)
        elif kind in _ATTENTION_LAYERS:
            out.append(int(kw["sliding_window"]))
        else:
            raise ValueError(
                f"KV accounting from the config supports {_ATTENTION_LAYERS} layers, not {kind!r} "
                f"(model type {config.model_type!r}); use measured_kv_bytes_per_token(model) instead"
            )
    return out


def numbers_per_token_per_layer(config) -> int:
    """Cached numbers per token in one attention layer (see the module docstring)."""
    config = config.get_text_config()
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    if config.model_type == "deepseek_v3":  # what an MLA engine caches (transformers caches expanded K/V)
        return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    if config.model_type == "llama_mla":
        per_layer = mla_numbers_per_layer(config)
        total = sum(per_layer)
        return total // len(per_layer) if total % len(per_layer) == 0 else total / len(per_layer)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    return 2 * hkv * head_dim


def mla_numbers_per_layer(config) -> list[int]:
    """llama_mla: numbers cached per token in each layer, d_c,i + Hr * 2 r_i (per-layer ranks when the
    config has `layer_kv_lora_ranks` / `layer_rope_pairs`, else the same in every layer)."""
    layers = config.num_hidden_layers
    hkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    rope_keys = 1 if getattr(config, "rope_layout", "per_head") == "shared" else hkv
    ranks = getattr(config, "layer_kv_lora_ranks", None) or [int(config.kv_lora_rank)] * layers
    pairs = getattr(config, "layer_rope_pairs", None) or [int(config.rope_pairs)] * layers
    return [LlamaMLAConfig.cache_numbers(int(c), rope_keys, int(r)) for c, r in zip(ranks, pairs)]


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> KVBytes:
    """KV-cache bytes per token from a config, for a cache stored in `dtype`."""
    text = config.get_text_config()
    numbers, size = numbers_per_token_per_layer(text), dtype.itemsize
    layers = sum(1 for w in _layer_windows(text) if w != 0)
    total = kv_cache_bytes(text, 1, dtype=dtype)  # one token: held once by every layer that caches
    return KVBytes(numbers, numbers * size, total, layers, dtype_name(dtype))


def kv_cache_bytes(config, seq_len: int, *, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the whole KV cache for `batch_size` sequences of `seq_len` tokens; sliding-window layers hold
    at most `window` tokens (transformers' dynamic cache keeps `window - 1` between steps)."""
    text = config.get_text_config()
    if text.model_type == "llama_mla":
        per_layer = mla_numbers_per_layer(text)
    else:
        per_layer = [numbers_per_token_per_layer(text)] * len(_layer_windows(text))
    numbers = sum(  # per layer: its numbers per token times the tokens it holds
        n * (0 if w == 0 else seq_len if w is None else min(seq_len, w))
        for n, w in zip(per_layer, _layer_windows(text))
    )
    return int(numbers * dtype.itemsize * batch_size)


def cache_tensor_bytes(cache) -> int:
    """Sum of the bytes of every distinct tensor reachable from a cache (lists, tuples, dicts, attributes)."""
    seen_objects, seen_tensors, total = set(), set(), 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.dtype)
            if key not in seen_tensors and obj.device.type != "meta":
                seen_tensors.add(key)
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            stack.extend(vars(obj).values())
    return total


def _cache_after_forward(model, seq_len: int):
    device = model.get_input_embeddings().weight.device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    return getattr(out, CACHE_FIELD)


def measured_kv_bytes_per_token(model, seq_len: int = 16) -> KVBytes:
    """Bytes per token of the cache a real forward pass leaves behind: the bytes of every tensor the cache
    holds after `2 * seq_len` tokens minus after `seq_len` tokens, divided by `seq_len` (the difference
    cancels fixed-size bookkeeping tensors, e.g. a sliding layer's window scalar). `seq_len` is lowered so
    that `2 * seq_len` stays below the config's sliding window. Works for any cache class (MLA's included)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    window = getattr(model.config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        seq_len = max(1, min(seq_len, (window - 1) // 2))  # a full sliding cache would not grow: no layers
    short = _cache_after_forward(model, seq_len)
    long = _cache_after_forward(model, 2 * seq_len)
    per_token = (cache_tensor_bytes(long) - cache_tensor_bytes(short)) / seq_len
    pairs = zip(getattr(short, "layers", short), getattr(long, "layers", long))
    layers = sum(cache_tensor_bytes(b) > cache_tensor_bytes(a) for a, b in pairs)  # layers whose cache grew
    dtype, per_layer = model.dtype, per_token / layers
    as_int = lambda x: int(x) if float(x).is_integer() else x  # noqa: E731
    numbers = as_int(per_layer / dtype.itemsize)
    return KVBytes(numbers, as_int(per_layer), as_int(per_token), layers, dtype_name(dtype))
