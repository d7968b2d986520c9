"""Per-layer ranks (`layer_kv_lora_ranks`, `layer_rope_pairs`) in llama_mla and the converter's greedy
allocation (conversion.mla.ranks).

References are independent of the code under test: a ragged full-rank model is built here from the source
weights per the checkpoint contract and compared with the unmodified source whose rotary function rotates only
the kept pairs (helpers of test_llama_mla_model); the greedy split is compared with brute force; cache sizes
with the bytes of a real cache.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from test_llama_mla_model import (
    TINY,
    assert_close_logits,
    batch,
    head_orders,
    incremental_logits,
    patch_partial_rope,
    positions,
    randomize_,
    tiny_source,
)
from test_mla_conversion import tiny_root  # noqa: F401 (fixture)

from hf_attn.conversion import mla
from hf_attn.conversion.mla import ranks as alloc
from hf_attn.conversion.specs import CalibrationSpec, MLASpec, default_allocation
from hf_attn.eval.kv_cache import kv_bytes_per_token, kv_cache_bytes, measured_kv_bytes_per_token
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

RAGGED_PAIRS = [[[0, 3], [1, 2]], [[2], [0]]]  # layer 0: r = 2, layer 1: r = 1 (per KV head)


def ragged_full_rank_from_source(src, pairs):
    """Every layer at its own r and its full rank d_c,i = Hkv (d - 2 r_i) + Hkv d, built from `src`."""
    sc = src.config
    L, Hq, Hkv, d = sc.num_hidden_layers, sc.num_attention_heads, sc.num_key_value_heads, sc.head_dim
    G = Hq // Hkv
    r_layers = [len(p[0]) for p in pairs]
    fields = {
        k: v
        for k, v in sc.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", "auto_map", "dtype")
    }
    cfg = LlamaMLAConfig(
        **fields, layer_rope_pairs=r_layers, rope_pair_indices=pairs, source_model_type="llama"
    )
    dst = LlamaMLAForCausalLM(cfg).eval()
    sd = src.state_dict()
    new = {k: v for k, v in sd.items() if ".self_attn." not in k}
    for i in range(L):
        pre, dn = f"model.layers.{i}.self_attn.", d - 2 * r_layers[i]
        orders = [head_orders(pairs[i][g], d) for g in range(Hkv)]
        new[pre + "q_proj.weight"] = sd[pre + "q_proj.weight"][
            [h * d + j for h in range(Hq) for j in sum(orders[h // G], [])]
        ]
        new[pre + "k_rope_proj.weight"] = sd[pre + "k_proj.weight"][
            [g * d + j for g in range(Hkv) for j in orders[g][0]]
        ]
        kn = [g * d + j for g in range(Hkv) for j in orders[g][1]]
        new[pre + "kv_down_proj.weight"] = torch.cat(
            [sd[pre + "k_proj.weight"][kn], sd[pre + "v_proj.weight"]]
        )
        eye = torch.eye(Hkv * dn + Hkv * d)
        new[pre + "k_up_proj.weight"], new[pre + "v_up_proj.weight"] = eye[: Hkv * dn], eye[Hkv * dn :]
        new[pre + "o_proj.weight"] = sd[pre + "o_proj.weight"]
    missing, unexpected = dst.load_state_dict(new, strict=False)
    assert not unexpected and all(k.endswith("rope_dims") for k in missing), (missing, unexpected)
    return dst


def ragged_lossy(**overrides) -> LlamaMLAForCausalLM:
    fields = {
        **TINY,
        "layer_kv_lora_ranks": [12, 5],
        "layer_rope_pairs": [2, 1],
        "rope_pair_indices": RAGGED_PAIRS,
        "attention_bias": True,
    }
    return randomize_(LlamaMLAForCausalLM(LlamaMLAConfig(**{**fields, **overrides})))


# ------------------------------------------------------------------------------------------------ config


def test_config_round_trip_and_derived_scalars(tmp_path):
    cfg = LlamaMLAConfig(**TINY, layer_kv_lora_ranks=[12, 5], layer_rope_pairs=[2, 1])
    assert (cfg.kv_lora_rank, cfg.rope_pairs, cfg.is_ragged) == (12, 2, True)
    assert [cfg.layer_kv_lora_rank_of(i) for i in range(2)] == [12, 5]
    assert cfg.pair_indices(1) == [[0], [0]]  # default: the highest-frequency r_i pairs
    assert cfg.kv_cache_numbers_per_layer() == [12 + 2 * 2 * 2, 5 + 2 * 2 * 1]
    cfg.save_pretrained(tmp_path)
    back = LlamaMLAConfig.from_pretrained(tmp_path)
    assert back.layer_kv_lora_ranks == [12, 5] and back.layer_rope_pairs == [2, 1] and back.kv_lora_rank == 12
    # per-layer r alone: every layer at its own full rank
    full = LlamaMLAConfig(**TINY, layer_rope_pairs=[4, 1])
    assert full.layer_kv_lora_ranks == [2 * 0 + 2 * 8, 2 * 6 + 2 * 8]
    # uniform: nothing per layer is written
    plain = LlamaMLAConfig(**TINY, kv_lora_rank=12, rope_pairs=2)
    assert not plain.is_ragged and plain.layer_kv_lora_ranks is None
    assert "layer_kv_lora_ranks" not in json.loads(plain.to_json_string(use_diff=True))


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_kv_lora_ranks": [12]},  # one per layer
        {"layer_kv_lora_ranks": [12, 0]},
        {"layer_rope_pairs": [2, 5]},  # > d/2
        {"layer_rope_pairs": [2, 1.0]},
        {"layer_kv_lora_ranks": [12, 5], "kv_lora_rank": 10},  # scalar is the max
        {"layer_rope_pairs": [2, 1], "rope_pairs": 1},
        {"layer_rope_pairs": [2, 1], "rope_pair_indices": [[[0, 1], [0, 1]], [[0, 1], [0, 1]]]},  # r_1 = 1
    ],
)
def test_config_rejects_bad_layer_lists(bad):
    with pytest.raises(ValueError):
        LlamaMLAConfig(**{**TINY, **bad})


# ------------------------------------------------------------------------------------------------- model


def test_ragged_full_rank_reproduces_partial_rope_source(monkeypatch):
    src = tiny_source("llama")
    model = ragged_full_rank_from_source(src, RAGGED_PAIRS)
    assert [layer.self_attn.kv_lora_rank for layer in model.model.layers] == [2 * 4 + 16, 2 * 6 + 16]
    ids, mask = batch(T=12)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        patch_partial_rope(monkeypatch, src, RAGGED_PAIRS)
        ref = src(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert_close_logits(got, ref, mask)


@pytest.mark.parametrize("pad", [0, 3])
def test_ragged_absorbed_decode_with_cache_equals_full_forward(pad):
    model = ragged_lossy()
    ids, mask = batch(T=12, pad=pad, seed=pad)
    model.config.mla_attention_path = "expanded"
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    model.config.mla_attention_path = "absorbed"
    assert_close_logits(incremental_logits(model, ids, mask, [6, 1, 1, 3, 1]), full, mask)


def test_ragged_cache_numbers_are_the_per_layer_sum():
    model = ragged_lossy()
    per_layer = [12 + 2 * 2 * 2, 5 + 2 * 2 * 1]
    computed = kv_bytes_per_token(model.config)
    assert computed.total == 4 * sum(per_layer)  # fp32
    assert measured_kv_bytes_per_token(model, seq_len=4).total == computed.total
    assert kv_cache_bytes(model.config, 10) == 4 * 10 * sum(per_layer)
    ids, _ = batch(T=7, B=1, pad=0)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert [sum(t.shape[-1] for t in (layer.keys, layer.values)) for layer in cache.layers] == per_layer


# --------------------------------------------------------------------------------------------- allocator


def brute_force(gains, minimum, budget):
    best, best_split = -1.0, None
    ranges = [range(m, m + len(g) + 1) for g, m in zip(gains, minimum)]
    for split in itertools.product(*ranges):
        if sum(split) > budget:
            continue
        value = sum(float(g[: s - m].sum()) for g, s, m in zip(gains, split, minimum))
        if value > best + 1e-12:
            best, best_split = value, list(split)
    return best, best_split


@pytest.mark.parametrize("budget", [3, 6, 9, 14])
def test_greedy_rank_allocation_is_optimal_on_known_spectra(budget):
    spectra = [
        torch.tensor([9.0, 4.0, 1.0, 0.5, 0.1]),
        torch.tensor([3.0, 2.9, 2.8, 0.0]),
        torch.tensor([100.0, 1.0, 0.01, 0.001, 0.0, 0.0]),
    ]
    for norm in alloc.NORMALIZATIONS:
        ranks = alloc.allocate_ranks(spectra, total_rank=budget, normalization=norm)
        assert sum(ranks) <= budget and all(1 <= c <= len(ev) for c, ev in zip(ranks, spectra))
        gains = [alloc.relative_gains(ev, norm)[1:] for ev in spectra]
        best, _ = brute_force(gains, [1, 1, 1], budget)
        got = sum(float(g[: c - 1].sum()) for g, c in zip(gains, ranks))
        assert got == pytest.approx(best, abs=1e-12)
        if budget >= sum(len(ev) for ev in spectra):
            assert ranks == [len(ev) for ev in spectra]  # everything fits: full rank everywhere


def test_pair_allocation_keeps_the_total_and_prefers_costly_pairs():
    scores = [
        torch.tensor([[5.0, 0.1, 0.1], [4.0, 0.2, 0.0]]),
        torch.tensor([[1.0, 3.0, 2.0], [1.0, 2.0, 3.0]]),
    ]
    r = alloc.allocate_pairs(scores, total_pairs=4, minimum=1)
    assert r == [1, 3]
    assert alloc.allocate_pairs(scores, total_pairs=2, minimum=1) == [1, 1]
    with pytest.raises(ValueError):
        alloc.greedy_allocate([torch.tensor([1.0])], minimum=[3], budget=2)


@pytest.mark.parametrize("allocation", ["greedy", "greedy-ranks"])
def test_greedy_conversion_honours_the_budget_and_loads(tiny_root, tmp_path, allocation):  # noqa: F811
    src = tiny_root / "llama_bias"
    calibration = CalibrationSpec(text=[tiny_root / "calib.txt"], tokens=256)
    plan = mla.plan_conversion(src, MLASpec(kv_budget=0.5, allocation=allocation), calibration)
    if allocation == "greedy":  # RoPE pairs move between layers, the latent width stays
        assert len({s.kv_lora_rank for s in plan.layer_shapes}) == 1
    geo = plan.shape.geometry
    numbers = [s.cache_numbers for s in plan.layer_shapes]
    assert sum(numbers) <= int(0.5 * 2 * geo.kv_dim) * geo.num_layers
    out = mla.write_conversion(plan, tmp_path / "mla")
    config = json.loads((out / "config.json").read_text())
    record = config["hf_attn"]["history"][-1]
    assert record["allocation"]["layer_kv_lora_ranks"] == [s.kv_lora_rank for s in plan.layer_shapes]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert kv_bytes_per_token(model.config).total == 4 * sum(numbers)
    assert record["kv_fraction"] == pytest.approx(sum(numbers) / (geo.num_layers * 2 * geo.kv_dim))
    ids, mask = batch(T=9, vocab=1000)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()
    # uniform: no per-layer fields in config.json, as before
    uniform = mla.write_conversion(
        mla.plan_conversion(
            src, MLASpec(kv_budget=0.5, allocation="uniform"), calibration_pass=plan.calibration
        ),
        tmp_path / "uniform",
    )
    text = (uniform / "config.json").read_text()
    assert "layer_kv_lora_ranks" not in text and "layer_rope_pairs" not in text


def test_default_allocation_is_greedy_only_where_it_applies():
    base = dict(kv_budget=0.5, given_ranks=False, layout="per-head", selection="attention")
    assert default_allocation(**base, factorization="attention") == "greedy"
    assert default_allocation(**{**base, "given_ranks": True}, factorization="attention") == "uniform"
    assert default_allocation(**{**base, "kv_budget": None}, factorization="attention") == "uniform"
    assert default_allocation(**{**base, "layout": "deepseek"}, factorization="attention") == "uniform"
    assert default_allocation(**base, factorization="activation") == "uniform"


def test_greedy_refuses_deepseek_layout_and_other_options(tiny_root):  # noqa: F811
    src = tiny_root / "llama"
    with pytest.raises(ValueError, match="--allocation uniform"):
        mla.plan_conversion(src, MLASpec(kv_budget=0.5, allocation="greedy", layout="deepseek"))
    with pytest.raises(ValueError, match="--allocation uniform"):
        mla.plan_conversion(src, MLASpec(kv_budget=0.5, allocation="greedy", factorization="activation"))
    with pytest.raises(ValueError, match="Unknown --allocation"):
        mla.plan_conversion(src, MLASpec(kv_budget=0.5, allocation="best"))


def test_export_refuses_ragged_ranks():
    from hf_attn.conversion.export.plan import plan_export

    cfg = LlamaMLAConfig(
        **TINY, rope_layout="shared", latent_norm=True, layer_kv_lora_ranks=[12, 5], layer_rope_pairs=[2, 1]
    )
    with pytest.raises(ValueError, match="per-layer ranks.*--allocation uniform"):
        plan_export(config=cfg)
