"""MHA/GQA -> GQA/MQA pooling (conversion.gqa): mean pooling against a computation written here, identities,
the output loading in a process that never imports hf_attn with a KV cache G/H the size, calibrated pooling
beating mean pooling on held-out text of the real SmolLM2, safety (source untouched, atomic output) and the
errors users see."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calibration_reference import WholeModel, capture_attention_inputs
from conftest import exit_status
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import gqa
from hf_attn.conversion.gqa import convert as gqa_convert
from hf_attn.conversion.gqa.expand import expand_checkpoint
from hf_attn.conversion.specs import METHODS, CalibrationSpec, ExpandSpec, GQASpec, WriteSpec
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import checkpoint_hash, sha256_file

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=6,
    max_position_embeddings=128,
)
CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def make_tiny(path: Path, model_type: str = "llama", **overrides) -> Path:
    """A tiny random checkpoint (safetensors) of the given Llama-family type; Qwen2 has q/k/v biases."""
    torch.manual_seed(0)
    config = CONFIGS[model_type](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make the biases non-zero so pooling them is tested
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def file_hashes(path: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.is_file()}


def tiny_statistics(path: Path, model_type: str, *, tokens: int, window: int, seed: int):
    """(the eager tiny model, its AttentionGeometry, a 2-group pooling, `tokens` random ids, the pooling's
    AttentionStatistics per layer over them in windows of `window`)."""
    from hf_attn.conversion.checkpoint.io import AttentionGeometry

    model = AutoModelForCausalLM.from_pretrained(
        make_tiny(path, model_type), attn_implementation="eager"
    ).eval()
    geo = AttentionGeometry.from_config(model.config.to_dict())
    pooling = gqa.check_pooling(geo, 2)
    ids = torch.randint(0, 96, (tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        stats = gqa.collect_attention_statistics(
            WholeModel(model), ids, pooling=pooling, window=window, progress=False
        )
    return model, geo, pooling, ids, stats


def independent_mean(w: torch.Tensor, num_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Group g = mean of heads g*r ... (g+1)*r - 1, head by head in float64 (written without reshapes)."""
    r = num_heads // groups
    rows = []
    for g in range(groups):
        acc = torch.zeros_like(w[:head_dim], dtype=torch.float64)
        for h in range(g * r, (g + 1) * r):
            acc += w[h * head_dim : (h + 1) * head_dim].double()
        rows.append((acc / r).to(w.dtype))
    return torch.cat(rows)


# ----------------------------------------------------------------------------------------- mean pooling


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("groups", [2, 1])
def test_mean_pooling_matches_independent_computation(tmp_path, model_type, groups):
    src = make_tiny(tmp_path / "src", model_type)
    before = file_hashes(src)
    dst = gqa.convert_gqa(GQASpec(num_kv_heads=groups, method="mean"), src=src, dst=tmp_path / "dst")
    assert file_hashes(src) == before  # the source is never modified

    old, new = weights(src), weights(dst)
    assert set(old) == set(new)
    pooled = [n for n in old if ".k_proj." in n or ".v_proj." in n]
    assert len(pooled) == 2 * TINY["num_hidden_layers"] * (2 if model_type == "qwen2" else 1)
    for name in old:
        if name in pooled:
            want = independent_mean(old[name], TINY["num_key_value_heads"], groups, TINY["head_dim"])
            assert new[name].shape[0] == groups * TINY["head_dim"]
            assert torch.equal(new[name], want), name
        else:
            assert torch.equal(new[name], old[name]), name  # queries, outputs, MLP, norms untouched

    config = json.loads((dst / "config.json").read_text())
    assert config["num_key_value_heads"] == groups
    assert config["num_attention_heads"] == TINY["num_attention_heads"]
    record = config["hf_attn"]["history"][-1]
    assert record["settings"]["method"] == "mean" and record["source_hash"] == checkpoint_hash(src)
    assert record["kind"] == "gqa" and record["source"] == str(src.resolve())
    assert record["groups"] == [list(range(g * 4 // groups, (g + 1) * 4 // groups)) for g in range(groups)]
    assert config["hf_attn"]["history"] == [record]
    assert (dst / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert (dst / "tokenizer_config.json").exists()


def test_same_number_of_heads_is_the_identity(tmp_path):
    src = make_tiny(tmp_path / "src", "qwen2")
    for method in METHODS:
        dst = gqa.convert_gqa(GQASpec(num_kv_heads=4, method=method), src=src, dst=tmp_path / method)
        old, new = weights(src), weights(dst)
        assert set(old) == set(new) and all(torch.equal(old[n], new[n]) for n in old), method


def test_sharded_source_and_output(tmp_path):
    """A source saved in small shards (with an index) converts like the single-file one."""
    src = make_tiny(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = gqa.convert_gqa(GQASpec(num_kv_heads=2, method="mean"), src=src, dst=tmp_path / "a")
    b = gqa.convert_gqa(
        GQASpec(num_kv_heads=2, method="mean"),
        src=tmp_path / "sharded",
        dst=tmp_path / "b",
        write=WriteSpec(max_shard_bytes=30_000),
    )
    assert len(list(b.glob("model-*.safetensors"))) > 1 and (b / "model.safetensors.index.json").exists()
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb) and all(torch.equal(wa[n], wb[n]) for n in wa)


# ----------------------------------------------------------------------------------------- calibrated pooling


def test_attention_statistics_match_a_direct_computation(tmp_path):
    """AttentionStatistics against loops over eager attention probabilities (output_attentions=True)."""
    model, geo, pooling, ids, stats = tiny_statistics(tmp_path / "src", "llama", tokens=12, window=12, seed=1)
    with torch.inference_mode():
        probs = model(input_ids=ids[None], output_attentions=True).attentions  # per layer (1, Hq, T, T)
        inputs = capture_attention_inputs(model, ids, layers=[0, 1], window=12, progress=False)
    d, half, r = geo.head_dim, geo.head_dim // 2, pooling.heads_per_group
    for layer in (0, 1):
        att = model.model.layers[layer].self_attn
        x = inputs[layer][0].double()  # (T, C)
        q = x @ att.q_proj.weight.double().T  # (T, Hq*d), before RoPE
        k = x @ att.k_proj.weight.double().T  # (T, H*d)
        v = x @ att.v_proj.weight.double().T  # (T, H*d)
        p = probs[layer][0].double()  # (Hq, T, T)
        for g, heads in enumerate(pooling.groups):
            for j, h in enumerate(heads):
                for i in range(half):
                    s = torch.zeros(r, r, dtype=torch.complex128)
                    for t in range(12):
                        w = sum(
                            p[hq, s_, t] * (q[s_, hq * d + i] ** 2 + q[s_, hq * d + half + i] ** 2)
                            for hq in pooling.query_heads_of(h)
                            for s_ in range(12)
                        )
                        z = torch.complex(
                            k[t, [a * d + i for a in heads]], k[t, [a * d + half + i for a in heads]]
                        )
                        s += w * torch.outer(z, z.conj())
                    torch.testing.assert_close(stats[layer].keys[g, j, i], s, rtol=1e-4, atol=1e-6)
            vg = torch.cat([v[:, a * d : (a + 1) * d] for a in heads], dim=1)  # (T, r*d)
            for local, hq in enumerate(hp for a in heads for hp in pooling.query_heads_of(a)):
                y = p[hq] @ vg  # (T, r*d)
                torch.testing.assert_close(stats[layer].values[g, local], y.T @ y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_causal_probabilities_in_blocks_are_the_full_softmax(window):
    """The blocks of `_causal_probabilities` against one softmax over every key under an explicit causal (and
    sliding-window) mask, the K/V heads repeated: 13 queries (uneven blocks), 6 query heads on 2 key heads."""
    from hf_attn.conversion.gqa.pooling import _causal_probabilities

    g = torch.Generator().manual_seed(5)
    t, hq, h, d = 13, 6, 2, 4
    q, k = torch.randn(hq, t, d, generator=g), torch.randn(h, t, d, generator=g)
    rows, keys = torch.arange(t)[:, None], torch.arange(t)[None]
    allowed = keys <= rows if window is None else (keys <= rows) & (rows - keys < window)
    full = (q @ k.repeat_interleave(hq // h, 0).transpose(1, 2)).masked_fill(~allowed, float("-inf"))
    want = full.softmax(-1)  # (Hq, T, T)
    got = torch.zeros(hq, t, t)
    covered = []
    for (a, b), (lo, p) in _causal_probabilities(q, k, window):
        got[:, a:b, lo:b] = p
        covered += range(a, b)
    assert covered == list(range(t))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibrated_fit_on_gpu_matches_the_cpu_fit_on_gpu(tmp_path):
    """The fit a GPU conversion runs (`pool_layer_on` a CUDA device) against the float64 fit on the CPU."""
    from hf_attn.conversion.gqa import pooling as pool

    model, _, pooling, _, stats = tiny_statistics(tmp_path / "src", "qwen2", tokens=48, window=24, seed=2)
    att = model.model.layers[1].self_attn
    weights = {
        f"{p}.{k}": getattr(getattr(att, p), k)
        for p in ("q_proj", "k_proj", "v_proj")
        for k in ("weight", "bias")
    }
    weights = {k: v.detach().float() for k, v in weights.items()} | {
        "o_proj.weight": att.o_proj.weight.detach().float()
    }
    on_cpu = gqa.calibrated_pool_layer(weights=weights, stats=stats[1], pooling=pooling)
    on_gpu = pool.pool_layer_on(torch.device("cuda"), weights, stats[1], pooling)
    assert set(on_gpu) == set(on_cpu)
    for name, expected in on_cpu.items():
        assert on_gpu[name].device.type == "cpu"
        torch.testing.assert_close(on_gpu[name], expected, rtol=1e-4, atol=1e-5)


def test_calibrated_pooling_of_repeated_heads_is_exact(tmp_path, smollm2_path):
    """Expand 2 -> 8 KV heads (copies), then calibrated pooling back to 2: keys are rank one per rotary pair
    and values span d dimensions, so the fit is exact and the logits are the original ones."""
    src = make_tiny(
        tmp_path / "src", "qwen2", vocab_size=49152, num_key_value_heads=2, max_position_embeddings=256
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((smollm2_path / name).read_bytes())
    mha = expand_checkpoint(ExpandSpec(num_kv_heads=8), src=src, dst=tmp_path / "mha")
    back = gqa.convert_gqa(
        GQASpec(num_kv_heads=2, method="calibrated"),
        src=mha,
        dst=tmp_path / "back",
        calibration=CalibrationSpec(tokens=256, window=128),
    )
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for path in (src, back):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)
    record = json.loads((back / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["settings"]["method"] == "calibrated" and record["calibration"]["tokens"] == 256


# ----------------------------------------------------------------------------------------- loading


_VANILLA = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, DynamicCache

out = {}
for name, path in (("src", sys.argv[1]), ("dst", sys.argv[2])):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(20)[None] % 90, past_key_values=cache, use_cache=True).logits
    nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    out[name] = {"kv_bytes": nbytes, "finite": bool(torch.isfinite(logits).all()),
                 "kv_heads": model.config.num_key_value_heads}
assert not any(m == "hf_attn" or m.startswith("hf_attn.") for m in sys.modules), "hf_attn was imported"
print(json.dumps(out))
"""


def test_loads_without_hf_attn_and_kv_cache_shrinks(tmp_path):
    src = make_tiny(tmp_path / "src")
    dst = gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=tmp_path / "dst")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    res = subprocess.run(
        [sys.executable, "-c", _VANILLA, str(src), str(dst)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["src"]["finite"] and out["dst"]["finite"]
    assert out["dst"]["kv_heads"] == 1
    assert out["dst"]["kv_bytes"] * TINY["num_key_value_heads"] == out["src"]["kv_bytes"]  # G/H = 1/4


# ----------------------------------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
def test_smollm2_expand_then_mean_pool_returns_original_bits(tmp_path, smollm2_path):
    before = checkpoint_hash(smollm2_path)
    mha = expand_checkpoint(ExpandSpec(), src=smollm2_path, dst=tmp_path / "mha")
    back = gqa.convert_gqa(GQASpec(num_kv_heads=3, method="mean"), src=mha, dst=tmp_path / "back")
    assert checkpoint_hash(smollm2_path) == before
    old, new = weights(smollm2_path), weights(back)
    assert set(old) == set(new) and all(torch.equal(old[n], new[n]) for n in old)
    history = json.loads((back / "config.json").read_text())["hf_attn"]["history"]
    assert [h["kind"] for h in history] == ["expand", "gqa"]


@pytest.mark.slow
def test_smollm2_expand_then_calibrated_pool_returns_original_weights(tmp_path, smollm2_path):
    """9 KV heads that are copies of 3 pool back to those 3 with the calibrated method: the text never
    separates the copies, so every attention weight must be the original (not merely the same logits)."""
    mha = expand_checkpoint(ExpandSpec(num_kv_heads=9), src=smollm2_path, dst=tmp_path / "mha")
    back = gqa.convert_gqa(
        GQASpec(num_kv_heads=3, method="calibrated"),
        src=mha,
        dst=tmp_path / "back",
        calibration=CalibrationSpec(tokens=512, window=256, device="cpu"),
    )
    old, new = weights(smollm2_path), weights(back)
    assert set(old) == set(new)
    for name in old:
        want, got = old[name].double(), new[name].double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()), msg=name)


@pytest.mark.slow
def test_smollm2_calibrated_beats_mean_on_held_out_text(tmp_path, smollm2_path, persuasion_path):
    from hf_attn.eval.perplexity import evaluate_perplexity

    before = checkpoint_hash(smollm2_path)
    mean = gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=smollm2_path, dst=tmp_path / "mean")
    calibrated = gqa.convert_gqa(
        GQASpec(num_kv_heads=1, method="calibrated"),
        src=smollm2_path,
        dst=tmp_path / "cal",
        calibration=CalibrationSpec(tokens=1024, window=512),
    )
    assert checkpoint_hash(smollm2_path) == before
    record = json.loads((calibrated / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["calibration"]["tokens"] == 1024
    assert "persuasion.txt" not in [f["name"] for f in record["calibration"]["files"]]

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = persuasion_path.read_text()[:4000]  # held out: calibration never reads Persuasion
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:512])
    ppl = {}
    for name, path in (("mean", mean), ("calibrated", calibrated)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ppl[name] = evaluate_perplexity(model, ids, context_length=512, progress=False).perplexity
    assert ppl["calibrated"] < ppl["mean"] / 5, ppl


# ----------------------------------------------------------------------------------------- errors and safety


def _one_line_cli_error(capsys, argv) -> str:
    capsys.readouterr()  # drop what earlier steps printed
    assert exit_status(convert_cli.gqa_main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_errors_name_the_values(tmp_path, capsys):
    src = make_tiny(tmp_path / "src")
    out = str(tmp_path / "out")
    err = _one_line_cli_error(capsys, ["--model", str(src), "--num-kv-heads", "3", "--output", out])
    assert "4" in err and "3" in err and "from 1, 2, 4" in err
    err = _one_line_cli_error(capsys, ["--model", str(src), "--num-kv-heads", "8", "--output", out])
    assert "8" in err and "4" in err and "hf-attn convert expand" in err
    with pytest.raises(ValueError, match="--method"):
        gqa.convert_gqa(GQASpec(num_kv_heads=2, method="svd"), src=src, dst=out)
    assert not Path(out).exists()

    other = make_tiny(tmp_path / "gpt", "llama")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    err = _one_line_cli_error(capsys, ["--model", str(other), "--num-kv-heads", "2", "--output", out])
    assert "gpt2" in err and "llama, mistral, qwen2" in err

    err = _one_line_cli_error(
        capsys, ["--model", str(tmp_path / "nope"), "--num-kv-heads", "2", "--output", out]
    )
    assert "nope" in err


def test_missing_and_mismatched_weights(tmp_path):
    src = make_tiny(tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.v_proj.weight"]
    bad = make_tiny(tmp_path / "missing")
    save_file(missing, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"Missing weights.*layers\.1\.self_attn\.v_proj\.weight"):
        gqa.convert_gqa(GQASpec(num_kv_heads=2, method="mean"), src=bad, dst=tmp_path / "o1")

    wrong = make_tiny(tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \[24, 48\].*\[12, 48\]"):
        gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=wrong, dst=tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_existing_output_needs_overwrite_and_failures_leave_nothing(tmp_path, monkeypatch):
    src = make_tiny(tmp_path / "src")
    dst = tmp_path / "dst"
    gqa.convert_gqa(GQASpec(num_kv_heads=2, method="mean"), src=src, dst=dst)
    first = file_hashes(dst)
    with pytest.raises(FileExistsError, match="--overwrite"):
        gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=dst)
    assert file_hashes(dst) == first

    calls = []

    def failing(tensor, *, pooling):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return tensor[: pooling.num_groups * pooling.geometry.head_dim]

    monkeypatch.setattr(gqa_convert, "mean_pool_heads", failing)  # where the pooled write calls it
    with pytest.raises(RuntimeError, match="disk full"):
        gqa.convert_gqa(
            GQASpec(num_kv_heads=1, method="mean"), src=src, dst=dst, write=WriteSpec(overwrite=True)
        )
    assert file_hashes(dst) == first  # the old output survives a failed overwrite
    with pytest.raises(RuntimeError, match="disk full"):
        calls.clear()
        gqa.convert_gqa(GQASpec(num_kv_heads=1, method="mean"), src=src, dst=tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no partial output, no temp dir
    with pytest.raises(ValueError, match="source"):
        gqa.convert_gqa(
            GQASpec(num_kv_heads=1, method="mean"), src=src, dst=src, write=WriteSpec(overwrite=True)
        )


# ----------------------------------------------------------------------------------------- shared plumbing


def test_sharded_writer_round_trip(tmp_path):
    """Mixed dtypes, odd byte sizes, a scalar and an empty tensor survive sharding; aligned data offsets."""
    from hf_attn.conversion.checkpoint.io import iter_tensors, tensor_index
    from hf_attn.conversion.checkpoint.shards import ShardedWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(100, 30, generator=g),
        "odd_bf16": torch.randn(3, generator=g).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "b": torch.randn(50, 40, generator=g).to(torch.float16),
        "ids": torch.arange(7),
    }
    with ShardedWriter(tmp_path, max_shard_bytes=8_000) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = weights(tmp_path)
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    streamed = dict(iter_tensors(tmp_path))
    assert all(torch.equal(streamed[k], v) for k, v in tensors.items())
    for name, info in tensor_index(tmp_path).items():
        if (info.end - info.begin) % 8 == 0:
            assert info.begin % 8 == 0, name
    (tmp_path / "again").mkdir()
    writer = ShardedWriter(tmp_path / "again")
    writer.add("a", tensors["a"])
    with pytest.raises(ValueError, match="written twice"):
        writer.add("a", tensors["a"])


def test_records_side_files_and_model_resolution(tmp_path, smollm2_path):
    from hf_attn.conversion.checkpoint.io import add_record, check_supported, copy_side_files
    from hf_attn.tooling import assets
    from hf_attn.tooling.loading import resolve_model

    config = {"model_type": "llama", "hf_attn": {"history": [{"step": 1}], "last": {"step": 1}}}  # older form
    out = add_record(config, {"step": 2})
    assert out["hf_attn"]["history"] == [{"step": 1}, {"step": 2}] and out["hf_attn"]["history"][-1] == {
        "step": 2
    }
    assert config["hf_attn"]["history"] == [{"step": 1}]  # the input is not modified

    copied = copy_side_files(smollm2_path, tmp_path)
    assert {"tokenizer.json", "generation_config.json", "chat_template.jinja"} <= set(copied)
    assert not any(n.endswith(".safetensors") or n == "config.json" for n in copied)

    assert resolve_model(None) == assets.smollm2_dir()
    assert resolve_model(str(smollm2_path)) == smollm2_path.resolve()
    with pytest.raises(UserError, match="not a checkpoint directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(UserError, match="hub"):
        resolve_model("nobody-here/no-such-model-hf-attn")  # offline in tests, not cached

    base = {"model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 2, "hidden_size": 64}
    for bad, match in (
        ({"use_qk_norm": True}, "use_qk_norm"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ):
        with pytest.raises(ValueError, match=match):
            check_supported({**base, **bad})
    check_supported(base)


def test_dtype_option(tmp_path):
    src = make_tiny(tmp_path / "src", "qwen2")
    dst = gqa.convert_gqa(
        GQASpec(num_kv_heads=2, method="mean"),
        src=src,
        dst=tmp_path / "dst",
        write=WriteSpec(save_dtype="bfloat16"),
    )
    new = weights(dst)
    assert all(t.dtype == torch.bfloat16 for t in new.values())
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    want = independent_mean(weights(src)["model.layers.0.self_attn.k_proj.weight"], 4, 2, TINY["head_dim"])
    assert torch.equal(new["model.layers.0.self_attn.k_proj.weight"], want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="Unknown --save-dtype .int8."):
        gqa.convert_gqa(
            GQASpec(num_kv_heads=2, method="mean"),
            src=src,
            dst=tmp_path / "x",
            write=WriteSpec(save_dtype="int8"),
        )
