"""`llama_mla`: a Llama / Mistral / Qwen2 decoder with multi-head latent attention (MLA) on a latent KV cache.

Self-contained on purpose (imports torch, transformers and `.configuration_llama_mla` only): checkpoints carry
this file so that `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` works without hf_attn.

Everything except attention is transformers' Llama (RMSNorm, MLP, rotary embedding with the source's
`rope_parameters`, decoder layer, masks, generate). Attention of layer i, KV head g (= query head h // G),
RoPE key k(h) (= g for rope_layout "per_head", 0 for "shared": DeepSeek's one decoupled RoPE key per layer):

    q_h       = q_proj(x)_h                      (B, T, d)    rows [rope (2r) | nope (d - 2r)], RoPE on the 2r
    k_rope_j  = RoPE_{P_j}(k_rope_proj(x)_j)     (B, T, 2r)   cached, j < Hr (Hkv per head, 1 shared)
    c         = kv_down_proj(x)                  (B, T, d_c)  cached, shared by all heads
                (c = latent_norm(kv_down_proj(x)), an RMSNorm, when config.latent_norm)
    k_nope_g  = k_up_proj(c)_g                   (B, S, d - 2r)
    v_g       = v_up_proj(c)_g                   (B, S, d)
    score     = (q_rope_h . k_rope_k(h) + q_nope_h . k_nope_g) * d**-0.5   (q_rope_h rotated on P_k(h))

KV cache: a transformers `Cache` (DynamicCache by default; StaticCache and sliding-window layers work too)
whose per-layer "keys" hold c as (B, 1, S, d_c) and "values" hold k_rope as (B, 1, S, Hr * 2r) (head-major):
d_c + Hr * 2r numbers per token and layer, nothing else (one "head" in both, so static caches preallocate).
d_c and r may differ between layers (`config.layer_kv_lora_ranks`, `config.layer_rope_pairs`): every layer's
modules and cache entries have that layer's widths; nothing is shared across layers.

Two attention paths, equal up to rounding:
- expanded: rebuild k = [k_rope | k_nope] and v for all S tokens, then the configured attention function
  (`config._attn_implementation`: sdpa, eager, hf_attn_grouped, ...). Best for long prefills.
- absorbed: q~_h = W_uk,g^T q_nope,h (width d_c), score = (q_rope_h . k_rope_g + q~_h . c) * d**-0.5,
  o_h = W_uv,g (sum_s p_s c_s) + b_uv,g (sum_s p_s). W_uk and W_uv are applied per call, to the T new queries
  and to the attention-weighted latent: no per-head K/V is ever built for cached tokens, and nothing folded is
  cached, so training and in-place weight updates need no invalidation. (The k_up bias adds q_nope,h . b_uk,g
  to every score of a row: a constant that softmax removes, so the absorbed path drops it.)
Choice: `config.mla_attention_path` = "auto" (absorbed iff a cache is in use and T <=
`absorb_max_query_length`), "expanded" or "absorbed"; set it at load time
(`from_pretrained(..., mla_attention_path="expanded")`) or later (`model.config.mla_attention_path = ...`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_llama_mla import MLA_ATTENTION_PATHS, LlamaMLAConfig

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old argument
# stays an alias until 5.40); this file runs under both spellings
CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def rope_dim_indices(pairs: list[list[int]], head_dim: int) -> torch.Tensor:
    """Indices into the rotary embedding's last dim (d) for each RoPE key's kept pairs: (Hr, 2r),
    `[p_1..p_r, p_1 + d/2..p_r + d/2]` per head (rotate-half layout over 2r dims)."""
    half, r = head_dim // 2, len(pairs[0])
    rows = [list(p) + [i + half for i in p] for p in pairs]
    return torch.tensor(rows, dtype=torch.long).reshape(len(pairs), 2 * r)  # (Hr, 2r)


def select_rope(
    cos: torch.Tensor, sin: torch.Tensor, dims: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, T, d) of the source's rotary embedding -> per RoPE key (B, T, Hr, 2r) on the kept pairs."""
    return cos[..., dims], sin[..., dims]  # (B, T, Hr, 2r) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim of x with broadcastable cos/sin."""
    return x * cos + rotate_half(x) * sin


def attention_keep_mask(
    attention_mask: torch.Tensor | None, T: int, S: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Normalise a transformers attention mask for the absorbed path.

    Returns (bias, keep): `bias` is an additive float mask or None, `keep` a boolean (B|1, 1, T, S) mask of
    attendable keys or None (= all). None as input means causal when T > 1, aligned like torch SDPA's
    `is_causal` (top-left: transformers only skips the mask when S == T or a static cache fills from 0).
    """
    if attention_mask is None:
        if T == 1:
            return None, None
        keep = torch.ones(T, S, dtype=torch.bool, device=device).tril()  # (T, S)
        return None, keep[None, None]  # (1, 1, T, S)
    if attention_mask.dtype == torch.bool:
        return None, attention_mask  # (B, 1, T, S)
    return attention_mask, attention_mask > torch.finfo(attention_mask.dtype).min / 2  # (B, 1, T, S) each


def triton_mla_decode(latent: torch.Tensor) -> Callable | None:
    """hf_attn's Triton kernel for the absorbed decode (`hf_attn.kernels.mla_decode.mla_decode`) when the
    cache is on CUDA and triton is installed (`pip install hf-attn[kernels]`), else None: the PyTorch path."""
    return _load_triton_mla_decode() if latent.is_cuda else None


@functools.cache
def _load_triton_mla_decode() -> Callable | None:
    try:  # guarded: this file also runs via trust_remote_code without hf_attn (or triton) installed
        from hf_attn.kernels.mla_decode import mla_decode
    except ImportError:
        return None
    return mla_decode


class LlamaMLAAttention(nn.Module):
    """Multi-head latent attention, partial RoPE on per-KV-head or one shared RoPE key (module docstring)."""

    def __init__(self, config: LlamaMLAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = d = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.num_rope_keys = config.num_rope_keys  # Hr: Hkv (per_head) or 1 (shared)
        self.rope_dim = 2 * config.layer_rope_pairs_of(layer_idx)  # 2r (this layer's)
        self.nope_dim = d - self.rope_dim  # d - 2r
        self.kv_lora_rank = config.layer_kv_lora_rank_of(layer_idx)  # d_c (this layer's)
        self.scaling = d**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )

        E, Hq, Hkv, dc = config.hidden_size, self.num_heads, self.num_kv_heads, self.kv_lora_rank
        self.q_proj = nn.Linear(E, Hq * d, bias=config.qkv_bias)
        with warnings.catch_warnings():  # r = 0 / r = d/2 leave k_rope_proj / k_up_proj without rows: legal
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            self.k_rope_proj = nn.Linear(E, self.num_rope_keys * self.rope_dim, bias=config.qkv_bias)
            self.k_up_proj = nn.Linear(dc, Hkv * self.nope_dim, bias=config.qkv_bias)
        self.kv_down_proj = nn.Linear(E, dc, bias=False)
        self.latent_norm = LlamaRMSNorm(dc, eps=config.rms_norm_eps) if config.latent_norm else None
        self.v_up_proj = nn.Linear(dc, Hkv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(Hq * d, E, bias=config.o_bias)
        self.register_buffer("rope_dims", self.default_rope_dims(), persistent=False)  # (Hr, 2r)

    def default_rope_dims(self) -> torch.Tensor:
        return rope_dim_indices(self.config.pair_indices(self.layer_idx), self.head_dim)

    def use_absorbed(self, T: int, cache: Cache | None, attention_mask) -> bool:
        path = self.config.mla_attention_path
        if path not in MLA_ATTENTION_PATHS:
            raise ValueError(f"config.mla_attention_path must be one of {MLA_ATTENTION_PATHS}, got {path!r}.")
        mask_ok = attention_mask is None or (
            isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4
        )
        if path == "absorbed":
            if not mask_ok:
                raise ValueError(
                    f"The absorbed MLA path needs a 4D tensor mask (sdpa/eager style); attn_implementation "
                    f"{self.config._attn_implementation!r} gave {type(attention_mask).__name__}. Use "
                    "mla_attention_path='expanded' or 'auto' with this attention implementation."
                )
            return True
        if path == "expanded":
            return False
        return cache is not None and T <= self.config.absorb_max_query_length and mask_ok

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Shapes: B batch, T new tokens, S = cached + new tokens, E hidden, Hq / Hkv query / KV heads,
        G = Hq / Hkv, Hr RoPE keys (Hkv or 1), d head_dim, 2r RoPE dims, dn = d - 2r, d_c latent width.
            hidden_states (B, T, E) -> (B, T, E)
            cache keys: c (B, 1, S, d_c); cache values: k_rope (B, 1, S, Hr * 2r), head-major
        """
        B, T, _ = hidden_states.shape
        Hkv, G, d, rd = self.num_kv_heads, self.num_key_value_groups, self.head_dim, self.rope_dim
        Hr = self.num_rope_keys

        cos, sin = select_rope(*position_embeddings, self.rope_dims)  # (B, T, Hr, 2r) each
        q = self.q_proj(hidden_states).view(B, T, Hkv, G, d)  # (B, T, Hkv, G, d)
        q_rope = apply_rope(q[..., :rd], cos.unsqueeze(3), sin.unsqueeze(3))  # (B, T, Hkv, G, 2r), Hr -> Hkv
        q_rope = q_rope.permute(0, 2, 3, 1, 4)  # (B, Hkv, G, T, 2r)
        q_nope = q[..., rd:].permute(0, 2, 3, 1, 4)  # (B, Hkv, G, T, dn)
        k_rope = self.k_rope_proj(hidden_states).view(B, T, Hr, rd)  # (B, T, Hr, 2r)
        k_rope = apply_rope(k_rope, cos, sin).view(B, 1, T, Hr * rd)  # (B, 1, T, Hr*2r)
        latent = self.kv_down_proj(hidden_states)  # (B, T, d_c)
        if self.latent_norm is not None:
            latent = self.latent_norm(latent)  # (B, T, d_c), normalised before caching
        latent = latent.unsqueeze(1)  # (B, 1, T, d_c)

        cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # transformers < 5.24
        if cache is not None:  # -> (B, 1, S, d_c), (B, 1, S, Hr*2r)
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)

        if self.use_absorbed(T, cache, attention_mask):
            want = bool(kwargs.get("output_attentions"))  # weights wanted: the Triton kernel gives none
            out, weights = self.absorbed_attention(q_rope, q_nope, latent, k_rope, attention_mask, want)
        else:
            out, weights = self.expanded_attention(q_rope, q_nope, latent, k_rope, attention_mask, **kwargs)
        out = out.reshape(B, T, self.num_heads * d)  # (B, T, Hq * d)
        return self.o_proj(out), weights

    def expanded_attention(self, q_rope, q_nope, latent, k_rope, attention_mask, **kwargs):
        """Rebuild per-head K/V from the latent, then the configured attention function.

        q_rope (B, Hkv, G, T, 2r), q_nope (B, Hkv, G, T, dn), latent (B, 1, S, d_c), k_rope (B, 1, S, Hr*2r)
        -> out (B, T, Hq, d), weights or None
        """
        B, Hkv, G, T, rd = q_rope.shape
        S, d = latent.shape[2], self.head_dim
        c = latent.squeeze(1)  # (B, S, d_c)
        k_rope = k_rope.view(B, S, self.num_rope_keys, rd).transpose(1, 2)  # (B, Hr, S, 2r)
        k_rope = k_rope.expand(B, Hkv, S, rd)  # (B, Hkv, S, 2r); a shared key is read by every KV group
        k_nope = self.k_up_proj(c).view(B, S, Hkv, self.nope_dim).transpose(1, 2)  # (B, Hkv, S, dn)
        value = self.v_up_proj(c).view(B, S, Hkv, d).transpose(1, 2)  # (B, Hkv, S, d)
        key = torch.cat([k_rope, k_nope], dim=-1)  # (B, Hkv, S, d)
        query = torch.cat([q_rope, q_nope], dim=-1).view(B, Hkv * G, T, d)  # (B, Hq, T, d)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        return attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

    def absorbed_attention(self, q_rope, q_nope, latent, k_rope, attention_mask, need_weights=True):
        """Attend over the cached latent and RoPE keys directly; W_uk goes into the query, W_uv after the
        attention-weighted latent sum. Fully masked rows give zeros. Without need_weights, dropout or
        autograd, CUDA tensors use hf_attn's Triton kernel when installed (`absorbed_attention_triton`).

        q_rope (B, Hkv, G, T, 2r), q_nope (B, Hkv, G, T, dn), latent (B, 1, S, d_c), k_rope (B, 1, S, Hr*2r)
        -> out (B, T, Hq, d), probs (B, Hq, T, S)
        """
        dropout = self.training and self.attention_dropout > 0
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_rope, q_nope, latent, k_rope))
        kernel = None if need_weights or dropout or grad else triton_mla_decode(latent)  # it has no backward
        if kernel is not None:
            out = self.absorbed_attention_triton(kernel, q_rope, q_nope, latent, k_rope, attention_mask)
            return out, None  # (B, T, Hq, d), no weights
        B, Hkv, G, T, rd = q_rope.shape
        S, dc, dn = latent.shape[2], self.kv_lora_rank, self.nope_dim
        Hr = self.num_rope_keys
        c = latent.squeeze(1)  # (B, S, d_c)

        k_rope = k_rope.view(B, S, Hr, rd).permute(0, 2, 3, 1)  # (B, Hr, 2r, S), a view of the cache
        q_rope = q_rope.reshape(B, Hr, Hkv // Hr * G * T, rd)  # (B, Hr, Hkv/Hr*G*T, 2r): shared = 1 head
        scores = torch.matmul(q_rope, k_rope).view(B, Hkv, G * T, S)  # (B, Hkv, G*T, S)
        if dn > 0:
            w_uk = self.k_up_proj.weight.view(Hkv, dn, dc)  # (Hkv, dn, d_c)
            q_latent = torch.matmul(q_nope.reshape(B, Hkv, G * T, dn), w_uk)  # (B, Hkv, G*T, d_c)
            scores_latent = torch.matmul(q_latent.view(B, Hkv * G * T, dc), c.transpose(1, 2))  # (B, Hq*T, S)
            scores = scores + scores_latent.view(B, Hkv, G * T, S)  # (B, Hkv, G*T, S)
        scores = scores.float().view(B, Hkv, G, T, S) * self.scaling  # (B, Hkv, G, T, S)

        bias, keep = attention_keep_mask(attention_mask, T, S, scores.device)
        if bias is not None:
            scores = scores + bias.float().unsqueeze(2)  # (B, Hkv, G, T, S)
        if keep is not None:
            keep = keep.unsqueeze(2)  # (B|1, 1, 1, T, S)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)  # fully masked rows -> zeros
        if dropout:
            probs = nn.functional.dropout(probs, p=self.attention_dropout)
        probs = probs.to(c.dtype)

        context = torch.matmul(probs.view(B, Hkv * G * T, S), c)  # (B, Hq*T, d_c)
        mass = None if self.v_up_proj.bias is None else probs.sum(dim=-1)  # (B, Hkv, G, T): 1, or 0 if masked
        out = self._value_output(context, mass, B, Hkv, G, T)  # (B, T, Hq, d)
        return out, probs.view(B, Hkv * G, T, S)  # (B, T, Hq, d), (B, Hq, T, S)

    def absorbed_attention_triton(self, kernel, q_rope, q_nope, latent, k_rope, attention_mask):
        """`absorbed_attention` with `kernel` (`mla_decode`) attending over the cache; W_uk, W_uv applied here

        q_rope (B, Hkv, G, T, 2r), q_nope (B, Hkv, G, T, dn), latent (B, 1, S, d_c), k_rope (B, 1, S, Hr*2r)
        -> out (B, T, Hq, d)
        """
        B, Hkv, G, T, rd = q_rope.shape
        S, dc, dn = latent.shape[2], self.kv_lora_rank, self.nope_dim
        w_uk = self.k_up_proj.weight.view(Hkv, dn, dc)  # (Hkv, dn, d_c)
        q_latent = torch.matmul(q_nope.reshape(B, Hkv, G * T, dn), w_uk)  # (B, Hkv, G*T, d_c); 0 if dn = 0
        bias, keep = attention_keep_mask(attention_mask, T, S, latent.device)
        context, lse = kernel(  # (B, Hkv, G, T, d_c), (B, Hkv, G, T); RoPE-key heads Hr read off k_rope
            q_rope, q_latent.view(B, Hkv, G, T, dc), latent, k_rope, keep if bias is None else bias,
            scaling=self.scaling, return_lse=True,
        )  # fmt: skip
        mass = None
        if self.v_up_proj.bias is not None:  # (B, Hkv, G, T): 0 on fully masked rows
            mass = torch.isfinite(lse).to(self.v_up_proj.weight.dtype)  # the dtype of W_uv's product
        return self._value_output(context, mass, B, Hkv, G, T)  # (B, T, Hq, d)

    def _value_output(self, context, mass, B: int, Hkv: int, G: int, T: int) -> torch.Tensor:
        """W_uv on the attention-weighted latent, plus b_uv times each row's attention mass.

        context (B, Hkv, G, T, d_c) or a view of that size, mass (B, Hkv, G, T) or None without b_uv
        -> out (B, T, Hq, d)
        """
        d, dc = self.head_dim, self.kv_lora_rank
        w_uv = self.v_up_proj.weight.view(Hkv, d, dc)  # (Hkv, d, d_c)
        out = torch.matmul(context.view(B, Hkv, G * T, dc), w_uv.transpose(1, 2))  # (B, Hkv, G*T, d)
        if mass is not None:
            mass = mass.view(B, Hkv, G * T, 1)  # (B, Hkv, G*T, 1)
            out = out + mass * self.v_up_proj.bias.view(1, Hkv, 1, d)  # (B, Hkv, G*T, d)
        out = out.view(B, Hkv, G, T, d).permute(0, 3, 1, 2, 4)  # (B, T, Hkv, G, d)
        return out.reshape(B, T, Hkv * G, d)  # (B, T, Hq, d)


class LlamaMLADecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer of the source architecture with MLA self-attention."""

    def __init__(self, config: LlamaMLAConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaMLAAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, T, E) -> (B, T, E)"""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class LlamaMLAPreTrainedModel(PreTrainedModel):
    config_class = LlamaMLAConfig
    config: LlamaMLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMLADecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = False  # the absorbed path reads 4D (sdpa / eager style) masks
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": LlamaMLADecoderLayer,
        "attentions": LlamaMLAAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LlamaMLAAttention):  # non-persistent buffer: rebuilt, never loaded
            init.copy_(module.rope_dims, module.default_rope_dims())


class LlamaMLAModel(LlamaMLAPreTrainedModel):
    def __init__(self, config: LlamaMLAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LlamaMLADecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids (B, T) or inputs_embeds (B, T, E) -> last_hidden_state (B, T, E)"""
        cache = cache if cache is not None else past_key_values  # the name of transformers < 5.24
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, E)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (
                torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            )
            position_ids = position_ids.unsqueeze(0)  # (1, T)

        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                CACHE_ARG: cache,
                "position_ids": position_ids,
            }
            mask_mapping = {}
            if "full_attention" in self.config.layer_types:
                mask_mapping["full_attention"] = create_causal_mask(**mask_kwargs)
            if "sliding_attention" in self.config.layer_types:
                mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)  # cos, sin (B, T, d)
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[self.config.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache})


class LlamaMLAForCausalLM(LlamaMLAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LlamaMLAConfig):
        super().__init__(config)
        self.model = LlamaMLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T or logits_to_keep, vocab)"""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


LlamaMLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["LlamaMLAAttention", "LlamaMLAForCausalLM", "LlamaMLAModel", "LlamaMLAPreTrainedModel"]
