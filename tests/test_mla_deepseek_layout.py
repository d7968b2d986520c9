"""The DeepSeek layout of conversion.mla (--layout deepseek): the shared RoPE key's fit (exact identities on
synthetic keys, commuting with RoPE), the pair progression, the latent-norm refit (exact where rms(c) is
constant, least squares against numpy), and the converter end to end on tiny models: exactness where it must
be exact, the plumbing (CLI flag, refusals with exit 2) and healing on the layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from calibration_reference import capture_attention_inputs
from conftest import exit_status

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import mla
from hf_attn.conversion.mla import shared_rope as sr
from hf_attn.conversion.mla.layer import SpilledLayerStatistics
from hf_attn.conversion.mla.ranks import shared_rope_pairs
from hf_attn.conversion.specs import CalibrationSpec, MLASpec

# ------------------------------------------------------------------------------------------------ helpers


def _key_statistics(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """S[g, i, a, b] = sum_t w[g, t, i] z[t, a, i] conj(z[t, b, i]) by explicit loops (independent of
    SharedKeyStatistics' einsum). z (T, Hkv, P) complex, w (Hkv, T, P) >= 0."""
    T, hkv, p = z.shape
    s = torch.zeros(hkv, p, hkv, hkv, dtype=torch.complex128)
    for g in range(hkv):
        for i in range(p):
            for t in range(T):
                zt = z[t, :, i]
                s[g, i] += w[g, t, i] * torch.outer(zt, zt.conj())
    return s


def _rotate_pairs(rows: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate a rope-first vector (2r,) = [re (r) | im (r)] by per-pair angles (r,)."""
    r = rows.shape[0] // 2
    z = torch.complex(rows[:r], rows[r:]) * torch.exp(1j * angle)
    return torch.cat([z.real, z.imag])


# ------------------------------------------------------------------------------------------------ pairs


def test_progression_and_stride_choice():
    assert sr.progression_pairs(4, 3) == [0, 3, 6, 9]
    assert sr.max_stride(32, 12) == 2 and sr.max_stride(32, 16) == 2 and sr.max_stride(32, 11) == 3
    assert sr.max_stride(32, 1) == 1
    scores = torch.zeros(32, dtype=torch.float64)
    scores[[0, 3, 6, 9]] = 1.0  # only stride 3 keeps them all
    assert sr.choose_stride(scores, half=32, rope_pairs=4) == 3
    assert sr.choose_stride(None, half=32, rope_pairs=4) == 1
    assert sr.choose_stride(scores, half=32, rope_pairs=32) == 1
    for s in range(1, sr.max_stride(32, 12) + 1):  # every candidate stays inside the pairs
        assert max(sr.progression_pairs(12, s)) < 32


def test_default_rope_pairs_fit_the_budget():
    half, kv_dim = 32, 192  # SmolLM2: d/2 = 32, Hkv d = 192
    assert shared_rope_pairs(half, kv_dim, None) == half
    assert shared_rope_pairs(half, kv_dim, 1.0) == half
    for budget in (0.1, 0.25, 0.3, 0.5, 0.75):
        r = shared_rope_pairs(half, kv_dim, budget)
        numbers = int(budget * 2 * kv_dim)
        assert 1 <= r <= half // 2 and 2 * r < numbers


# ------------------------------------------------------------------------------------------------ shared key


@pytest.mark.parametrize("hkv", [1, 3])
def test_shared_key_is_exact_for_complex_multiples_and_commutes_with_rope(hkv):
    """Heads whose keys are, pair by pair, complex multiples of one key: the fit reproduces every score of
    every query head at any relative rotation (q and k rotated independently, as at two positions)."""
    g = torch.Generator().manual_seed(0)
    C, r, group, T = 10, 4, 2, 50
    hq = hkv * group
    base = torch.complex(torch.randn(r, C, generator=g), torch.randn(r, C, generator=g)).to(torch.complex128)
    mult = torch.complex(torch.randn(hkv, r, generator=g), torch.randn(hkv, r, generator=g)).to(
        torch.complex128
    )
    kc = mult[:, :, None] * base[None]  # (Hkv, r, C)
    k_rope = torch.cat([kc.real, kc.imag], 1)  # (Hkv, 2r, C) rope-first rows
    q_rope = torch.randn(hq, 2 * r, C, generator=g, dtype=torch.float64)
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    z = torch.einsum("gic,tc->tgi", kc, x.to(torch.complex128))  # (T, Hkv, r)
    w = torch.rand(hkv, T, r, generator=g, dtype=torch.float64) + 0.1
    key = sr.fit_shared_key(_key_statistics(z, w), list(range(r)))
    assert key.residual.abs().max() < 1e-10
    q_new, k_new = sr.share_rope_rows(q_rope=q_rope, k_rope=k_rope, key=key)
    assert q_new.shape == q_rope.shape and k_new.shape == (2 * r, C)
    for _ in range(5):
        xs, xt = x[torch.randint(T, (2,), generator=g)]
        a_q, a_k = torch.rand(r, generator=g, dtype=torch.float64) * 6, torch.rand(r, generator=g) * 6
        for h in range(hq):
            ref = _rotate_pairs(q_rope[h] @ xs, a_q) @ _rotate_pairs(k_rope[h // group] @ xt, a_k.double())
            got = _rotate_pairs(q_new[h] @ xs, a_q) @ _rotate_pairs(k_new @ xt, a_k.double())
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9), (h, float(got), float(ref))


def test_shared_key_fit_beats_mean_and_reports_its_residual():
    """Unrelated heads: the fitted key's weighted error is below the plain mean of the heads' keys (decoded
    with its own least-squares scales), and `residual` is that error computed from the keys directly."""
    g = torch.Generator().manual_seed(1)
    C, r, hkv, T = 8, 3, 3, 80
    kc = torch.complex(torch.randn(hkv, r, C, generator=g), torch.randn(hkv, r, C, generator=g)).to(
        torch.complex128
    )
    x = torch.randn(T, C, generator=g, dtype=torch.float64).to(torch.complex128)
    z = torch.einsum("gic,tc->tgi", kc, x)  # (T, Hkv, r)
    w = torch.rand(hkv, T, r, generator=g, dtype=torch.float64) + 0.1
    key = sr.fit_shared_key(_key_statistics(z, w), list(range(r)))
    shared = torch.einsum("ig,tgi->ti", key.coef, z)  # (T, r)
    err = sum((w[gg] * (z[:, gg] - key.scale[:, gg] * shared).abs() ** 2).sum(0) for gg in range(hkv))  # (r,)
    power = sum((w[gg] * z[:, gg].abs() ** 2).sum(0) for gg in range(hkv))
    assert torch.allclose(key.residual, err / power, rtol=1e-8)
    mean = z.mean(1)  # (T, r)
    mean_err = 0
    for gg in range(hkv):  # best scale per head for the mean key, by weighted least squares
        a = (w[gg] * mean.conj() * z[:, gg]).sum(0) / (w[gg] * mean.abs() ** 2).sum(0)
        mean_err = mean_err + (w[gg] * (z[:, gg] - a * mean).abs() ** 2).sum(0)
    assert (err <= mean_err * (1 + 1e-9)).all() and (err < mean_err).any()


def test_shared_key_statistics_match_loops():
    """SharedKeyStatistics on one window against probabilities and keys computed here in a loop."""
    g = torch.Generator().manual_seed(2)
    C, hq, hkv, d, T = 12, 4, 2, 8, 9
    half, group = d // 2, hq // hkv
    w_q, w_k = torch.randn(hq * d, C, generator=g), torch.randn(hkv * d, C, generator=g)
    x = torch.randn(T, C, generator=g)
    theta = 10000.0 ** (-torch.arange(half) / half)
    ang = torch.arange(T)[:, None] * theta[None]  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, d)
    stats = sr.SharedKeyStatistics(num_heads=hq, num_kv_heads=hkv, head_dim=d, query_stride=1)
    stats.add(0, x, cos, sin, w_q, None, w_k, None)
    q = (x.double() @ w_q.double().T).view(T, hq, d)
    k = (x.double() @ w_k.double().T).view(T, hkv, d)
    qc, kc = torch.complex(q[..., :half], q[..., half:]), torch.complex(k[..., :half], k[..., half:])
    rot = torch.exp(1j * ang.double())  # (T, d/2)
    w = torch.zeros(hkv, T, half, dtype=torch.float64)
    for h in range(hq):
        for s in range(T):
            scores = torch.stack(
                [(qc[s, h] * rot[s]).conj().mul(kc[t, h // group] * rot[t]).real.sum() for t in range(s + 1)]
            ) / math.sqrt(d)
            p = scores.softmax(0)
            for t in range(s + 1):
                w[h // group, t] += p[t] * qc[s, h].abs() ** 2
    ref = _key_statistics(kc, w)
    assert torch.allclose(stats.sums[0], ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


# ------------------------------------------------------------------------------------------------ latent norm


def test_latent_norm_is_exact_when_the_latent_rms_is_constant():
    """Inputs in the row space of `down` with a constant norm: rms(c) is the same for every token, so the
    refitted decoders reproduce keys (up to a common offset) and values exactly through a real RMSNorm."""
    g = torch.Generator().manual_seed(3)
    C, dc, nk, nv, N = 12, 6, 5, 7, 300
    basis, _ = torch.linalg.qr(torch.randn(C, dc, generator=g, dtype=torch.float64))  # (C, dc) orthonormal
    u = torch.randn(N, dc, generator=g, dtype=torch.float64)
    x = (u / u.norm(dim=1, keepdim=True) * 3.0) @ basis.T  # (N, C), norm 3 for every token
    down = torch.randn(dc, dc, generator=g, dtype=torch.float64)
    down, _ = torch.linalg.qr(down)
    down = down @ basis.T  # (dc, C): orthonormal rows in the inputs' span, so |down x| = |x|
    w_k = torch.randn(nk, dc, generator=g, dtype=torch.float64) @ basis.T
    w_v = torch.randn(nv, dc, generator=g, dtype=torch.float64) @ basis.T
    fit = sr.fit_latent_norm(down=down, w_k=w_k, b_k=None, w_v=w_v, b_v=None, samples=x, eps=1e-6)
    assert fit.key_error < 1e-12 and fit.value_error < 1e-12
    c = x @ fit.down.T
    cn = torch.nn.functional.rms_norm(c, (dc,), fit.gain, eps=1e-6)  # torch's RMSNorm, not ours
    keys, values = cn @ fit.up_k.T, cn @ fit.up_v.T
    ref_k = x @ w_k.T
    assert torch.allclose(keys - keys.mean(0), ref_k - ref_k.mean(0), atol=1e-9)
    assert torch.allclose(values, x @ w_v.T, atol=1e-9)


@pytest.mark.parametrize("biased", [False, True])
def test_latent_norm_decoders_are_numpy_least_squares(biased):
    g = torch.Generator().manual_seed(4)
    C, dc, nk, nv, N = 10, 4, 6, 5, 200
    x = torch.randn(N, C, generator=g, dtype=torch.float64) + 0.5
    down = torch.randn(dc, C, generator=g, dtype=torch.float64)
    w_k, w_v = torch.randn(nk, C, generator=g, dtype=torch.float64), torch.randn(nv, C, generator=g).double()
    b_k = torch.randn(nk, generator=g, dtype=torch.float64) if biased else None
    b_v = torch.randn(nv, generator=g, dtype=torch.float64) if biased else None
    fit = sr.fit_latent_norm(down=down, w_k=w_k, b_k=b_k, w_v=w_v, b_v=b_v, samples=x, eps=1e-5)
    cn = (torch.nn.functional.rms_norm(x @ fit.down.T, (dc,), fit.gain, eps=1e-5)).numpy()
    yv = (x @ w_v.T + (b_v if biased else 0)).numpy()
    design = np.concatenate([cn, np.ones((N, 1))], 1) if biased else cn
    ref, *_ = np.linalg.lstsq(design, yv, rcond=None)  # (dc [+1], nv)
    got = torch.cat([fit.up_v, fit.bias_v[:, None]], 1) if biased else fit.up_v
    np.testing.assert_allclose(got.numpy(), ref.T, rtol=1e-6, atol=1e-8)
    yk = (x @ w_k.T).numpy()
    ref_k, *_ = np.linalg.lstsq(cn - cn.mean(0), yk - yk.mean(0), rcond=None)
    np.testing.assert_allclose(fit.up_k.numpy(), ref_k.T, rtol=1e-6, atol=1e-8)
    if biased:  # the mean key reproduced too
        np.testing.assert_allclose(
            (cn @ fit.up_k.numpy().T + fit.bias_k.numpy()).mean(0), yk.mean(0) + b_k.numpy()
        )
    # the error it reports is the error of these decoders
    ev = ((yv - design @ ref) ** 2).sum() / (yv**2).sum()
    assert math.isclose(fit.value_error, ev, rel_tol=1e-6)


# ------------------------------------------------------------------------------------------------ converter

VOCAB = 49152  # SmolLM2's tokenizer, copied into the tiny checkpoints so that calibration can run
TEXT = (
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, never took "
    "up any book but the Baronetage; there he found occupation for an idle hour, and consolation in a "
    "distressed one. " * 30
)


def _tiny(
    path: Path,
    smollm2_path: Path,
    *,
    num_kv_heads: int,
    constant_rms: bool,
    hidden: int = 8,
    bias: bool = False,
) -> Path:
    """A tiny random Llama (head_dim 8, 4 query heads). constant_rms: every KV head identical and its value
    rows orthonormal (head_dim = hidden), input norms of gain 1: then |v(x)| = |x| = sqrt(C) (up to eps)
    for every token, so the DeepSeek layout's latent norm at full rank loses nothing."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=bias,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.5 * noise)
        if constant_rms:
            for layer in model.model.layers:
                att = layer.self_attn
                k_head, v_head = (
                    att.k_proj.weight[:8].clone(),
                    torch.linalg.qr(torch.randn(8, 8, generator=g))[0],
                )
                att.k_proj.weight.copy_(k_head.repeat(num_kv_heads, 1))
                att.v_proj.weight.copy_(v_head.repeat(num_kv_heads, 1))
                if bias:  # identical heads keep identical biases
                    att.k_proj.bias.copy_(att.k_proj.bias[:8].repeat(num_kv_heads))
                    att.v_proj.bias.copy_(att.v_proj.bias[:8].repeat(num_kv_heads))
                layer.input_layernorm.weight.fill_(1.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    (path.parent / "calibration.txt").write_text(TEXT)
    return path


def _convert(src: Path, dst: Path, **options) -> Path:
    calibration = CalibrationSpec(text=[src.parent / "calibration.txt"], tokens=256, window=64)
    spec = MLASpec(layout="deepseek", **options)
    return mla.convert_to_mla(spec, src=src, dst=dst, calibration=calibration)


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("num_kv_heads,bias", [(1, False), (2, False), (2, True)])
def test_deepseek_layout_is_exact_for_shared_keys_and_constant_latent_rms(
    smollm2_path, tmp_path, num_kv_heads, bias
):
    """Identical KV heads (or one), every pair kept (the progression 0, 1, ..., d/2 - 1), full rank, a latent
    of constant rms: the DeepSeek layout reproduces the source's logits (q/k/v/o biases too); its cache is
    d_c + 2r."""
    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=num_kv_heads, constant_rms=True, bias=bias)
    dst = _convert(src, tmp_path / "ds", rope_pairs=4)
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_layout"] == "shared" and config["latent_norm"] is True
    assert config["rope_pair_indices"] == [[[0, 1, 2, 3]]] * 2
    assert config["kv_lora_rank"] == num_kv_heads * 8  # Hkv (d - 2r) + Hkv d at r = d/2
    record = config["hf_attn"]["history"][-1]
    assert record["settings"]["layout"] == "deepseek" and record["rope_pair_stride"] == 1
    assert record["kv_numbers_per_token_per_layer"]["mla"] == config["kv_lora_rank"] + 8
    assert max(record["shared_key_residual_per_layer"]) < 1e-9
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    ref, got = _logits(src, ids), _logits(dst, ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), float((got - ref).abs().max())


def test_deepseek_layout_lossy_conversion_within_budget(smollm2_path, tmp_path):
    """Different heads, a budget: the shared progression in every layer, the cache within budget, a model
    that loads and runs (its quality is measured on SmolLM2: docs/research/mla-deepseek-layout.md)."""
    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=2, constant_rms=False, hidden=16)
    dst = _convert(src, tmp_path / "ds", kv_budget=0.5)
    config = json.loads((dst / "config.json").read_text())
    kept = config["rope_pair_indices"][0][0]
    stride = config["hf_attn"]["history"][-1]["rope_pair_stride"]
    assert all(layer == [kept] for layer in config["rope_pair_indices"])
    assert kept == [j * stride for j in range(config["rope_pairs"])]
    numbers = config["kv_lora_rank"] + 2 * config["rope_pairs"]
    assert numbers <= 0.5 * 2 * 2 * 8 and config["hf_attn"]["history"][-1]["kv_fraction"] <= 0.5
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(_logits(dst, ids)).all()


def test_cli_layout_flag_and_refusals(smollm2_path, tmp_path, capsys):
    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=2, constant_rms=False)
    cal = ["--calibration-text", str(tmp_path / "calibration.txt"), "--calibration-tokens", "128"]
    base = ["--model", str(src), *cal, "--refine-steps", "0"]
    capsys.readouterr()
    bad = [
        (["--layout", "deepseek", "--rope-selection", "2norm"], "--rope-selection"),
        (["--layout", "deepseek", "--kv-budget", "0.01"], "--kv-budget"),
        (["--layout", "deepseek", "--rope-pairs", "9"], "--rope-pairs"),
    ]
    for extra, word in bad:
        out = tmp_path / "bad"
        assert exit_status(convert_cli.mla_main, [*base, "--output", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and word in err, err
        assert not out.exists()
    assert (
        exit_status(convert_cli.mla_main, [*base, "--output", str(tmp_path / "x"), "--layout", "interleaved"])
        == 2
    )
    assert (
        convert_cli.mla_main(
            [*base, "--output", str(tmp_path / "ok"), "--layout", "deepseek", "--kv-budget", "0.5"]
        )
        == 0
    )
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert (
        config["rope_layout"] == "shared"
        and config["hf_attn"]["history"][-1]["settings"]["layout"] == "deepseek"
    )
    assert (
        convert_cli.mla_main([*base, "--output", str(tmp_path / "ph"), "--kv-budget", "0.5"]) == 0
    )  # default: per-head
    assert (
        json.loads((tmp_path / "ph" / "config.json").read_text()).get("rope_layout", "per_head") == "per_head"
    )


def test_heal_runs_on_the_deepseek_layout(smollm2_path, tmp_path):
    from hf_attn.conversion.training.data import HealSettings
    from hf_attn.conversion.training.heal import heal

    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=2, constant_rms=False)
    dst = _convert(src, tmp_path / "ds", kv_budget=0.5)
    settings = HealSettings(
        model=str(dst),
        output=str(tmp_path / "healed"),
        train_text=[str(tmp_path / "calibration.txt")],
        max_steps=2,
        seq_len=32,
        batch_size=2,
        lr=1e-3,
        eval_tokens=0,
    )
    result = heal(settings, progress=False)
    assert result["steps"] == 2
    config = json.loads((tmp_path / "healed" / "config.json").read_text())
    assert config["rope_layout"] == "shared" and config["latent_norm"] is True
    from safetensors.torch import load_file

    before = {k: v for f in dst.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in (tmp_path / "healed").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(before) == set(after)
    name = "model.layers.0.self_attn.latent_norm.weight"
    assert name in after and not torch.equal(before[name], after[name])  # trained like every parameter

    # ... and the healed checkpoint still exports exactly: vanilla DeepseekV3ForCausalLM gives its logits.
    from transformers import AutoModelForCausalLM

    from hf_attn.conversion.export.deepseek import export_checkpoint

    exported = export_checkpoint(src=tmp_path / "healed", dst=tmp_path / "exported")
    ids = torch.arange(3, 27)[None]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "healed").eval()(ids).logits
        vanilla = AutoModelForCausalLM.from_pretrained(exported).eval()
        assert type(vanilla).__name__ == "DeepseekV3ForCausalLM"
        got = vanilla(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_latent_norm_refinement_never_increases_the_error():
    g = torch.Generator().manual_seed(6)
    C, dc, nk, nv, N = 10, 3, 6, 5, 300
    x = torch.randn(N, C, generator=g, dtype=torch.float64) * torch.rand(
        N, 1, generator=g, dtype=torch.float64
    )
    down = torch.randn(dc, C, generator=g, dtype=torch.float64)
    w_k, w_v = torch.randn(nk, C, generator=g, dtype=torch.float64), torch.randn(nv, C, generator=g).double()
    base = sr.fit_latent_norm(down=down, w_k=w_k, b_k=None, w_v=w_v, b_v=None, samples=x, eps=1e-5)
    refined = sr.fit_latent_norm(
        down=down, w_k=w_k, b_k=None, w_v=w_v, b_v=None, samples=x, eps=1e-5, refine_steps=10
    )
    assert refined.key_error + refined.value_error <= base.key_error + base.value_error
    cn = torch.nn.functional.rms_norm(x @ refined.down.T, (dc,), refined.gain, eps=1e-5)
    ev = float((x @ w_v.T - cn @ refined.up_v.T).pow(2).sum() / (x @ w_v.T).pow(2).sum())
    assert math.isclose(refined.value_error, ev, rel_tol=1e-6)  # the reported error is the model's


def test_calibration_spills_every_layer_and_reads_back_the_whole_model_sums(smollm2_path, tmp_path):
    """Every layer's moment, shared-key sums and samples leave memory when the layer-by-layer pass leaves the
    layer (one layer's statistics in memory at a time, as 7B shapes need); what is read back equals the same
    statistics accumulated here from a whole-model pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_attn.conversion.checkpoint import calibration as cal
    from hf_attn.conversion.checkpoint.io import open_source

    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=2, constant_rms=False)
    geometry = open_source(src).geometry
    files = [src.parent / "calibration.txt"]
    got = mla.calibrate(
        src_dir=src,
        geometry=geometry,
        calibration=CalibrationSpec(text=files, tokens=256, window=64),
        shared_keys=True,
        sample_stride=2,
    )
    assert all(isinstance(s, SpilledLayerStatistics) for s in got.statistics.values())
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = cal.calibration_ids(AutoTokenizer.from_pretrained(src), files, 256)
    inputs = capture_attention_inputs(model, ids, layers=range(2), window=64, progress=False)
    ref = sr.SharedKeyStatistics(num_heads=4, num_kv_heads=2, head_dim=8)
    for i, layer in enumerate(model.model.layers):
        x, (cos, sin) = inputs[i]
        att = layer.self_attn
        for start in range(0, x.shape[0], 64):  # window by window, as the pass adds them
            w = slice(start, start + 64)
            ref.add(i, x[w], cos[w], sin[w], att.q_proj.weight, None, att.k_proj.weight, None)
        stats = got.statistics[i]
        assert torch.allclose(stats.shared_keys, ref.sums[i], rtol=1e-5, atol=1e-6 * ref.sums[i].abs().max())
        assert torch.allclose(torch.cat(stats.samples), x[::2], atol=1e-5)
        xa = torch.cat([x, torch.ones(x.shape[0], 1)], 1).double()
        assert torch.allclose(stats.moment, xa.T @ xa, rtol=1e-6, atol=1e-6 * (xa.T @ xa).abs().max())


def test_a_pickled_calibration_reads_its_statistics_after_the_first_is_gone(smollm2_path, tmp_path):
    """The experiments (mla_layouts, mla_allocation) torch.save a calibration and load it in a later process:
    with `scratch_dir` the spilled statistics stay readable once the calibrating object is gone."""
    import gc

    from hf_attn.conversion.checkpoint.io import open_source

    src = _tiny(tmp_path / "src", smollm2_path, num_kv_heads=2, constant_rms=False)
    calibration = CalibrationSpec(text=[src.parent / "calibration.txt"], tokens=128, window=64)
    kw = dict(calibration=calibration, shared_keys=True, sample_stride=2)
    first = mla.calibrate(src_dir=src, geometry=open_source(src).geometry, scratch_dir=tmp_path / "st", **kw)
    expected = first.statistics[1].moment
    torch.save(first, tmp_path / "calibration.pt")
    del first
    gc.collect()
    loaded = torch.load(tmp_path / "calibration.pt", weights_only=False)
    assert torch.equal(loaded.statistics[1].moment, expected)
    assert loaded.statistics[1].shared_keys is not None and loaded.statistics[1].samples is not None
