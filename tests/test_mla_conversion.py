"""MHA/GQA -> MLA conversion (conversion.mla): exactness at full rank (every RoPE pair: the source's logits;
partial RoPE: a partial-RoPE source computed here by patching the source's rotary function), the 2norm choice
against a computation written here, the factorizations' optimality identities, budgets, the saved checkpoint
(record, side files, remote code), safety and the errors users see."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_SHAPE, exit_status
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import rotate_half

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.calibration import calibration_ids
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.mla import factorization as fac
from hf_attn.conversion.mla import plan as mla_plan
from hf_attn.conversion.mla import rope_selection as rs
from hf_attn.conversion.specs import DEFAULT_KV_BUDGET, CalibrationSpec, ExpandSpec, MLASpec, WriteSpec
from hf_attn.tooling.files import checkpoint_hash, sha256_file

TOL = 1e-4  # max |diff| relative to max |logit|, fp32
VOCAB = 49152  # SmolLM2's tokenizer, copied into the tiny checkpoints so that calibration can run
TINY = dict(
    vocab_size=VOCAB,
    **TINY_SHAPE,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
SOURCES = {
    "llama": dict(kind="llama"),
    "llama_bias": dict(kind="llama", attention_bias=True),
    "mistral_window": dict(kind="mistral", sliding_window=5),
    "qwen2": dict(kind="qwen2"),
}
CALIBRATION_TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of boiled "
    "cabbage and old rag mats. At one end of it a coloured poster, too large for indoor display, had been "
    "tacked to the wall. " * 40
)


# ------------------------------------------------------------------------------------------------ helpers


def make_tiny(path: Path, kind: str = "llama", *, tokenizer_from: Path | None = None, **overrides) -> Path:
    """A tiny random Llama-family checkpoint with weights large enough for peaked attention and non-zero
    biases; with `tokenizer_from`, that tokenizer's files too (for calibration)."""
    config = CONFIGS[kind](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(path)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    return path


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def ids_batch(T: int = 16, B: int = 2, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3g} > {tol} * max |logit| {scale:.3g}"


def dir_hashes(path: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.is_file()}


def patch_partial_rope(monkeypatch, model, pairs: list[list[list[int]]]) -> None:
    """Make the source `model` rotate, in each layer and KV head, only the kept pairs (its own row layout,
    no permutation): query head h uses KV head h // G's pairs; every other pair is left un-rotated."""
    cfg = model.config
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    group = cfg.num_attention_heads // hkv
    masks = []
    for layer_pairs in pairs:
        keep = torch.zeros(hkv, d, dtype=torch.bool)  # (Hkv, d)
        for g, kept in enumerate(layer_pairs):
            keep[g, kept] = True
            keep[g, [p + d // 2 for p in kept]] = True
        masks.append(keep)
    state = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda module, args, i=i: state.update(layer=i))

    def rotary(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # (B, 1, T, d)
        keep = masks[state["layer"]]  # (Hkv, d)

        def rotate(x, heads_keep):  # x (B, H, T, d)
            m = heads_keep[None, :, None, :]  # (1, H, 1, d)
            return torch.where(m, x * cos + rotate_half(x) * sin, x)

        return rotate(q, keep.repeat_interleave(group, 0)), rotate(k, keep)

    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", rotary)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory, smollm2_path) -> Path:
    root = tmp_path_factory.mktemp("mla_tiny")
    for name, spec in SOURCES.items():
        spec = dict(spec)
        make_tiny(root / name, spec.pop("kind"), tokenizer_from=smollm2_path, **spec)
    (root / "calib.txt").write_text(CALIBRATION_TEXT)
    return root


# ------------------------------------------------------------------------------------ exactness: full RoPE


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_pair_full_rank_reproduces_tiny_sources(tiny_root, tmp_path, name):
    src = tiny_root / name
    before = dir_hashes(src)
    out = mla.convert_to_mla(MLASpec(kv_budget=1.0), src=src, dst=tmp_path / "mla")
    assert dir_hashes(src) == before
    converted = load(out)
    assert type(converted).__name__ == "LlamaMLAForCausalLM"
    cfg = converted.config
    assert cfg.rope_pairs == 4 and cfg.kv_lora_rank == 2 * 8  # Hkv * d: values only, no nope part
    assert cfg.kv_cache_numbers_per_token() == 2 * 2 * 8  # the source's 2 Hkv d: full rank saves nothing
    ids = ids_batch(T=24)  # > sliding_window: the Mistral window matters
    assert_close_logits(logits_of(converted, ids), logits_of(load(src), ids))


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    ids = ids_batch(T=40, B=1, seed=3)
    return ids, logits_of(load(smollm2_path), ids)


def test_every_pair_full_rank_reproduces_smollm2_gqa(smollm2_path, smollm2_reference, tmp_path):
    ids, ref = smollm2_reference
    before = checkpoint_hash(smollm2_path)
    out = mla.convert_to_mla(MLASpec(kv_budget=1.0), src=smollm2_path, dst=tmp_path / "mla")
    assert checkpoint_hash(smollm2_path) == before
    assert_close_logits(logits_of(load(out), ids), ref)


def test_every_pair_full_rank_reproduces_smollm2_mha(smollm2_path, smollm2_reference, tmp_path):
    from hf_attn.conversion.gqa.expand import expand_checkpoint

    ids, ref = smollm2_reference
    mha = expand_checkpoint(ExpandSpec(num_kv_heads=9), src=smollm2_path, dst=tmp_path / "mha")
    out = mla.convert_to_mla(MLASpec(kv_budget=1.0), src=mha, dst=tmp_path / "mla")
    converted = load(out)
    assert converted.config.num_key_value_heads == 9 and converted.config.kv_lora_rank == 9 * 64
    assert_close_logits(logits_of(converted, ids), ref)


# ----------------------------------------------------------------------------- exactness: partial RoPE


@pytest.mark.parametrize(
    "name,selection,r",
    [
        ("llama_bias", "2norm", 2),
        ("qwen2", "uniform", 2),
        ("mistral_window", "2norm", 1),
        ("llama", "high", 0),
    ],
)
def test_partial_rope_full_rank_matches_partial_rope_source(
    monkeypatch, tiny_root, tmp_path, name, selection, r
):
    src = tiny_root / name
    out = mla.convert_to_mla(
        MLASpec(rope_pairs=r, rope_selection=selection),
        src=src,
        dst=tmp_path / "mla",
        calibration=CalibrationSpec(text=[tiny_root / "calib.txt"], tokens=256),
    )
    converted = load(out)
    cfg = converted.config
    assert cfg.kv_lora_rank == 2 * (8 - 2 * r) + 2 * 8  # full rank by default
    pairs = [cfg.pair_indices(i) for i in range(cfg.num_hidden_layers)]
    ids = ids_batch(T=24)
    source = load(src)
    full_rope = logits_of(source, ids)
    patch_partial_rope(monkeypatch, source, pairs)
    ref = logits_of(source, ids)
    assert (ref - full_rope).abs().max() > 1e-2 * ref.abs().max()  # the reference really drops RoPE
    assert_close_logits(logits_of(converted, ids), ref)


def test_2norm_keeps_pairs_of_largest_mean_norm_product(tiny_root, tmp_path, smollm2_path):
    src = tiny_root / "qwen2"
    files, tokens = [tiny_root / "calib.txt"], 300
    out = mla.convert_to_mla(
        MLASpec(rope_pairs=2, rope_selection="2norm"),
        src=src,
        dst=tmp_path / "mla",
        calibration=CalibrationSpec(text=files, tokens=tokens),
    )
    got = json.loads((out / "config.json").read_text())["rope_pair_indices"]
    # independent: hook the source's attention inputs over the same 1024-token windows
    from transformers import AutoTokenizer

    ids = calibration_ids(AutoTokenizer.from_pretrained(src), files, tokens)
    model = load(src)
    cfg = model.config
    d, hkv, hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    inputs = {}

    def keep(module, args, kwargs, i):
        inputs[i] = kwargs["hidden_states"][0]  # (T, C)

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: keep(m, a, kw, i), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids[None])
    for i, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, inputs[i]
        q = attn.q_proj(x).view(-1, hq, 2, d // 2).norm(dim=2).mean(0)  # (Hq, d/2)
        k = attn.k_proj(x).view(-1, hkv, 2, d // 2).norm(dim=2).mean(0)  # (Hkv, d/2)
        score = q.view(hkv, hq // hkv, -1).mean(1) * k  # (Hkv, d/2)
        want = [sorted(row.topk(2).indices.tolist()) for row in score]
        assert got[i] == want, (i, got[i], want, score)


# ------------------------------------------------------------------------------------------ factorizations


def _data(n=400, c=12, w=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) @ torch.randn(
        c, c, generator=g, dtype=torch.float64
    )
    x = x + 0.5  # a non-zero mean, as real hidden states have
    weight = torch.randn(w, c, generator=g, dtype=torch.float64)
    weight[:4] *= 5.0  # the "keys" (first 4 rows) dominate unless balanced
    moment = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    return x, weight, moment.T @ moment


def test_full_rank_factorization_is_exact():
    _, weight, _ = _data()
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    low = fac.full_rank(weight, bias)
    assert torch.equal(low.reconstruct(), weight) and torch.equal(low.up_bias, bias)


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_weight_svd_error_is_the_discarded_spectrum(rank):
    _, weight, _ = _data()
    low = fac.weight_svd(weight, None, rank)
    s = torch.linalg.svdvals(weight)
    assert torch.allclose((weight - low.reconstruct()).pow(2).sum(), s[rank:].pow(2).sum())


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_activation_pca_is_optimal_for_the_balanced_activations(rank):
    x, weight, moment = _data()
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    low = fac.activation_pca(weight, bias, rank, moment=moment, num_key_rows=4)
    z = x @ weight.T  # (N, W) activations without bias
    # balanced: the scaled keys and values have equal total power
    keys, values = z[:, :4], z[:, 4:]
    sk = (values.pow(2).sum() / keys.pow(2).sum()).sqrt().sqrt()
    scale = torch.cat([torch.full((4,), sk), torch.full((6,), 1 / sk)]).double()
    assert torch.allclose((keys * sk).pow(2).sum(), (values / sk).pow(2).sum())
    # error of the reconstruction (with the exact bias) == discarded spectrum of the scaled data
    y, y_hat = z + bias, x @ low.reconstruct().T + low.up_bias
    err = ((y - y_hat) * scale).pow(2).sum()
    s = torch.linalg.svdvals(z * scale)
    assert torch.allclose(err, s[rank:].pow(2).sum(), rtol=1e-6)
    # and it beats the weight SVD of the same rank on that objective
    svd = fac.weight_svd(weight, bias, rank)
    err_svd = ((y - x @ svd.reconstruct().T - svd.up_bias) * scale).pow(2).sum()
    assert err <= err_svd * (1 + 1e-9)


# ------------------------------------------------------------------------------------------ budgets, record


SMOL = AttentionGeometry(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.3, 0.5, 0.75, 1.0])
def test_budget_fills_the_cache_fraction(budget):
    shape = mla.plan_shape(SMOL, kv_budget=budget)
    numbers = int(budget * 384 + 1e-9)
    assert shape.cache_numbers == min(numbers, 384) and shape.kv_fraction <= budget + 1e-12
    assert shape.kv_lora_rank == shape.cache_numbers - 3 * 2 * shape.rope_pairs >= 1
    fixed = mla.plan_shape(SMOL, kv_budget=budget, rope_pairs=4)
    assert fixed.rope_pairs == 4 and fixed.cache_numbers == min(numbers, 384)


def test_default_rope_pairs_per_budget():
    # SmolLM2: 384 numbers per token and layer, 6 per RoPE pair (3 KV heads x 2). Half the budget to RoPE
    # keys, rounded to whole pairs, with the default selection at most 12 of the 32 pairs; the whole cache
    # keeps every pair (exact).
    expected = {0.125: 4, 0.25: 8, 0.3: 10, 0.375: 12, 0.5: 12, 0.75: 12, 1.0: 32}
    assert {b: mla.default_rope_pairs(SMOL, b) for b in expected} == expected
    assert mla.default_rope_pairs(SMOL, 0.5, share=0.5) == 16  # an explicit share is not capped
    # Only the `attention` selection is capped; the others keep the even split.
    assert mla.default_rope_pairs(SMOL, 0.5, selection="2norm") == 16
    assert mla.plan_shape(SMOL, kv_budget=0.75, rope_selection="high").rope_pairs == 24
    assert mla.plan_shape(SMOL, kv_budget=0.75).rope_pairs == 12
    assert mla.default_rope_pairs(SMOL, None) == 32
    assert mla.plan_shape(SMOL, kv_budget=1.0).is_full_rank


@pytest.mark.parametrize("factorization", ["activation", "weight-svd"])
def test_low_rank_conversion_record_cache_and_side_files(tiny_root, tmp_path, factorization):
    src = tiny_root / "llama_bias"
    before = dir_hashes(src)
    out = mla.convert_to_mla(
        MLASpec(kv_budget=0.5, rope_pairs=1, rope_selection="uniform", factorization=factorization),
        src=src,
        dst=tmp_path / "mla",
        calibration=CalibrationSpec(text=[tiny_root / "calib.txt"], tokens=200),
    )
    assert dir_hashes(src) == before
    config = json.loads((out / "config.json").read_text())
    record = config["hf_attn"]["history"][-1]
    assert "last" not in config["hf_attn"]  # each record once, in history
    assert record["kind"] == "mla" and record["settings"]["factorization"] == factorization
    assert record["rope_pairs"] == 1 and record["settings"]["rope_selection"] == "uniform"
    assert record["kv_lora_rank"] == config["kv_lora_rank"] == 16 - 2 * 2 == 12
    assert record["source_hash"] == checkpoint_hash(src)
    if factorization == "activation":
        calib = record["calibration"]
        assert calib["files"] == [{"name": "calib.txt", "sha256": sha256_file(tiny_root / "calib.txt")}]
        assert calib["tokens"] == 200
    else:
        assert record["calibration"] is None  # uniform + weight SVD need no calibration
    assert config["auto_map"] == {
        "AutoConfig": "configuration_llama_mla.LlamaMLAConfig",
        "AutoModelForCausalLM": "modeling_llama_mla.LlamaMLAForCausalLM",
    }
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert sha256_file(out / name) == sha256_file(src / name)
    assert (out / "modeling_llama_mla.py").exists() and (out / "configuration_llama_mla.py").exists()
    # a real cache holds d_c + Hkv*2r numbers per token and layer: half the source's 2*Hkv*d = 32
    from transformers import DynamicCache

    model = load(out)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids_batch(T=10, B=1), past_key_values=cache, use_cache=True).logits
    assert torch.isfinite(logits).all()
    numbers = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values)) / 10
    assert numbers == 2 * (12 + 2 * 2 * 1) == 2 * 16


def test_output_loads_with_remote_code_without_hf_attn(tiny_root, tmp_path):
    out = mla.convert_to_mla(
        MLASpec(kv_lora_rank=10, rope_pairs=2, rope_selection="high", factorization="weight-svd"),
        src=tiny_root / "qwen2",
        dst=tmp_path / "mla",
    )
    ids = ids_batch(T=12, B=1)
    expected = logits_of(load(out), ids)
    torch.save(ids, tmp_path / "ids.pt")
    child = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "assert not any(n == 'hf_attn' or n.startswith('hf_attn.') for n in sys.modules)\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(input_ids=ids).logits, {str(tmp_path / 'got.pt')!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_close_logits(torch.load(tmp_path / "got.pt"), expected)


def test_failure_leaves_no_output(tiny_root, tmp_path, monkeypatch):
    def boom(device, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(mla_plan, "convert_layer_on", boom)  # where the planned conversion calls it
    with pytest.raises(RuntimeError, match="disk full"):
        mla.convert_to_mla(MLASpec(kv_budget=1.0), src=tiny_root / "llama", dst=tmp_path / "mla")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kv_lora_rank=2 * 4 + 16 + 1, rope_pairs=2), r"kv-lora-rank must be in \[1, 24\]"),
        (dict(kv_lora_rank=0), r"kv-lora-rank must be in \[1, 16\]"),
        (dict(rope_pairs=5), r"rope-pairs must be an integer in \[0, head_dim / 2 = 4\]"),
        (dict(kv_lora_rank=8, kv_budget=0.5), "either --kv-lora-rank or --kv-budget"),
        (dict(kv_budget=0.1, rope_pairs=1), r"allows 3 numbers .* lower --rope-pairs \(at most 0\)"),
        (dict(kv_budget=1.5), r"kv-budget must be a fraction in \(0, 1\]"),
        (dict(rope_selection="lowest"), "Unknown --rope-selection 'lowest'"),
        (dict(factorization="svd"), "Unknown --factorization 'svd'"),
    ],
)
def test_bad_options_raise(tiny_root, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mla.convert_to_mla(MLASpec(**kwargs), src=tiny_root / "llama", dst=tmp_path / "mla")
    assert not (tmp_path / "mla").exists()


def _edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(model_type="gpt2"), "Unsupported model_type 'gpt2'"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_unsupported_sources_raise(tiny_root, tmp_path, changes, match):
    src = _edited_copy(tiny_root / "llama", tmp_path / "src", **changes)
    with pytest.raises(ValueError, match=match):
        mla.convert_to_mla(MLASpec(kv_budget=1.0), src=src, dst=tmp_path / "mla")


def test_output_safety(tiny_root, tmp_path):
    src = tiny_root / "llama"
    with pytest.raises(ValueError, match="is the source checkpoint"):
        mla.convert_to_mla(MLASpec(kv_budget=1.0), src=src, dst=src, write=WriteSpec(overwrite=True))
    (tmp_path / "mla").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        mla.convert_to_mla(MLASpec(kv_budget=1.0), src=src, dst=tmp_path / "mla")
    assert (
        mla.convert_to_mla(
            MLASpec(kv_budget=1.0), src=src, dst=tmp_path / "mla", write=WriteSpec(overwrite=True)
        )
        .joinpath("config.json")
        .exists()
    )


def test_cli_one_line_errors(tiny_root, tmp_path, capsys):
    argv = ["--model", str(tiny_root / "llama"), "--output", str(tmp_path / "o"), "--rope-pairs", "9"]
    assert exit_status(convert_cli.mla_main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rope-pairs" in err and "Traceback" not in err
    assert (
        convert_cli.mla_main([*argv[:3], str(tmp_path / "ok"), "--rope-pairs", "4", "--refine-steps", "0"])
        == 0
    )
    assert (tmp_path / "ok" / "model.safetensors").exists()


def test_cli_default_is_half_the_cache(tiny_root, tmp_path):
    calib = [
        "--calibration-text",
        str(tiny_root / "calib.txt"),
        "--calibration-tokens",
        "64",
        "--refine-steps",
        "0",
    ]
    assert (
        convert_cli.mla_main(["--model", str(tiny_root / "llama"), "--output", str(tmp_path / "o"), *calib])
        == 0
    )
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    numbers = cfg["kv_lora_rank"] + cfg["num_key_value_heads"] * 2 * cfg["rope_pairs"]
    assert numbers == 2 * 2 * 8 // 2  # half of the source's 2 Hkv d
    assert cfg["hf_attn"]["history"][-1]["settings"]["kv_budget"] == DEFAULT_KV_BUDGET == 0.5


# ------------------------------------------------------------------------------ attention-aware selection


def _brute_force_pair_stats(q, k, cos, sin, group, stride=1, window=None):
    """Per (query head, pair): Var_p(y), Cov_p(f, y), Cov_p(f) summed over queries, by explicit loops over
    keys (y: rotated score term, f = (q.k, q.Jk) un-rotated), p the causal softmax of the full scores."""
    T, hq, d = q.shape
    half = d // 2

    def rope(v):  # (T, H, d)
        c, s = cos[:, None], sin[:, None]
        return v * c + torch.cat((-v[..., half:], v[..., :half]), -1) * s

    qr, kr = rope(q), rope(k)
    out = torch.zeros(hq, half, 6, dtype=torch.float64)  # vy, v11, v12, v22, v1y, v2y
    for h in range(hq):
        g = h // group
        for t in range(0, T, stride):
            keys = [s for s in range(t + 1) if window is None or t - s < window]
            logits = torch.stack([qr[t, h] @ kr[s, g] for s in keys]) / d**0.5
            p = logits.softmax(0)
            for i in range(half):
                qi, qri = q[t, h, [i, i + half]], qr[t, h, [i, i + half]]
                f1 = torch.stack([qi @ k[s, g, [i, i + half]] for s in keys])
                f2 = torch.stack([qi[0] * k[s, g, i + half] - qi[1] * k[s, g, i] for s in keys])
                y = torch.stack([qri @ kr[s, g, [i, i + half]] for s in keys])

                def cov(a, b, p=p):
                    return (p * a * b).sum() - (p * a).sum() * (p * b).sum()

                out[h, i] += torch.stack(
                    [cov(y, y), cov(f1, f1), cov(f1, f2), cov(f2, f2), cov(f1, y), cov(f2, y)]
                )
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_attention_pair_stats_match_brute_force(window):
    from hf_attn.conversion.mla.rope_selection import AttentionPairStats

    g = torch.Generator().manual_seed(5)
    T, C, hq, hkv, d = 9, 10, 4, 2, 6
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    w_q, w_k = torch.randn(hq * d, C, generator=g).double(), torch.randn(hkv * d, C, generator=g).double()
    b_q, b_k = torch.randn(hq * d, generator=g).double(), torch.randn(hkv * d, generator=g).double()
    inv = 1.0 / (10.0 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.arange(T).double()[:, None] * inv  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, d)
    stats = AttentionPairStats(num_heads=hq, num_kv_heads=hkv, head_dim=d, query_stride=2)
    stats.add(0, x, cos, sin, w_q, b_q, w_k, b_k, window=window)
    q = (x @ w_q.T + b_q).view(T, hq, d)
    k = (x @ w_k.T + b_k).view(T, hkv, d)
    want = _brute_force_pair_stats(q, k, cos, sin, hq // hkv, stride=2, window=window)
    for j, name in enumerate(stats.NAMES):
        assert torch.allclose(stats.sums[0][name], want[..., j], rtol=1e-8, atol=1e-9), name
    # the fitted alpha solves the 2x2 normal equations; the costs follow
    drop, fitted, alpha = stats.costs(0)
    vy, v11, v12, v22, v1y, v2y = want.unbind(-1)
    assert torch.allclose(drop, vy - 2 * v1y + v11)
    a, b = alpha.real, alpha.imag
    assert torch.allclose(v11 * a + v12 * b, v1y) and torch.allclose(v12 * a + v22 * b, v2y)
    assert torch.allclose(fitted, vy - a * v1y - b * v2y) and (fitted <= drop + 1e-9).all()


def test_attention_selection_applies_its_query_fit(monkeypatch, tiny_root, tmp_path):
    """Full rank, r=2 of 4 pairs: the converted model equals the partial-RoPE source whose query rows of the
    dropped pairs are mixed by the fitted alpha (recomputed here by brute force on the same calibration)."""
    src = tiny_root / "llama_bias"
    files, tokens = [tiny_root / "calib.txt"], 64
    out = mla.convert_to_mla(
        MLASpec(rope_pairs=2, rope_selection="attention"),
        src=src,
        dst=tmp_path / "mla",
        calibration=CalibrationSpec(text=files, tokens=tokens),
    )
    record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["settings"]["rope_selection"] == "attention" and record["query_fit"] is True
    from transformers import AutoTokenizer

    ids = calibration_ids(AutoTokenizer.from_pretrained(src), files, tokens)
    source = load(src)
    cfg = source.config
    d, hkv, hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    half, group = d // 2, hq // hkv
    inputs = {}

    def keep(module, args, kwargs, i):
        inputs[i] = (kwargs["hidden_states"][0], *(t[0] for t in kwargs["position_embeddings"]))

    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: keep(m, a, kw, i), with_kwargs=True)
        for i, layer in enumerate(source.model.layers)
    ]
    with torch.no_grad():
        source(input_ids=ids[None])
    for h in hooks:
        h.remove()
    pairs, alphas = [], []
    for i, layer in enumerate(source.model.layers):
        attn = layer.self_attn
        x, cos, sin = (t.double() for t in inputs[i])
        q = (x @ attn.q_proj.weight.double().T + attn.q_proj.bias.double()).view(-1, hq, d)
        k = (x @ attn.k_proj.weight.double().T + attn.k_proj.bias.double()).view(-1, hkv, d)
        st = _brute_force_pair_stats(q, k, cos, sin, group, stride=rs.QUERY_STRIDE)
        vy, v11, v12, v22, v1y, v2y = st.unbind(-1)
        gram = torch.stack([torch.stack([v11, v12], -1), torch.stack([v12, v22], -1)], -2)
        ab = torch.linalg.solve(gram, torch.stack([v1y, v2y], -1))  # (Hq, d/2, 2)
        fitted = vy - (ab * torch.stack([v1y, v2y], -1)).sum(-1)  # (Hq, d/2)
        score = fitted.view(hkv, group, half).sum(1)
        pairs.append([sorted(row.topk(2).indices.tolist()) for row in score])
        alphas.append(ab)
    assert [
        converted for converted in json.loads((out / "config.json").read_text())["rope_pair_indices"]
    ] == pairs
    # reference: mix the source's query rows of dropped pairs by alpha, rotate only the kept pairs
    with torch.no_grad():
        for i, layer in enumerate(source.model.layers):
            for proj in (layer.self_attn.q_proj.weight, layer.self_attn.q_proj.bias):
                rows = proj.data.view(hq, 2, half, -1)
                for h in range(hq):
                    for p in range(half):
                        if p in pairs[i][h // group]:
                            continue
                        a, b = alphas[i][h, p].tolist()
                        r1, r2 = rows[h, 0, p].clone(), rows[h, 1, p].clone()
                        rows[h, 0, p], rows[h, 1, p] = a * r1 - b * r2, b * r1 + a * r2
    patch_partial_rope(monkeypatch, source, pairs)
    test_ids = ids_batch(T=20)
    assert_close_logits(logits_of(load(out), test_ids), logits_of(source, test_ids))


def _pca_problem(seed, *, n, c, hq, hkv, d, dn, biased, offset):
    """Random inputs x (n, C) and the keyword arguments of `fac.attention_pca` (without `rank`)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) + offset
    w_k, w_v = torch.randn(hkv * dn, c, generator=g).double(), torch.randn(hkv * d, c, generator=g).double()
    w_q, w_o = torch.randn(hq * dn, c, generator=g).double(), torch.randn(c, hq * d, generator=g).double()
    b_k = torch.randn(hkv * dn, generator=g).double() if biased else None
    b_v = torch.randn(hkv * d, generator=g).double() if biased else None
    xa = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    return x, dict(
        w_k=w_k, b_k=b_k, w_v=w_v, b_v=b_v, w_q=w_q, b_q=None, w_o=w_o, moment=xa.T @ xa, num_kv_heads=hkv
    )


@pytest.mark.parametrize("biased", [False, True])
def test_attention_pca_full_rank_is_exact_up_to_key_offsets(biased):
    """At full width the latent keeps everything: values exactly, keys up to a constant (which softmax
    ignores); the metric-weighted error can only grow as the rank drops."""
    n, c, hq, hkv, d, dn = 300, 16, 4, 2, 4, 2
    x, kw = _pca_problem(2, n=n, c=c, hq=hq, hkv=hkv, d=d, dn=dn, biased=biased, offset=0.7)
    w_k, w_v, b_k, b_v = kw["w_k"], kw["w_v"], kw["b_k"], kw["b_v"]
    full = fac.attention_pca(rank=hkv * (dn + d), **kw)
    y = x @ torch.cat([w_k, w_v]).T + (torch.cat([b_k, b_v]) if biased else 0)
    y_hat = x @ full.reconstruct().T + (full.up_bias if biased else 0)
    err = y - y_hat
    tol = 1e-6 * y.abs().max()
    assert err[:, hkv * dn :].abs().max() < tol  # values exact
    assert (err[:, : hkv * dn] - err[:1, : hkv * dn]).abs().max() < tol  # keys: up to a constant
    errors = []
    for rank in (8, 5, 2):
        low = fac.attention_pca(rank=rank, **kw)
        e = y - x @ low.reconstruct().T - (low.up_bias if biased else 0)
        errors.append((e[:, : hkv * dn].var(0).sum() + e[:, hkv * dn :].pow(2).mean(0).sum()).item())
    assert errors == sorted(errors)


@pytest.mark.parametrize("biased", [False, True])
def test_attention_pca_input_side_equals_the_square_metric(biased):
    """Where the stack is wider than the input (W > C + 1, a 7B MHA layer), the factorization works on the
    metric's (W, C + 1) factor: same subspace, so the same effective weights and spectrum as the (W, W)
    eigendecomposition."""
    c, hkv, d, dn = 8, 2, 6, 4  # W = 2 * 4 + 2 * 6 = 20 > C + 1 = 9
    _, kw = _pca_problem(5, n=400, c=c, hq=4, hkv=hkv, d=d, dn=dn, biased=biased, offset=0.3)
    for rank in (3, 6, 9):
        square, factor = (
            fac.attention_pca(rank=rank, input_side=False, **kw),
            fac.attention_pca(rank=rank, **kw),
        )
        scale = square.reconstruct().abs().max()
        assert (square.reconstruct() - factor.reconstruct()).abs().max() < 1e-9 * scale
        if biased:
            assert (square.up_bias - factor.up_bias).abs().max() < 1e-9 * square.up_bias.abs().max()
    kw.pop("b_k")
    square, factor = fac.attention_spectrum(input_side=False, **kw), fac.attention_spectrum(**kw)
    assert square.shape == factor.shape == (hkv * (dn + d),)
    assert (square - factor).abs().max() < 1e-9 * square[0]
    assert factor[c + 1 :].abs().max() == 0  # rank <= C + 1


def test_input_side_directions_complete_a_rank_deficient_metric():
    """Fewer calibration tokens than inputs (a 7B layer calibrated on 256 tokens): the metric has fewer
    nonzero eigenvalues than the rank asks for; the directions are orthonormal and contain its whole range."""
    c, hkv, d, dn = 8, 2, 6, 4
    _, kw = _pca_problem(
        7, n=5, c=c, hq=4, hkv=hkv, d=d, dn=dn, biased=False, offset=0.3
    )  # rank(moment) <= 5
    kw.pop("b_k")
    metric = fac._attention_metric(
        kw["w_k"], kw["w_v"], kw["w_q"], None, None, kw["w_o"], kw["moment"], kw["num_kv_heads"]
    )
    weighted = metric.weighted()  # (W, W), the square form, independently assembled
    u = metric.top_directions(12)  # more than the 5 nonzero directions
    assert torch.allclose(u.T @ u, torch.eye(12, dtype=u.dtype), atol=1e-10)
    assert torch.allclose(u @ (u.T @ weighted), weighted, atol=1e-9 * weighted.abs().max())


@pytest.mark.parametrize("biased", [False, True])
def test_attention_metric_is_the_weighted_moment_of_centred_keys_and_values(biased):
    """The metric A J A^T against its definition: J the sample second moment of z = [W_K (x - mean);
    W_V x (- W_V mean where the values carry a bias)] over the calibration samples, A recovered from the
    metric's A W by the pseudo-inverse of the stacked weights (full row rank: W = 12 < C = 20)."""
    n, c, hkv, d, dn = 200, 20, 2, 4, 2
    x, kw = _pca_problem(9, n=n, c=c, hq=4, hkv=hkv, d=d, dn=dn, biased=biased, offset=0.5)
    w_k, w_v = kw["w_k"], kw["w_v"]
    metric = fac._attention_metric(
        w_k, w_v, kw["w_q"], kw["b_q"], kw["b_v"], kw["w_o"], kw["moment"], num_kv_heads=hkv
    )
    mean = x.mean(0)  # (C,)
    z = torch.cat([(x - mean) @ w_k.T, (x - mean) @ w_v.T if biased else x @ w_v.T], 1)  # (n, W)
    j = z.T @ z / n  # (W, W)
    a = metric.aw @ torch.linalg.pinv(torch.cat([w_k, w_v]))  # (W, W): block-diagonal A
    want = a @ j @ a.T
    torch.testing.assert_close(metric.weighted(), want, rtol=1e-9, atol=1e-9 * want.abs().max().item())
