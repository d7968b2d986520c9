"""The plan of the llama_mla -> deepseek_v3 export (conversion/export/deepseek.py has the mapping and its
notation): what DeepSeek-V3 can represent exactly, the RoPE slots and latent padding, and the exported
config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_attn.conversion.checkpoint.io import dtype_name
from hf_attn.conversion.export.engine_dims import target_dims
from hf_attn.models.llama_mla import LlamaMLAConfig
from hf_attn.tooling.errors import UserError

TRANSFORMERS_KV_NORM_EPS = 1e-6  # DeepseekV3Attention builds kv_a_layernorm with the RMSNorm default eps
LATENT_NORM_EPS_TARGETS = ("transformers", "engines")


@dataclass(frozen=True)
class ExportPlan:
    """Everything the tensor mapping needs; built (and every refusal raised) by `plan_export`."""

    num_layers: int
    hidden_size: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    rope_pairs: int  # r
    latent_dim: int  # d_c
    kv_lora_rank: int  # D >= d_c
    rope_slots: int  # W (qk_rope_head_dim = 2W)
    rope_stride: int  # s: every kept source pair is a multiple of s
    # m: source pair p goes to slot (p / s) m, i.e. slot k has frequency theta_(k s / m)
    slots_per_stride: int
    rope_theta: float  # theta' = theta ** (2 s W / (m d))
    pairs: tuple[tuple[int, ...], ...]  # [layer][r] kept source pairs
    eps_source: float
    eps_target: float
    max_position_embeddings: int

    @property
    def nope_dim(self) -> int:
        return self.head_dim - 2 * self.rope_pairs

    @property
    def qk_rope_head_dim(self) -> int:
        return 2 * self.rope_slots

    @property
    def query_scale(self) -> float:
        """sqrt((dn + R) / d): folds DeepSeek's softmax scale (dn + R) ** -0.5 into llama_mla's d ** -0.5."""
        return math.sqrt((self.nope_dim + self.qk_rope_head_dim) / self.head_dim)

    @property
    def latent_scale(self) -> float:
        """alpha: RMSNorm_eps_target(alpha [c; 0_(D - d_c)]) * gain' == RMSNorm_eps_source(c) * gain."""
        return math.sqrt(self.eps_target * self.kv_lora_rank / (self.eps_source * self.latent_dim))

    @property
    def gain_scale(self) -> float:
        return math.sqrt(self.latent_dim / self.kv_lora_rank)


def refuse(reason: str, fix: str) -> ValueError:
    return UserError(f"cannot export exactly to deepseek_v3: {reason}; {fix}")


def _check_representable(config: LlamaMLAConfig, max_pos: int) -> None:
    """UserError naming the reason and the option that avoids it for what a dense DeepSeek-V3 cannot
    represent exactly (up to `max_pos` positions)."""
    convert = "convert with `hf-attn convert mla --layout deepseek`"
    Hkv = config.num_key_value_heads
    if config.num_rope_keys != 1:
        raise refuse(
            f"rope_layout={config.rope_layout!r} with num_key_value_heads={Hkv} caches {Hkv} RoPE keys per "
            "token, DeepSeek-V3 one shared key",
            f"{convert} (per_head with num_key_value_heads 1 is the same model and exports as is)",
        )
    if getattr(config, "is_ragged", False):
        raise refuse(
            f"per-layer ranks (layer_kv_lora_ranks={config.layer_kv_lora_ranks}, layer_rope_pairs="
            f"{config.layer_rope_pairs}), but a deepseek_v3 config has one kv_lora_rank and one "
            "qk_rope_head_dim for every layer",
            "convert with `hf-attn convert mla --layout deepseek --allocation uniform`",
        )
    if not config.latent_norm:
        raise refuse(
            "latent_norm=False, but DeepSeek-V3 always RMS-normalises the cached latent (kv_a_layernorm), "
            "which no weight change can undo",
            f"{convert} (it adds and fits the latent norm)",
        )
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise refuse(
            f"rope_type={rope_type!r}: DeepSeek's frequencies are theta^(-2k/R), which {rope_type} scaling "
            "changes in a way one rope_theta cannot reproduce",
            "export a checkpoint converted from a source with default RoPE",
        )
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}", "use a source with full RoPE")
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    if sliding and config.sliding_window < max_pos:
        raise refuse(
            f"layers {sliding} use sliding_window={config.sliding_window} < max_position_embeddings="
            f"{max_pos} and DeepSeek-V3 has no sliding-window attention",
            f"pass --max-position-embeddings {config.sliding_window} (exact up to that length)",
        )
    if config.hidden_act != "silu":
        raise refuse(
            f"hidden_act={config.hidden_act!r}: vLLM's and SGLang's DeepseekV2MLP accept only 'silu'",
            "export a silu model",
        )
    eps_source = float(config.rms_norm_eps)
    if eps_source <= 0:
        raise refuse(f"rms_norm_eps={eps_source}", "export a checkpoint with rms_norm_eps > 0")


def plan_export(
    *,
    config: LlamaMLAConfig,
    engine_dims: str = "native",
    latent_norm_eps_for: str = "transformers",
    max_position_embeddings: int | None = None,
) -> ExportPlan:
    """Check that `config` is exactly representable as a dense DeepSeek-V3 and derive the mapping.

    `engine_dims`: "native" (the conversion's own kv_lora_rank and RoPE slots) or a size a vLLM MLA backend
    accepts ("576", "512", "320": kv_lora_rank = size - 64, qk_rope_head_dim = 64, zero-padded exactly).
    ValueError (naming the value, the reason and the option that avoids it) for everything DeepSeek cannot
    represent exactly.
    """
    target = target_dims(engine_dims)
    if latent_norm_eps_for not in LATENT_NORM_EPS_TARGETS:
        raise UserError(
            f"--latent-norm-eps-for must be one of {LATENT_NORM_EPS_TARGETS}, got {latent_norm_eps_for!r}."
        )
    L, Hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    max_pos = config.max_position_embeddings if max_position_embeddings is None else max_position_embeddings
    if not isinstance(max_pos, int) or max_pos < 1:
        raise UserError(f"--max-position-embeddings must be a positive integer, got {max_pos!r}.")
    _check_representable(config, max_pos)
    eps_source = float(config.rms_norm_eps)
    eps_target = TRANSFORMERS_KV_NORM_EPS if latent_norm_eps_for == "transformers" else eps_source

    pairs = tuple(tuple(config.pair_indices(i)[0]) for i in range(L))
    kept = sorted({p for layer in pairs for p in layer})
    stride = math.gcd(*kept) if any(kept) else 1  # every kept pair is a multiple of s
    slots = (kept[-1] // stride + 1) if kept else 1  # r = 0: one zero slot (DeepSeek needs a RoPE dim)
    rank = d_c = config.kv_lora_rank
    if target is not None:
        (rank_t, rope_t), size = target, sum(target)
        if d_c > rank_t or 2 * slots > rope_t:
            raise refuse(
                f"--engine-dims {size} needs kv_lora_rank <= {rank_t} and qk_rope_head_dim <= {rope_t}, but "
                f"this checkpoint needs kv_lora_rank {d_c} and {2 * slots} RoPE dims (pairs {kept})",
                f"convert with --kv-lora-rank <= {rank_t} and at most {rope_t // 2} RoPE pairs (or "
                f"`hf-attn convert mla --layout deepseek --engine-dims {size}`), or export to a larger size",
            )
        rank, slots = rank_t, rope_t // 2
    # m slots per stride: the kept pairs spread over the slots, so the step theta'^(-2/R) between slots stays
    # a fraction of the source's and theta' ** (k / W) stays inside float32 (with m = 1, 32 slots of stride
    # s could need theta ** 16 or more); the slots in between carry zeros.
    top = kept[-1] // stride if kept and kept[-1] else 0
    per_stride = (slots - 1) // top if top else slots  # only pair 0 (frequency 1 in every base)
    theta = float(dict(config.rope_parameters or {})["rope_theta"])
    return ExportPlan(
        num_layers=L,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=Hkv,
        head_dim=d,
        rope_pairs=config.rope_pairs,
        latent_dim=d_c,
        kv_lora_rank=rank,
        rope_slots=slots,
        rope_stride=stride,
        slots_per_stride=per_stride,
        rope_theta=theta ** (2 * stride * slots / (per_stride * d)),
        pairs=pairs,
        eps_source=eps_source,
        eps_target=eps_target,
        max_position_embeddings=max_pos,
    )


def deepseek_config(*, config: LlamaMLAConfig, plan: ExportPlan) -> dict:
    """The deepseek_v3 config.json (a plain dict) of the exported checkpoint."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    L = plan.num_layers
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size")},
        "num_hidden_layers": L,
        "num_attention_heads": plan.num_heads,
        # kv_b_proj already yields Hq key/value heads: transformers' repeat_kv must not repeat them again
        "num_key_value_heads": plan.num_heads,
        "q_lora_rank": None,
        "kv_lora_rank": plan.kv_lora_rank,
        "qk_nope_head_dim": plan.nope_dim,
        "qk_rope_head_dim": plan.qk_rope_head_dim,
        "v_head_dim": plan.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": plan.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        **{k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "use_cache": True,
        # RoPE: both spellings, for transformers >= 5 (rope_parameters) and loaders on older transformers
        "rope_theta": plan.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": plan.rope_theta},
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": float(config.attention_dropout),
        # dense MLP on every layer; MoE fields valid but unused
        "first_k_dense_replace": L,
        **dict.fromkeys(("moe_layer_freq", "n_routed_experts", "n_shared_experts", "num_experts_per_tok"), 1),
        "moe_intermediate_size": config.intermediate_size,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
    }
    if dtype is not None:  # both spellings: transformers >= 5 reads dtype, loaders on 4.x torch_dtype
        out["dtype"] = out["torch_dtype"] = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return out
