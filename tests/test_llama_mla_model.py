"""The `llama_mla` model type: exactness against its source architecture, expanded vs absorbed attention,
generation, latent-cache size, save/load (registered and trust_remote_code) and RoPE scaling variants.

Every reference is independent of the code under test: the llama_mla state dict is built here from the source
weights per the checkpoint contract (`/work/notes/mla_spec.md`), and partial RoPE is checked against the
unmodified source model whose rotary function is patched to rotate only the kept pairs (no permutation).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_SHAPE
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import rotate_half

import hf_attn
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

TOL = 1e-4  # max |diff| relative to max |logit|, fp32

# Tiny shapes: E=48, Hq=6, Hkv=2 (G=3), d=8 (4 RoPE pairs per head), 2 layers.
TINY = dict(
    vocab_size=97,
    **TINY_SHAPE,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
)
PAIRS_R2 = [[[0, 3], [1, 2]], [[2, 3], [0, 1]]]  # [layer][kv head][r]: differ by layer and head


# ------------------------------------------------------------------------------------------------ helpers


def randomize_(model: torch.nn.Module) -> torch.nn.Module:
    """Weights large enough that attention is far from uniform; norms near 1; biases non-zero."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def tiny_source(kind: str, **overrides) -> torch.nn.Module:
    cfg_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    cfg = cfg_cls(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    return randomize_(AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"))


def head_orders(pairs: list[int], d: int) -> tuple[list[int], list[int]]:
    """Head-local row order per the contract: rope part [P, P + d/2], nope part [C, C + d/2]."""
    half = d // 2
    comp = [i for i in range(half) if i not in pairs]
    return pairs + [p + half for p in pairs], comp + [c + half for c in comp]


def mla_from_source(src: torch.nn.Module, rope_pair_indices: list | None, r: int, **cfg_overrides):
    """Full-rank llama_mla built from `src` per the checkpoint contract (written here, independently)."""
    sc = src.config
    L, Hq, Hkv, d = sc.num_hidden_layers, sc.num_attention_heads, sc.num_key_value_heads, sc.head_dim
    G, dn = Hq // Hkv, d - 2 * r
    pairs = rope_pair_indices or [[list(range(r))] * Hkv] * L
    kind = sc.model_type
    fields = {
        k: v
        for k, v in sc.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", "auto_map", "dtype")
    }
    cfg = LlamaMLAConfig(
        **fields,
        kv_lora_rank=Hkv * dn + Hkv * d,
        rope_pairs=r,
        rope_pair_indices=rope_pair_indices,
        qkv_bias=kind == "qwen2" or bool(getattr(sc, "attention_bias", False)),
        o_bias=kind != "qwen2" and bool(getattr(sc, "attention_bias", False)),
        source_model_type=kind,
        **cfg_overrides,
    )
    dst = LlamaMLAForCausalLM(cfg).eval()
    sd = src.state_dict()
    new = {k: v for k, v in sd.items() if ".self_attn." not in k}
    for i in range(L):
        pre = f"model.layers.{i}.self_attn."
        orders = [head_orders(pairs[i][g], d) for g in range(Hkv)]
        q_rows = [h * d + j for h in range(Hq) for j in sum(orders[h // G], [])]
        kr_rows = [g * d + j for g in range(Hkv) for j in orders[g][0]]
        kn_rows = [g * d + j for g in range(Hkv) for j in orders[g][1]]
        for suffix in ("weight", "bias"):
            if pre + "q_proj." + suffix not in sd:
                continue
            new[pre + "q_proj." + suffix] = sd[pre + "q_proj." + suffix][q_rows]
            new[pre + "k_rope_proj." + suffix] = sd[pre + "k_proj." + suffix][kr_rows]
        w_k, w_v = sd[pre + "k_proj.weight"], sd[pre + "v_proj.weight"]
        new[pre + "kv_down_proj.weight"] = torch.cat([w_k[kn_rows], w_v])  # (d_c, E)
        eye = torch.eye(Hkv * dn + Hkv * d)
        new[pre + "k_up_proj.weight"] = eye[: Hkv * dn]  # (Hkv*dn, d_c)
        new[pre + "v_up_proj.weight"] = eye[Hkv * dn :]  # (Hkv*d, d_c)
        if pre + "k_proj.bias" in sd:
            new[pre + "k_up_proj.bias"] = sd[pre + "k_proj.bias"][kn_rows]
            new[pre + "v_up_proj.bias"] = sd[pre + "v_proj.bias"]
        new[pre + "o_proj.weight"] = sd[pre + "o_proj.weight"]
        if pre + "o_proj.bias" in sd:
            new[pre + "o_proj.bias"] = sd[pre + "o_proj.bias"]
    missing, unexpected = dst.load_state_dict(new, strict=False)
    assert not unexpected and all(k.endswith("rope_dims") for k in missing), (missing, unexpected)
    return dst


def patch_partial_rope(monkeypatch, src: torch.nn.Module, pairs: list) -> None:
    """Make `src` rotate only the kept pairs of each (layer, KV head): independent partial-RoPE reference."""
    d, Hkv = src.config.head_dim, src.config.num_key_value_heads
    G = src.config.num_attention_heads // Hkv
    current = {}
    for i, layer in enumerate(src.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: current.update(layer=i))

    def partial_rope(q, k, cos, sin, unsqueeze_dim=1):
        keep = torch.zeros(Hkv, d, dtype=torch.bool)  # (Hkv, d)
        for g, kept in enumerate(pairs[current["layer"]]):
            for p in kept:
                keep[g, p] = keep[g, p + d // 2] = True
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # (B, 1, T, d)

        def rot(x, keep_heads):
            m = keep_heads[None, :, None, :]  # (1, H, 1, d)
            return x * torch.where(m, cos, 1.0) + rotate_half(x) * torch.where(m, sin, 0.0)

        return rot(q, keep.repeat_interleave(G, 0)), rot(k, keep)

    monkeypatch.setattr(
        sys.modules[type(src.model.layers[0].self_attn).__module__], "apply_rotary_pos_emb", partial_rope
    )


def batch(T: int = 12, B: int = 2, pad: int = 3, vocab: int = 97, seed: int = 0):
    """Token ids and a left-padded attention mask: row 1 has `pad` padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None, tol=TOL):
    """max |got - ref| over attended positions <= tol * max |ref|."""
    keep = torch.ones(ref.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    diff = (got - ref).abs()[keep].max().item()
    scale = ref.abs()[keep].max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3g} > {tol} * max |logit| {scale:.3g}"


@torch.no_grad()
def incremental_logits(model, ids, mask, chunks: list[int]) -> torch.Tensor:
    """Run `ids` through `model` in chunks of the given lengths with a KV cache; concatenate the logits."""
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
    assert start == ids.shape[1]
    return torch.cat(out, dim=1)


def tiny_mla(**overrides) -> LlamaMLAForCausalLM:
    """A random reduced-rank llama_mla with per-layer / per-head RoPE pairs and all biases."""
    fields = {
        **TINY,
        "kv_lora_rank": 12,
        "rope_pairs": 2,
        "rope_pair_indices": PAIRS_R2,
        "attention_bias": True,
    }
    return randomize_(LlamaMLAForCausalLM(LlamaMLAConfig(**{**fields, **overrides})))


# --------------------------------------------------------------------------------------- (a) exactness


SOURCES = {
    "llama": dict(kind="llama"),
    "llama_bias": dict(kind="llama", attention_bias=True),
    "mistral_window": dict(kind="mistral", sliding_window=5),
    "qwen2": dict(kind="qwen2"),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_full_rope_full_rank_reproduces_source(name):
    spec = dict(SOURCES[name])
    src = tiny_source(spec.pop("kind"), **spec)
    mla = mla_from_source(src, None, r=4)
    ids, mask = batch()
    with torch.no_grad():
        ref = src(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        full = mla(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits  # expanded, sdpa
    assert_close_logits(full, ref, mask)
    # prefill + decode with the latent cache: absorbed for the short steps, expanded for the long prefill
    assert_close_logits(incremental_logits(mla, ids, mask, [6, 1, 1, 3, 1]), ref, mask)


# ------------------------------------------------------------------------------ (b) partial RoPE, full rank


@pytest.mark.parametrize("kind,r,pairs", [("llama", 2, PAIRS_R2), ("qwen2", 2, PAIRS_R2), ("llama", 0, None)])
def test_partial_rope_full_rank_matches_partial_rope_source(monkeypatch, kind, r, pairs):
    src = tiny_source(kind, attention_bias=True) if kind == "llama" else tiny_source(kind)
    mla = mla_from_source(src, pairs, r=r)
    patch_partial_rope(monkeypatch, src, pairs or [[list(range(r))] * 2] * 2)
    ids, mask = batch()
    with torch.no_grad():
        ref = src(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        full = mla(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert_close_logits(full, ref, mask)
    assert_close_logits(incremental_logits(mla, ids, mask, [5, 1, 1, 4, 1]), ref, mask)


def test_partial_rope_reference_differs_from_full_rope(monkeypatch):
    """The partial-RoPE reference really changes the model (else test (b) could not fail)."""
    src = tiny_source("llama")
    ids, mask = batch(pad=0)
    with torch.no_grad():
        full = src(input_ids=ids).logits
        patch_partial_rope(monkeypatch, src, PAIRS_R2)
        partial = src(input_ids=ids).logits
    assert (full - partial).abs().max() > 100 * TOL * full.abs().max()


# ------------------------------------------------------------------------------ (c) expanded vs absorbed


@pytest.mark.parametrize("attn", ["sdpa", "eager", "hf_attn_grouped"])
@pytest.mark.parametrize("pad", [0, 3])
def test_expanded_equals_absorbed(attn, pad):
    model = tiny_mla()
    model.set_attn_implementation(attn)
    ids, mask = batch(T=14, pad=pad, seed=pad)
    results = {}
    for path in ("expanded", "absorbed"):
        model.config.mla_attention_path = path
        with torch.no_grad():
            nocache = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        results[path] = (nocache, incremental_logits(model, ids, mask, [7, 1, 1, 3, 1, 1]))
    assert_close_logits(results["absorbed"][0], results["expanded"][0], mask)
    assert_close_logits(results["absorbed"][1], results["expanded"][1], mask)
    assert_close_logits(results["expanded"][1], results["expanded"][0], mask)  # cache == no cache


def test_absorbed_never_expands_cached_tokens():
    """Decode steps under "auto" take the absorbed path: k_up_proj / v_up_proj never run as modules."""
    model = tiny_mla()
    calls = []
    for layer in model.model.layers:
        for proj in (layer.self_attn.k_up_proj, layer.self_attn.v_up_proj):
            proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    ids, mask = batch(T=10)
    incremental_logits(model, ids, mask, [8, 1, 1])
    # only the 8-token prefill ran (absorbed: its T=8 <= 16 as well, so nothing ran at all)
    assert calls == []
    model.config.absorb_max_query_length = 4
    incremental_logits(model, ids, mask, [8, 1, 1])
    assert [s[1] for s in calls] == [8] * 4  # prefill expanded (2 layers x k_up, v_up); decode absorbed


def test_fully_masked_rows_give_zeros():
    attn = tiny_mla().model.layers[0].self_attn
    B, T, S = 1, 2, 5
    q_rope = torch.randn(B, 2, 3, T, 4)
    q_nope = torch.randn(B, 2, 3, T, 4)
    latent, k_rope = torch.randn(B, 1, S, 12), torch.randn(B, 2, S, 4)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, 0, 1] = False  # second query sees nothing
    out, _ = attn.absorbed_attention(q_rope, q_nope, latent, k_rope, mask)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert out[0, 0].abs().sum() > 0


# ------------------------------------------------------------------------------------------ (d) generate


def test_greedy_generate_matches_between_paths_and_source():
    src = tiny_source("llama", attention_bias=True)
    mla = mla_from_source(src, None, r=4)
    ids, mask = batch(T=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = src.generate(**kwargs)
        outs = {}
        for path in ("auto", "expanded", "absorbed"):
            mla.config.mla_attention_path = path
            outs[path] = mla.generate(**kwargs)
        mla.config.mla_attention_path = "auto"
        outs["static"] = mla.generate(**kwargs, cache_implementation="static")  # preallocated latent cache
    for path, out in outs.items():
        assert torch.equal(out, ref), path


# --------------------------------------------------------------------------------------- (e) cache bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_match_formula(dtype):
    model = tiny_mla().to(dtype)
    cfg = model.config
    B, T = 2, 9
    ids, mask = batch(T=T, pad=2)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    per_token_layer = cfg.kv_lora_rank + cfg.num_key_value_heads * 2 * cfg.rope_pairs  # 12 + 2 * 4 = 20
    assert per_token_layer == cfg.kv_cache_numbers_per_token() == 20
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert measured == B * T * cfg.num_hidden_layers * per_token_layer * itemsize
    assert cache.layers[0].keys.shape == (B, 1, T, 12) and cache.layers[0].values.shape == (B, 1, T, 8)


# --------------------------------------------------------------------------------------- (f) save / load

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "remote":
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "hf_attn" or name.startswith("hf_attn."):
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "hf_attn"))]
    import torch
    from transformers import AutoModelForCausalLM
    if mode == "registered":
        import hf_attn  # noqa: F401
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    data = torch.load(path + "/expected.pt")
    with torch.no_grad():
        logits = model(input_ids=data["ids"], attention_mask=data["mask"]).logits
        gen = model.generate(input_ids=data["ids"], attention_mask=data["mask"], max_new_tokens=4,
                             do_sample=False, pad_token_id=0)
    keep = data["mask"].bool()
    print(json.dumps({
        "diff": (logits - data["logits"]).abs()[keep].max().item(),
        "scale": data["logits"].abs()[keep].max().item(),
        "generate_equal": bool(torch.equal(gen, data["generated"])),
        "module": type(model).__module__,
        "hf_attn_loaded": any(m == "hf_attn" or m.startswith("hf_attn.") for m in sys.modules),
        "rope_dims": model.model.layers[1].self_attn.rope_dims.tolist(),
    }))
    """
)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_mla()
    path = tmp_path_factory.mktemp("llama_mla") / "ckpt"
    model.save_pretrained(path)
    ids, mask = batch(T=8)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    torch.save({"ids": ids, "mask": mask, "logits": logits, "generated": generated}, path / "expected.pt")
    return path, model


def run_children(modes: list[str], path: Path, tmp_path: Path) -> dict[str, dict]:
    """Run the load check in one fresh interpreter per mode, concurrently; return each one's JSON report."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TRANSFORMERS_VERBOSITY="error")
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, str(path)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in modes
    }
    reports = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{mode}: {err[-3000:]}"
        reports[mode] = json.loads(out.strip().splitlines()[-1])
    return reports


def test_saved_checkpoint_is_self_describing(saved_checkpoint):
    path, model = saved_checkpoint
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama_mla"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_llama_mla.LlamaMLAConfig",
        "AutoModelForCausalLM": "modeling_llama_mla.LlamaMLAForCausalLM",
    }
    assert config["rope_pair_indices"] == PAIRS_R2
    allowed = {"__future__", "collections", "functools", "inspect", "warnings", "torch", "transformers"}
    for name in ("configuration_llama_mla.py", "modeling_llama_mla.py"):
        tree = ast.parse((path / name).read_text())
        guarded = {  # imports inside `try: ... except ImportError:` (hf_attn's optional Triton kernel)
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.Try)
            and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                assert {a.name.split(".")[0] for a in node.names} <= allowed, (name, ast.dump(node))
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in allowed, (name, node.module)


def test_load_in_subprocesses(saved_checkpoint, tmp_path):
    """`import hf_attn` + AutoModelForCausalLM; trust_remote_code=True where hf_attn cannot be imported."""
    path, model = saved_checkpoint
    reports = run_children(["registered", "remote"], path, tmp_path)
    for res in reports.values():
        assert res["diff"] <= TOL * res["scale"]
        assert res["generate_equal"]
        assert res["rope_dims"] == model.model.layers[1].self_attn.rope_dims.tolist()
    assert reports["registered"]["module"] == "hf_attn.models.llama_mla.modeling_llama_mla"
    assert reports["remote"]["module"].startswith("transformers_modules.")
    assert not reports["remote"]["hf_attn_loaded"]


# ------------------------------------------------------------------------------------- (g) RoPE scaling

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_variants_match_source(monkeypatch, variant):
    rope = {"rope_theta": 10000.0, **ROPE_VARIANTS[variant]}
    src = tiny_source("llama", rope_parameters=rope, max_position_embeddings=16)
    ids, mask = batch(T=24)  # beyond max_position_embeddings: dynamic rescales
    mla = mla_from_source(src, None, r=4)
    with torch.no_grad():
        ref = src(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        got = mla(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert_close_logits(got, ref, mask)
    if variant == "yarn":  # partial RoPE takes the scaled frequencies (and yarn's attention factor) too
        mla = mla_from_source(src, PAIRS_R2, r=2)
        patch_partial_rope(monkeypatch, src, PAIRS_R2)
        with torch.no_grad():
            ref = src(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
            got = mla(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        assert_close_logits(got, ref, mask)


# ------------------------------------------------------------------------------- config and registration


def test_registered_with_auto_classes():
    hf_attn.register()
    hf_attn.register()  # idempotent
    cfg = AutoConfig.for_model("llama_mla", **TINY)
    assert type(cfg) is LlamaMLAConfig
    assert type(AutoModelForCausalLM.from_config(cfg)) is LlamaMLAForCausalLM


def test_config_derives_defaults():
    cfg = LlamaMLAConfig(**TINY)
    assert (cfg.rope_pairs, cfg.kv_lora_rank, cfg.qkv_bias, cfg.o_bias) == (4, 2 * 8, False, False)
    assert cfg.layer_types == ["full_attention"] * 2 and cfg.pair_indices(1) == [[0, 1, 2, 3]] * 2
    cfg = LlamaMLAConfig(**TINY, sliding_window=4, rope_pairs=1)
    assert cfg.layer_types == ["sliding_attention"] * 2 and cfg.kv_lora_rank == 2 * 6 + 2 * 8


@pytest.mark.parametrize(
    "bad",
    [
        {"rope_pairs": 5},
        {"rope_pairs": 2, "rope_pair_indices": [[[0, 1], [1, 0]], [[0, 1], [0, 1]]]},
        {"rope_pairs": 2, "rope_pair_indices": [[[0, 1], [0, 4]], [[0, 1], [0, 1]]]},
        {"rope_pairs": 2, "rope_pair_indices": [[[0, 1], [0, 2]]]},
        {"kv_lora_rank": 0},
        {"mla_attention_path": "fast"},
        {"layer_types": ["sliding_attention", "full_attention"]},
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        LlamaMLAConfig(**{**TINY, **bad})
