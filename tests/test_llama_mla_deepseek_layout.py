"""The DeepSeek layout options of `llama_mla`: `rope_layout="shared"` (one decoupled RoPE key per layer) and
`latent_norm=True` (an RMSNorm on the cached latent).

References are independent of the code under test:
- shared RoPE key == a per-head model whose Hkv RoPE keys are identical copies of it (the per-head layout is
  itself tested against its source architecture in test_llama_mla_model.py);
- latent norm == the model without it whose kv_down_proj output is normalised by an explicit float64 RMSNorm;
- expanded == absorbed, cache == no cache, greedy generate with cache == without.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE

from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

TOL = 1e-4  # max |diff| relative to max |logit|, fp32

# E=48, Hq=6, Hkv=2 (G=3), d=8 (4 pairs), r=2, d_c=12, 2 layers; shared key pairs differ by layer.
TINY = dict(
    vocab_size=97,
    **TINY_SHAPE,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    pad_token_id=0,
    kv_lora_rank=12,
    rope_pairs=2,
)
SHARED_PAIRS = [[[0, 3]], [[1, 2]]]  # [layer][1][r]


def randomize_(model: torch.nn.Module, seed: int = 1234) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def shared_model(**overrides) -> LlamaMLAForCausalLM:
    fields = {**TINY, "rope_layout": "shared", "rope_pair_indices": SHARED_PAIRS, "attention_bias": True}
    return randomize_(LlamaMLAForCausalLM(LlamaMLAConfig(**{**fields, **overrides})))


def batch(T: int = 12, B: int = 2, pad: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def assert_close(got, ref, mask=None, tol=TOL):
    keep = torch.ones(ref.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    diff, scale = (got - ref).abs()[keep].max().item(), ref.abs()[keep].max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3g} > {tol} * max |logit| {scale:.3g}"


@torch.no_grad()
def logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits


@torch.no_grad()
def incremental(model, ids, mask, chunks):
    pos, cache, out, start = positions(mask), None, [], 0
    for n in chunks:
        stop = start + n
        res = model(
            input_ids=ids[:, start:stop],
            attention_mask=mask[:, :stop],
            position_ids=pos[:, start:stop],
            past_key_values=cache,
            use_cache=True,
        )
        cache, start = res.past_key_values, stop
        out.append(res.logits)
    return torch.cat(out, dim=1)


def per_head_copy(shared: LlamaMLAForCausalLM) -> LlamaMLAForCausalLM:
    """The per-head model whose Hkv RoPE keys are identical copies of `shared`'s one key."""
    cfg = shared.config
    Hkv = cfg.num_key_value_heads
    fields = {k: v for k, v in cfg.to_dict().items() if k in TINY or k in ("attention_bias", "latent_norm")}
    pairs = [[heads[0]] * Hkv for heads in cfg.rope_pair_indices]  # [L][Hkv][r]
    ref = LlamaMLAForCausalLM(
        LlamaMLAConfig(**fields, rope_layout="per_head", rope_pair_indices=pairs)
    ).eval()
    sd = shared.state_dict()
    new = {}
    for k, v in sd.items():
        new[k] = v.repeat(Hkv, *([1] * (v.dim() - 1))) if ".k_rope_proj." in k else v  # (Hkv*2r, ...)
    missing, unexpected = ref.load_state_dict(new, strict=False)
    assert not unexpected and all(k.endswith("rope_dims") for k in missing), (missing, unexpected)
    return ref


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("latent_norm", [False, True])
def test_shared_key_equals_per_head_copies(latent_norm):
    model = shared_model(latent_norm=latent_norm)
    assert model.model.layers[0].self_attn.k_rope_proj.weight.shape == (2 * 2, 48)  # (2r, E)
    ref_model = per_head_copy(model)
    ids, mask = batch()
    ref = logits(ref_model, ids, mask)
    assert_close(logits(model, ids, mask), ref, mask)  # expanded (no cache), sdpa
    assert_close(incremental(model, ids, mask, [6, 1, 1, 3, 1]), ref, mask)  # absorbed decode steps
    model.config.absorb_max_query_length = 0  # every step expanded, with the cache
    assert_close(incremental(model, ids, mask, [6, 1, 1, 3, 1]), ref, mask)


def test_per_head_copies_reference_can_fail():
    """Different pairs on the copies' second head change the logits: the reference above is sensitive."""
    model = shared_model()
    ref_model = per_head_copy(model)
    ref_model.config.rope_pair_indices = [[p[0], [0, 1]] for p in model.config.rope_pair_indices]
    for layer in ref_model.model.layers:
        layer.self_attn.rope_dims.copy_(layer.self_attn.default_rope_dims())
    ids, mask = batch(pad=0)
    ref, got = logits(ref_model, ids, mask), logits(model, ids, mask)
    assert (ref - got).abs().max() > 100 * TOL * ref.abs().max()


@pytest.mark.parametrize("layout", ["per_head", "shared"])
def test_latent_norm_matches_explicit_rmsnorm(layout):
    pairs = SHARED_PAIRS if layout == "shared" else [[[0, 3], [1, 2]], [[2, 3], [0, 1]]]
    model = shared_model(latent_norm=True, rope_layout=layout, rope_pair_indices=pairs)
    plain = LlamaMLAForCausalLM(model.config.__class__(**{**model.config.to_dict(), "latent_norm": False}))
    missing, unexpected = plain.eval().load_state_dict(model.state_dict(), strict=False)
    assert all(k.endswith("rope_dims") for k in missing) and all("latent_norm" in k for k in unexpected)
    eps = model.config.rms_norm_eps
    for layer, ref_layer in zip(model.model.layers, plain.model.layers):
        gain = layer.self_attn.latent_norm.weight.detach().double()

        def explicit(module, args, out, gain=gain):  # float64 RMSNorm over the d_c latent dims
            x = out.double()
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain).to(out.dtype)

        ref_layer.self_attn.kv_down_proj.register_forward_hook(explicit)
    ids, mask = batch()
    ref = logits(plain, ids, mask)
    assert_close(logits(model, ids, mask), ref, mask)
    assert_close(incremental(model, ids, mask, [5, 1, 1, 4, 1]), ref, mask)
    # the norm really acts (else the comparison could not fail): without it the logits differ
    plain_no_hook = LlamaMLAForCausalLM(plain.config).eval()
    plain_no_hook.load_state_dict(plain.state_dict(), strict=False)
    assert (logits(plain_no_hook, ids, mask) - ref).abs().max() > 100 * TOL * ref.abs().max()


@pytest.mark.parametrize("attn", ["sdpa", "eager", "hf_attn_grouped"])
def test_shared_expanded_equals_absorbed(attn):
    model = shared_model(latent_norm=True)
    model.set_attn_implementation(attn)
    ids, mask = batch(T=14)
    results = {}
    for path in ("expanded", "absorbed"):
        model.config.mla_attention_path = path
        results[path] = (logits(model, ids, mask), incremental(model, ids, mask, [7, 1, 1, 3, 1, 1]))
    assert_close(results["absorbed"][0], results["expanded"][0], mask)
    assert_close(results["absorbed"][1], results["expanded"][1], mask)
    assert_close(results["expanded"][1], results["expanded"][0], mask)


def test_shared_generate_with_cache_equals_without():
    model = shared_model(latent_norm=True)
    ids, mask = batch(T=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(**kwargs, use_cache=False)
        for path in ("auto", "expanded", "absorbed"):
            model.config.mla_attention_path = path
            assert torch.equal(model.generate(**kwargs), ref), path
        model.config.mla_attention_path = "auto"
        assert torch.equal(model.generate(**kwargs, cache_implementation="static"), ref)


@pytest.mark.parametrize("layout,hr", [("shared", 1), ("per_head", 2)])
def test_cache_numbers_per_token(layout, hr):
    pairs = SHARED_PAIRS if layout == "shared" else None
    model = shared_model(latent_norm=True, rope_layout=layout, rope_pair_indices=pairs)
    cfg = model.config
    assert cfg.kv_cache_numbers_per_token() == 12 + hr * 2 * 2
    ids, mask = batch(T=9)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    measured = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == 2 * 9 * cfg.num_hidden_layers * cfg.kv_cache_numbers_per_token()
    assert cache.layers[0].keys.shape == (2, 1, 9, 12) and cache.layers[0].values.shape == (2, 1, 9, hr * 4)


def test_save_load_round_trip(tmp_path):
    model = shared_model(latent_norm=True)
    assert "model.layers.1.self_attn.latent_norm.weight" in model.state_dict()
    model.save_pretrained(tmp_path)
    loaded = LlamaMLAForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.rope_layout, loaded.config.latent_norm) == ("shared", True)
    ids, mask = batch()
    assert torch.equal(logits(loaded, ids, mask), logits(model, ids, mask))


def test_config_defaults_keep_per_head():
    cfg = LlamaMLAConfig(**TINY)
    assert (cfg.rope_layout, cfg.latent_norm, cfg.num_rope_keys) == ("per_head", False, 2)
    shared = LlamaMLAConfig(**TINY, rope_layout="shared")
    assert shared.pair_indices(0) == [[0, 1]] and shared.kv_cache_numbers_per_token() == 12 + 4


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"rope_layout": "deepseek"}, "rope_layout"),
        ({"rope_layout": "shared", "rope_pair_indices": [[[0, 1], [0, 1]], [[0, 1], [0, 1]]]}, "shared"),
        ({"rope_layout": "per_head", "rope_pair_indices": SHARED_PAIRS}, "num_key_value_heads"),
        ({"latent_norm": "yes"}, "latent_norm"),
    ],
)
def test_config_rejects_bad_layout_values(bad, match):
    with pytest.raises(ValueError, match=match):
        LlamaMLAConfig(**{**TINY, **bad})


def test_shared_layout_trains():
    """Healing needs gradients through both new parts: the shared RoPE key and the latent norm's gain."""
    model = shared_model(latent_norm=True).train()
    ids, mask = batch(pad=0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    attn = model.model.layers[0].self_attn
    for p in (attn.k_rope_proj.weight, attn.latent_norm.weight, attn.kv_down_proj.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
