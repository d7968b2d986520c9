"""`conversion.refine`: the layer-local refit of a conversion to its source.

References independent of the code under test: the models' own forwards (hidden states of vanilla
transformers' Llama for the source), an exact conversion (the source itself) that must come back bit for bit,
and the DeepSeek export's vanilla-transformers exactness after refinement."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TINY_SHAPE, exit_status
from test_export import SRC_TINY, deepseek_layout_model, randomize_
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import export, pipeline, refine
from hf_attn.conversion.checkpoint.io import read_tensor, tensor_index
from hf_attn.conversion.checkpoint.layerwise import LayerwiseModel


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    return randomize_(LlamaForCausalLM(LlamaConfig(**{**SRC_TINY, **overrides})), seed)


def last_hidden_error(source, converted, ids) -> float:
    """Mean squared difference of the final (normed) hidden states, from each model's own forward."""
    with torch.no_grad():
        a = source(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        b = converted(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    return float((a - b).pow(2).mean())


def refine_saved(tmp_path, source, converted, windows, **options):
    """Save both models, refine layer by layer from the files; returns the fits, the models' streams (for
    their counters) and a copy of `converted` with the refitted layers put in by hand."""
    for name, model in (("source", source), ("converted", converted)):
        model.save_pretrained(tmp_path / name)
    streams = LayerwiseModel(tmp_path / "source"), LayerwiseModel(tmp_path / "converted")
    kept = {}
    fits = refine.refine_layers(
        source=streams[0],
        converted=streams[1],
        windows=windows,
        keep=kept.__setitem__,
        progress=False,
        **options,
    )
    refined = copy.deepcopy(converted)
    for i, tensors in kept.items():
        refined.model.layers[i].self_attn.load_state_dict(tensors)
    return fits, streams, refined


@pytest.mark.parametrize("rate", [{"lr": 3e-3}, {"relative_lr": 0.05}], ids=["absolute", "relative"])
def test_refinement_lowers_the_error_and_leaves_an_exact_conversion_alone(tmp_path, rate):
    source = tiny_llama(0)
    pooled = tiny_llama(0)
    with torch.no_grad():  # a lossy "conversion": mean-pool the two KV heads' weights into both (by hand)
        for layer in pooled.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(2, -1, proj.weight.shape[1])  # (Hkv, d, E)
                proj.weight.copy_(w.mean(0, keepdim=True).expand_as(w).reshape_as(proj.weight))
    windows = torch.randint(3, SRC_TINY["vocab_size"], (3, 24))
    before = last_hidden_error(source, pooled, windows)
    fits, streams, refined = refine_saved(tmp_path / "lossy", source, pooled, windows, steps=60, **rate)
    assert len(fits) == TINY_SHAPE["num_hidden_layers"] and all(f.kept for f in fits)
    assert all(f.error_after < f.error_before for f in fits)
    assert last_hidden_error(source, refined, windows) < 0.5 * before  # the refined model's own forward
    assert [s.max_layers_loaded for s in streams] == [1, 1], "one decoder layer of each model at a time"

    exact = tiny_llama(0)
    fits, _, refined = refine_saved(tmp_path / "exact", source, exact, windows, steps=5, **rate)
    assert not any(f.kept for f in fits)
    assert all(torch.equal(v, exact.state_dict()[k]) for k, v in refined.state_dict().items())


def test_the_auto_step_dtype_refines_as_the_dtype_this_cpu_computes_natively(tmp_path):
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN's own answer: bfloat16 kernels on this CPU
    named = "bfloat16" if native else "float32"
    source, pooled = tiny_llama(0), tiny_llama(1)
    windows = torch.randint(3, SRC_TINY["vocab_size"], (3, 24))
    refined = {
        dtype: refine_saved(tmp_path / dtype, source, pooled, windows, steps=3, lr=3e-3, step_dtype=dtype)[2]
        for dtype in ("auto", named, {"bfloat16": "float32", "float32": "bfloat16"}[named])
    }
    want, other = refined[named].state_dict(), list(refined.values())[-1].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in refined["auto"].state_dict().items())
    assert not all(torch.equal(v, want[k]) for k, v in other.items())  # (the dtype matters)


def test_refined_deepseek_layout_still_exports_exactly(tmp_path):
    model = deepseek_layout_model("llama", seed=3)
    windows = torch.randint(3, SRC_TINY["vocab_size"], (2, 16))
    fits, _, refined_model = refine_saved(tmp_path, tiny_llama(4), model, windows, steps=10, lr=3e-3)
    assert any(f.kept for f in fits)
    refined = tmp_path / "refined"
    refined_model.save_pretrained(refined)
    out = export.export_checkpoint(src=refined, dst=tmp_path / "export")
    vanilla = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(vanilla).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        want, got = refined_model(input_ids=windows).logits, vanilla(input_ids=windows).logits
    assert (want - got).abs().max() <= 1e-4 * want.abs().max()


@pytest.fixture
def converted_pair(tmp_path, smollm2_path):
    """A tiny Llama with SmolLM2's tokenizer (so the calibration text tokenizes) and its mean-pooled MQA."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    src = tmp_path / "src"
    tiny_llama(5, vocab_size=len(tokenizer)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    conv = tmp_path / "mqa"
    argv = ["--model", str(src), "--output", str(conv), "--num-kv-heads", "1", "--method", "mean"]
    assert exit_status(convert_cli.gqa_main, [*argv, "--refine-steps", "0"]) == 0
    return src, conv


def test_command_refines_against_the_recorded_source(converted_pair, tmp_path):
    src, conv = converted_pair
    before = {p.name: p.read_bytes() for p in conv.iterdir() if p.is_file()}
    out = tmp_path / "refined"
    argv = [
        "--model",
        str(conv),
        "--output",
        str(out),
        "--calibration-tokens",
        "64",
        "--steps",
        "8",
        "--calibration-corpus",
        "austen",
        "--no-progress",
    ]
    assert exit_status(refine.main, argv) == 0
    assert {p.name: p.read_bytes() for p in conv.iterdir() if p.is_file()} == before, "source modified"
    record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["kind"] == "refine" and record["reference"] == str(src.resolve())
    assert len(record["layers"]) == TINY_SHAPE["num_hidden_layers"]
    AutoModelForCausalLM.from_pretrained(out)  # loads in the converted checkpoint's format
    a, b = tensor_index(conv), tensor_index(out)
    assert set(a) == set(b)
    kept = {i for i, f in enumerate(record["layers"]) if f["kept"]}
    for name in a:
        same = torch.equal(read_tensor(a[name]), read_tensor(b[name]))
        refitted = ".self_attn." in name and int(name.split(".")[2]) in kept
        assert same != refitted or name.endswith("bias"), name  # a refitted layer's weights all moved


def test_refusals_exit_2_and_write_nothing(converted_pair, tmp_path, capsys):
    src, conv = converted_pair
    other = tmp_path / "deeper"
    tiny_llama(6, num_hidden_layers=3, vocab_size=49152).save_pretrained(other)
    out = tmp_path / "out"
    base = ["--model", str(conv), "--output", str(out), "--calibration-tokens", "64", "--no-progress"]
    assert exit_status(refine.main, [*base, "--source", str(other)]) == 2
    assert "is not the model" in capsys.readouterr().err  # the record names another source
    assert exit_status(refine.main, ["--model", str(src), "--output", str(out), "--no-progress"]) == 2
    assert "pass --source" in capsys.readouterr().err
    assert exit_status(refine.main, [*base, "--steps", "-1"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert exit_status(refine.main, [*base, "--relative-lr", "0"]) == 2
    assert "--relative-lr" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert exit_status(refine.main, [*base, "--device", "cuda"]) == 2
        assert "cuda" in capsys.readouterr().err
    assert not out.exists()


def test_convert_with_refine_steps_is_convert_then_refine(converted_pair, tmp_path, capsys):
    src, conv = converted_pair
    refined = tmp_path / "two-commands"
    options = ["--calibration-corpus", "austen"]
    argv = ["--model", str(conv), "--output", str(refined), "--calibration-tokens", "64", "--steps", "4"]
    assert exit_status(refine.main, [*argv, *options, "--no-progress"]) == 0
    one = tmp_path / "one" / "command"
    one.parent.mkdir()
    base = ["--model", str(src), "--output", str(one), "--num-kv-heads", "1", "--method", "mean", *options]
    assert exit_status(convert_cli.gqa_main, [*base, "--refine-steps", "-1"]) == 2
    assert "--refine-steps" in capsys.readouterr().err and not one.exists()
    assert exit_status(convert_cli.gqa_main, [*base, "--refine-steps", "4", "--refine-tokens", "64"]) == 0
    assert [p.name for p in one.parent.iterdir()] == ["command"], "scratch left beside the output"
    history = json.loads((one / "config.json").read_text())["hf_attn"]["history"]
    assert [r["kind"] for r in history] == ["gqa", "refine"]
    assert (
        history[0]["source"] == str(src) and history[1]["source"] == pipeline.CLOSED_FORM_SOURCE
    )  # not scratch
    refined_record = json.loads((refined / "config.json").read_text())["hf_attn"]["history"][-1]
    assert history[1]["source_hash"] == refined_record["source_hash"]  # the same closed form was refined
    a, b = tensor_index(refined), tensor_index(one)
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(read_tensor(a[name]), read_tensor(b[name])), name


def test_the_calibration_window_reaches_the_refinement(converted_pair, tmp_path):
    """`--calibration-window` sets the refinement's windows, alone (`hf-attn refine`) or after a conversion
    (`--refine-*`): 64 tokens in windows of 24 are two windows, 48 tokens, in both."""
    src, conv = converted_pair
    options = ["--calibration-corpus", "austen", "--calibration-window", "24"]
    alone, after = tmp_path / "alone", tmp_path / "after"
    argv = ["--model", str(conv), "--output", str(alone), "--calibration-tokens", "64", "--steps", "2"]
    assert exit_status(refine.main, [*argv, *options, "--no-progress"]) == 0
    base = ["--model", str(src), "--output", str(after), "--num-kv-heads", "1", "--method", "mean", *options]
    assert exit_status(convert_cli.gqa_main, [*base, "--refine-steps", "2", "--refine-tokens", "64"]) == 0
    for out in (alone, after):
        record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
        assert record["kind"] == "refine" and record["settings"]["calibration_window"] == 24
        assert (record["calibration"]["window"], record["calibration"]["tokens"]) == (24, 48)
    a, b = tensor_index(alone), tensor_index(after)
    for name in a:
        assert torch.equal(read_tensor(a[name]), read_tensor(b[name])), name


@pytest.mark.parametrize("kind", ["llama", "llama_mla deepseek layout", "qwen2 biases"])
@pytest.mark.parametrize("stride,visit", [(1, 0), (4, 0), (4, 1), (3, 5)])
def test_a_strided_step_is_the_layers_own_output_at_its_positions(kind, stride, visit):
    """A step's prediction on every `stride`-th position (the MLP on those alone, the attention for those
    queries alone) against the decoder layer's own forward at those positions; the offset advances with
    the visit."""
    from hf_attn.conversion.refine_fit import FitRule, _step_prediction

    models = {
        "llama": lambda: tiny_llama(7),
        "llama_mla deepseek layout": lambda: deepseek_layout_model("llama", seed=7),
        "qwen2 biases": lambda: deepseek_layout_model("qwen2", seed=8),
    }
    model = models[kind]().eval()
    layer, t = model.model.layers[0], 11
    x = torch.randn(1, t, SRC_TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    ids = torch.arange(t)[None]
    kwargs = dict(
        attention_mask=None,
        position_ids=ids,
        position_embeddings=model.model.rotary_emb(x, ids),
        use_cache=False,
    )
    with torch.no_grad():
        whole = layer(x, **kwargs)
        whole = whole[0] if isinstance(whole, tuple) else whole  # (1, T, E)
        got, positions = _step_prediction(layer, x, kwargs, FitRule(1, lr=1e-3, loss_stride=stride), visit)
    want = whole[:, visit % stride :: stride]
    assert got.shape == want.shape and torch.arange(t)[positions].tolist() == list(
        range(visit % stride, t, stride)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window,given", [(None, False), (9, False), (9, True)])
def test_a_strided_steps_gradient_is_the_layers_own(window, given):
    """The gradients of a strided step's loss (its queries in chunks, each over the keys up to its last
    query, or under the `given` mask; the query and output projections on its positions alone) with respect
    to the query, key and output projections equal those of the same loss on the decoder layer's own
    forward, with and without a sliding window: 37 positions, every 2nd, so the chunks are uneven."""
    from hf_attn.conversion.refine_fit import FitRule, _step_prediction

    model = tiny_llama(7).eval()
    model.config.sliding_window = window
    layer, t = model.model.layers[0], 37
    x = torch.randn(1, t, SRC_TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    ids = torch.arange(t)[None]
    keys = torch.arange(t)
    allowed = keys[None] <= keys[:, None]
    if window is not None:
        allowed &= keys[:, None] - keys[None] < window
    kwargs = dict(position_ids=ids, position_embeddings=model.model.rotary_emb(x, ids), use_cache=False)
    if window is not None:
        kwargs["sliding_window"] = window
    attn = layer.self_attn
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.o_proj.weight]  # query side, key side, output
    grads = []
    for strided in (True, False):
        for weight in weights:
            weight.grad = None
        if strided:
            y, positions = _step_prediction(
                layer,
                x,
                {**kwargs, "attention_mask": allowed[None, None] if given else None},
                FitRule(1, lr=1e-3, loss_stride=2),
                1,
            )
        else:  # the layer's own forward under an explicit boolean mask, then the same positions
            y = layer(x, attention_mask=allowed[None, None], **kwargs)
            y = (y[0] if isinstance(y, tuple) else y)[:, positions]
        y.pow(2).mean().backward()
        grads.append([weight.grad.clone() for weight in weights])
    for strided, whole in zip(*grads, strict=True):
        torch.testing.assert_close(strided, whole, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mask_kind", ["none", "boolean", "additive"])
def test_strided_attention_matches_sdpa_on_a_batch(mask_kind):
    """`strided_queries_attention` on a batch of 2 with grouped heads (4 query, 2 KV), at every 3rd query from
    the 2nd, against torch's `scaled_dot_product_attention` over every query with the K/V heads repeated:
    causal without a mask, else each sequence's own (random, diagonal kept) boolean or additive mask."""
    from hf_attn.conversion.refine_fit import strided_queries_attention

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, t, d = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h in (hq, hkv, hkv))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = (torch.rand(b, 1, t, t, generator=g) < 0.6) & causal | torch.eye(t, dtype=torch.bool)
    mask = {
        "none": None,
        "boolean": allowed,
        "additive": torch.zeros(b, 1, t, t).masked_fill(~allowed, float("-inf")),
    }[mask_kind]
    rows = slice(1, None, 3)
    got, _ = strided_queries_attention(None, q, k, v, mask, query_rows=rows)  # (B, T, Hq, D)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=causal if mask is None else allowed
    ).transpose(1, 2)  # (B, T, Hq, D)
    torch.testing.assert_close(got[:, rows], want[:, rows], rtol=1e-5, atol=1e-6)
    assert not got[:, 0].any() and not got[:, 2].any()  # the other positions stay zero


def test_the_keep_rule_reads_every_second_window_and_the_stream_every_window():
    """fit_layer's error before is the mean over windows 0 and 2 of |rms(y) - rms(t)|^2, y from the layer's
    own float32 forward (window 1 is left out: its target is garbage and changes nothing), and the stream it
    returns is the layer's own output on every window with the weights it keeps."""
    from hf_attn.conversion.refine_fit import FitRule, _rms, fit_layer

    model = tiny_llama(11).eval()
    layer, t = model.model.layers[0], 9
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(1, t, SRC_TINY["hidden_size"], generator=g) for _ in range(3)]
    ids = torch.arange(t)[None]
    rope = model.model.rotary_emb(inputs[0], ids)
    kwargs = dict(position_ids=ids, position_embeddings=rope, use_cache=False)
    targets = [_rms(torch.randn(1, t, SRC_TINY["hidden_size"], generator=g)) for _ in range(3)]
    layer.requires_grad_(False)

    def own(x):
        with torch.no_grad():
            y = layer(x, attention_mask=None, **kwargs)
        return y[0] if isinstance(y, tuple) else y

    want = sum(float((_rms(own(inputs[w])) - targets[w]).pow(2).mean()) for w in (0, 2)) / 2
    rule = FitRule(2, lr=1e-3, step_dtype="float32")
    fit, outputs = fit_layer(0, layer, inputs, [targets[0], targets[1] * 1e3, targets[2]], kwargs, rule)
    assert fit.error_before == pytest.approx(want, rel=1e-5)
    for x, y in zip(inputs, outputs, strict=True):
        torch.testing.assert_close(y, own(x), rtol=1e-5, atol=1e-6)
