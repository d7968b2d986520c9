"""`python -m benchmarks.scale`: vanilla transformers loads the synthetic checkpoint; a step gives a row."""

import json

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks import scale, synthetic


def _tiny(tmp_path, max_shard_bytes=200_000):
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession.\n" * 50)
    return synthetic.write_synthetic(
        tmp_path / "src",
        shape="tiny",
        max_shard_bytes=max_shard_bytes,
        tokenizer_files=[text],
        progress=False,
    )


def test_synthetic_checkpoint_loads_with_the_intended_config(tmp_path):
    src = _tiny(tmp_path)
    dims = synthetic.SHAPES["tiny"]
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # sharded, like the hub's
    stored, total = {}, 0
    for name in files:
        with safe_open(src / name, "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                t = f.get_tensor(key)
                stored[key] = t
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert {k: tuple(v.shape) for k, v in stored.items()} == dict(synthetic.tensor_shapes(dims))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())

    config = AutoConfig.from_pretrained(src)
    assert config.num_key_value_heads == dims["num_key_value_heads"] < config.num_attention_heads
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["rope_theta"] == dims["rope_theta"]
    assert not config.tie_word_embeddings

    model, info = AutoModelForCausalLM.from_pretrained(src, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.dtype == torch.bfloat16
    params = dict(model.named_parameters())
    assert torch.equal(params["lm_head.weight"], stored["lm_head.weight"])
    assert not torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])  # untied
    assert torch.equal(params["model.norm.weight"], torch.ones(dims["hidden_size"], dtype=torch.bfloat16))
    std = stored["model.layers.0.self_attn.q_proj.weight"].float().std().item()
    assert abs(std - synthetic.WEIGHT_STD) < 0.1 * synthetic.WEIGHT_STD

    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = tokenizer("a single man in possession of an unseen word", add_special_tokens=False)["input_ids"]
    assert len(ids) == 9 and max(ids) < dims["vocab_size"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 9, dims["vocab_size"]) and torch.isfinite(logits).all()


def test_runner_gives_a_row_for_mean_pooling(tmp_path):
    src = _tiny(tmp_path, max_shard_bytes=synthetic.HUB_SHARD_BYTES)
    dst = tmp_path / "out"
    row = scale.run_step(
        shape="tiny",
        converter="gqa mean 2->1",
        module="hf_attn.conversion.gqa",
        args=["--model", str(src), "--output", str(dst), "--num-kv-heads", "1", *scale.MEAN_POOLING],
        src=src,
        dst=dst,
        device="cpu",
        keep=False,
    )
    assert row.status == "ok", row.note
    assert not dst.exists()  # deleted right after measuring
    # the output: the source less half the K/V projection bytes (2 KV heads pooled into 1)
    dims = synthetic.SHAPES["tiny"]
    kv = (
        2
        * dims["num_hidden_layers"]
        * dims["num_key_value_heads"]
        * dims["head_dim"]
        * dims["hidden_size"]
        * 2
    )
    assert row.output_bytes - row.read_bytes < 0  # smaller
    assert abs((row.read_bytes - row.output_bytes) - kv // 2) < 4096  # headers differ by a few bytes
    assert row.peak_rss_bytes > 0 and row.wall_s > 0
    assert "| tiny | gqa mean 2->1 | cpu |" in scale.markdown([row], "")


def test_failed_step_is_a_row_not_a_crash(tmp_path):
    src = _tiny(tmp_path, max_shard_bytes=synthetic.HUB_SHARD_BYTES)
    row = scale.run_step(
        shape="tiny",
        converter="gqa mean 2->3",
        module="hf_attn.conversion.gqa",
        args=["--model", str(src), "--output", str(tmp_path / "out"), "--num-kv-heads", "3"],
        src=src,
        dst=tmp_path / "out",
        device="cpu",
        keep=False,
    )
    assert row.status == "failed (exit 2)" and "3" in row.note and not (tmp_path / "out").exists()


def test_a_converter_over_the_rss_limit_is_killed_and_said_so(tmp_path):
    src = _tiny(tmp_path, max_shard_bytes=synthetic.HUB_SHARD_BYTES)
    row = scale.run_step(
        shape="tiny",
        converter="gqa mean 2->1",
        module="hf_attn.conversion.gqa",
        args=["--model", str(src), "--output", str(tmp_path / "out"), "--num-kv-heads", "1"],
        src=src,
        dst=tmp_path / "out",
        device="cpu",
        keep=False,
        rss_limit=1,  # any running Python is above one byte
    )
    assert row.status.startswith("killed") and not (tmp_path / "out").exists()


def test_refine_rows_stream_the_pooled_model_against_its_source(tmp_path):
    src = _tiny(tmp_path, max_shard_bytes=synthetic.HUB_SHARD_BYTES)
    rows = scale.refine_rows("tiny", src=src, workdir=tmp_path, device="cpu", rss_limit=None)
    assert [r.status for r in rows] == ["ok", "ok"], [r.note for r in rows]
    assert rows[1].converter.startswith("refine") and rows[1].peak_rss_bytes > 0
    assert rows[1].output_bytes == rows[1].read_bytes  # same tensors, same dtypes: a refit, not a conversion
    assert not (tmp_path / "tiny-gqa-mean").exists() and not (tmp_path / "tiny-refined").exists()


def test_every_conversion_row_times_the_closed_form_it_names():
    from hf_attn.conversion import cli
    from hf_attn.conversion.specs import GQASpec, MLASpec

    specs = {"hf_attn.conversion.gqa": GQASpec, "hf_attn.conversion.mla": MLASpec}
    for shape in ("tiny", "llama-2-7b"):
        for label, module, args in scale.plan(shape, calibration=[], device_args=[]):
            if module not in specs:
                continue
            parser = cli.build_parser("x", "x", specs[module])
            parsed = cli.specs_from_args(specs[module], parser.parse_args(["--output", "o", *args]))
            assert parsed["refine"].steps == 0, label  # the commands' default refines: rows time closed forms
            if label.startswith("gqa"):
                assert parsed["spec"].method == label.split()[1], (
                    label
                )  # "gqa mean ..." is the paper's pooling
