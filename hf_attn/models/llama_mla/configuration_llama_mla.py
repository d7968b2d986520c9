"""Configuration of `llama_mla`: a Llama / Mistral / Qwen2 decoder with multi-head latent attention (MLA).

Self-contained on purpose (imports transformers only): checkpoints carry this file so that
`AutoConfig.from_pretrained(path, trust_remote_code=True)` works where hf_attn is not installed.

Notation: E hidden size, Hq query heads, Hkv KV heads, d head_dim, G = Hq / Hkv, r RoPE pairs kept per RoPE
key, d_c = kv_lora_rank (width of the cached latent), Hr RoPE keys per layer (Hkv for rope_layout "per_head",
1 for "shared").
"""

from __future__ import annotations

from transformers.models.llama.configuration_llama import LlamaConfig

MLA_ATTENTION_PATHS = ("auto", "expanded", "absorbed")
ROPE_LAYOUTS = ("per_head", "shared")
# The model types a llama_mla checkpoint can come from; also the converters' supported sources (one home).
SOURCE_MODEL_TYPES = ("llama", "mistral", "qwen2")


class LlamaMLAConfig(LlamaConfig):
    r"""The source's config (rope_parameters, head_dim, sliding_window, ...) plus the MLA fields:

    kv_lora_rank (`int`, *optional*): d_c, width of the shared latent `c = W_down x`. Default: full rank,
        `Hkv * (d - 2r) + Hkv * d` (the converter's exact construction).
    rope_pairs (`int`, *optional*): r, RoPE frequency pairs kept per KV head, `0 <= r <= d / 2`.
        Default: d / 2.
    rope_pair_indices (`list[list[list[int]]]`, *optional*): `[num_layers][Hr][r_i]` kept pair indices in
        `[0, d / 2)`, each list strictly ascending (Hr = Hkv for "per_head", 1 for "shared"; r_i the layer's
        RoPE pairs). None: `list(range(r_i))` everywhere (highest frequencies).
    layer_kv_lora_ranks (`list[int]`, *optional*): per-layer d_c (ragged latent widths, e.g. from the
        converter's `--allocation greedy`). None (default): every layer has `kv_lora_rank`. When given,
        `kv_lora_rank` is their maximum.
    layer_rope_pairs (`list[int]`, *optional*): per-layer r. None (default): every layer has `rope_pairs`.
        When given, `rope_pairs` is their maximum.
    rope_layout (`str`): "per_head" (default): one RoPE key per KV head, `k_rope_proj` is Linear(E, Hkv * 2r)
        and query head h rotates on the pairs of its KV head h // G. "shared": DeepSeek's decoupled RoPE, ONE
        RoPE key per layer read by every query head, `k_rope_proj` is Linear(E, 2r) and every query head
        rotates its first 2r dims on that key's pairs. (per_head with Hkv == 1 is the same model as shared.)
    latent_norm (`bool`): False (default): the cached latent is `c = kv_down_proj(x)`. True: an RMSNorm over
        the d_c latent dims (weight `self_attn.latent_norm.weight`, eps = rms_norm_eps; DeepSeek's
        `kv_a_layernorm`) is applied before caching, `c = latent_norm(kv_down_proj(x))`, and k_up_proj /
        v_up_proj read that normalised latent.
    qkv_bias (`bool`, *optional*): bias on q_proj, k_rope_proj, k_up_proj, v_up_proj.
        Default: `attention_bias`.
    o_bias (`bool`, *optional*): bias on o_proj. Default: `attention_bias`.
    source_model_type (`str`): "llama" | "mistral" | "qwen2", the architecture the checkpoint came from.
    mla_attention_path (`str`): "auto" | "expanded" | "absorbed". "auto" runs the absorbed path when a KV
        cache is in use and the query length is at most `absorb_max_query_length`, else the expanded path.
    absorb_max_query_length (`int`): the "auto" threshold (default 16).
    layer_types (`list[str]`, *optional*): "full_attention" | "sliding_attention" per layer (Qwen2 style).
        Default: all "sliding_attention" when `sliding_window` is set (Mistral), else all "full_attention".
    """

    model_type = "llama_mla"

    kv_lora_rank: int | None = None
    rope_pairs: int | None = None
    rope_pair_indices: list | None = None
    layer_kv_lora_ranks: list | None = None
    layer_rope_pairs: list | None = None
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    source_model_type: str = "llama"
    sliding_window: int | None = None
    layer_types: list | None = None
    mla_attention_path: str = "auto"
    absorb_max_query_length: int = 16
    rope_layout: str = "per_head"
    latent_norm: bool = False

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._check_layer_lists()
        if self.rope_pairs is None:
            layers = self.layer_rope_pairs
            self.rope_pairs = self.head_dim // 2 if layers is None else max(layers)
        if self.kv_lora_rank is None:  # the largest layer's, else full rank (in every layer)
            hkv, d, full = self.num_key_value_heads, self.head_dim, self.full_kv_lora_rank
            if self.layer_kv_lora_ranks is None and self.layer_rope_pairs is not None:
                self.layer_kv_lora_ranks = [full(hkv, d, r) for r in self.layer_rope_pairs]
            self.kv_lora_rank = max(self.layer_kv_lora_ranks or [full(hkv, d, self.rope_pairs)])
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.o_bias is None:
            self.o_bias = self.attention_bias
        if self.layer_types is None:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self._check_mla_fields()
        super().__post_init__(**kwargs)

    def _check_mla_fields(self) -> None:
        d, hkv, r = self.head_dim, self.num_key_value_heads, self.rope_pairs
        if d % 2:
            raise ValueError(f"head_dim must be even for RoPE pairs, got {d}.")
        if self.num_attention_heads % hkv:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({hkv})."
            )
        if not 0 <= r <= d // 2:
            raise ValueError(f"rope_pairs must be in [0, head_dim / 2 = {d // 2}], got {r}.")
        if self.kv_lora_rank < 1:
            raise ValueError(f"kv_lora_rank must be >= 1, got {self.kv_lora_rank}.")
        for field, scalar, kind in (
            ("layer_rope_pairs", "rope_pairs", "r"),
            ("layer_kv_lora_ranks", "kv_lora_rank", "d_c"),
        ):
            values = getattr(self, field)
            if values is not None and getattr(self, scalar) != max(values):
                raise ValueError(
                    f"{scalar}={getattr(self, scalar)} but max({field}) = {max(values)}: with per-layer "
                    f"{kind} the scalar {scalar} is the largest layer's; drop {scalar} or set it to "
                    f"{max(values)}."
                )
        for field, choices, hint in (
            ("rope_layout", ROPE_LAYOUTS, "; use 'shared' for DeepSeek's one RoPE key per layer"),
            ("mla_attention_path", MLA_ATTENTION_PATHS, ""),
            ("source_model_type", SOURCE_MODEL_TYPES, ""),
        ):
            if getattr(self, field) not in choices:
                raise ValueError(f"{field} must be one of {choices}, got {getattr(self, field)!r}{hint}.")
        if not isinstance(self.latent_norm, bool):
            raise ValueError(f"latent_norm must be True or False, got {self.latent_norm!r}.")
        if self.absorb_max_query_length < 0:
            raise ValueError(f"absorb_max_query_length must be >= 0, got {self.absorb_max_query_length}.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers; "
                "give one per layer."
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types may only hold 'full_attention' / 'sliding_attention', got {bad}.")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "layer_types has 'sliding_attention' layers but sliding_window is None; set sliding_window."
            )
        if self.rope_pair_indices is not None:
            self._check_rope_pair_indices()

    def _check_layer_lists(self) -> None:
        """layer_rope_pairs / layer_kv_lora_ranks: one int per layer, r in [0, d/2], d_c >= 1."""
        layers, half = self.num_hidden_layers, self.head_dim // 2
        for field, low, high in (("layer_rope_pairs", 0, half), ("layer_kv_lora_ranks", 1, None)):
            values = getattr(self, field)
            if values is None:
                continue
            bad = not isinstance(values, (list, tuple)) or len(values) != layers
            bad = bad or any(not isinstance(v, int) or isinstance(v, bool) or v < low for v in values)
            bad = bad or (high is not None and any(v > high for v in values))
            if bad:
                bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(
                    f"{field} must be a list of num_hidden_layers={layers} ints {bounds}, got {values!r}; "
                    f"give one value per layer or None for the same value in every layer."
                )
            setattr(self, field, list(values))

    def _check_rope_pair_indices(self) -> None:
        idx, layers, hr = self.rope_pair_indices, self.num_hidden_layers, self.num_rope_keys
        half = self.head_dim // 2
        if len(idx) != layers or any(len(heads) != hr for heads in idx):
            what = "1 (rope_layout='shared')" if self.rope_layout == "shared" else "num_key_value_heads"
            raise ValueError(
                f"rope_pair_indices must be [num_layers={layers}][{what}={hr}]"
                f"[rope_pairs]; got {len(idx)} layers with {sorted({len(h) for h in idx})} heads."
            )
        for i, heads in enumerate(idx):
            r = self.layer_rope_pairs_of(i)
            for g, pairs in enumerate(heads):
                ok = len(pairs) == r and all(isinstance(p, int) and 0 <= p < half for p in pairs)
                if not ok or any(a >= b for a, b in zip(pairs, pairs[1:])):
                    raise ValueError(
                        f"rope_pair_indices[{i}][{g}] = {pairs} must hold {r} strictly ascending ints "
                        f"in [0, {half})."
                    )

    def to_dict(self) -> dict:
        """The config's fields; the per-layer lists only when set (uniform configs serialise as before)."""
        out = super().to_dict()
        for key in ("layer_kv_lora_ranks", "layer_rope_pairs"):
            if key in out and out[key] is None:
                del out[key]
        return out

    @property
    def num_rope_keys(self) -> int:
        """Hr, RoPE keys per layer: Hkv for rope_layout "per_head", 1 for "shared"."""
        return 1 if self.rope_layout == "shared" else self.num_key_value_heads

    def pair_indices(self, layer_idx: int) -> list[list[int]]:
        """Kept RoPE pairs of layer `layer_idx`: `[Hr][r]`, sorted ascending."""
        if self.rope_pair_indices is None:
            return [list(range(self.layer_rope_pairs_of(layer_idx))) for _ in range(self.num_rope_keys)]
        return [list(p) for p in self.rope_pair_indices[layer_idx]]

    def layer_rope_pairs_of(self, layer_idx: int) -> int:
        """r of layer `layer_idx` (`layer_rope_pairs[i]`, else `rope_pairs`)."""
        return self.rope_pairs if self.layer_rope_pairs is None else self.layer_rope_pairs[layer_idx]

    def layer_kv_lora_rank_of(self, layer_idx: int) -> int:
        """d_c of layer `layer_idx` (`layer_kv_lora_ranks[i]`, else `kv_lora_rank`)."""
        return self.kv_lora_rank if self.layer_kv_lora_ranks is None else self.layer_kv_lora_ranks[layer_idx]

    @property
    def is_ragged(self) -> bool:
        """True when layers differ in d_c or r (per-layer lists that are not constant)."""
        lists = (self.layer_kv_lora_ranks, self.layer_rope_pairs)
        return any(v is not None and len(set(v)) > 1 for v in lists)

    def kv_cache_numbers_per_layer(self) -> list[int]:
        """Numbers cached per token in each layer: d_c,i + Hr * 2 r_i."""
        return [
            self.cache_numbers(self.layer_kv_lora_rank_of(i), self.num_rope_keys, self.layer_rope_pairs_of(i))
            for i in range(self.num_hidden_layers)
        ]

    def kv_cache_numbers_per_token(self) -> int | float:
        """Numbers cached per token and layer: the latent (d_c) plus the post-RoPE keys (Hr * 2r, Hr = Hkv
        per head or 1 shared); with per-layer ranks the mean over layers (sum / num_layers)."""
        per_layer = self.kv_cache_numbers_per_layer()
        total = sum(per_layer)
        return total // len(per_layer) if total % len(per_layer) == 0 else total / len(per_layer)

    @staticmethod
    def cache_numbers(kv_lora_rank: int, num_rope_keys: int, rope_pairs: int) -> int:
        """d_c + Hr * 2r (Hr RoPE keys per token: Hkv per head, 1 shared): numbers cached per token and layer
        (the one home of this formula)."""
        return kv_lora_rank + num_rope_keys * 2 * rope_pairs

    @staticmethod
    def full_kv_lora_rank(num_key_value_heads: int, head_dim: int, rope_pairs: int) -> int:
        """Hkv * (d - 2r) + Hkv * d: the width of the stacked [k_nope; v], the largest useful d_c."""
        return num_key_value_heads * (head_dim - 2 * rope_pairs) + num_key_value_heads * head_dim


LlamaMLAConfig.register_for_auto_class()

__all__ = ["LlamaMLAConfig"]
