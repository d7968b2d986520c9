"""`conversion.export --to deepseek_v3`: exactness against vanilla transformers' DeepseekV3ForCausalLM, loaded
in a fresh interpreter that never imports hf_attn (no trust_remote_code), the refusals, the source never
modified and the output atomic.

The sources are tiny random llama_mla checkpoints in the DeepSeek layout (rope_layout "shared", latent_norm)
whose configs derive from tiny Llama, Mistral and Qwen2 configs; the reference is the llama_mla model itself
(tested against its source architectures in test_llama_mla_model.py / test_llama_mla_deepseek_layout.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_SHAPE, exit_status
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from hf_attn.conversion import export
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

TOL = 1e-4  # max |diff| relative to max |logit|, fp32
GEN_TOKENS = 32

SRC_TINY = dict(
    vocab_size=97,
    **TINY_SHAPE,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SOURCE_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def deepseek_layout_model(
    kind: str = "llama", *, seed: int = 0, zero_biases: bool = False, mla: dict | None = None, **src
) -> LlamaMLAForCausalLM:
    """A random llama_mla model in the DeepSeek layout whose config derives from a tiny `kind` config."""
    source = SOURCE_CLASSES[kind](**{**SRC_TINY, **src})
    fields = {
        k: v
        for k, v in source.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", "auto_map", "dtype")
    }
    bias = kind == "qwen2" or bool(getattr(source, "attention_bias", False))
    options = dict(kv_lora_rank=12, rope_pairs=2, rope_layout="shared", latent_norm=True)
    config = LlamaMLAConfig(
        **fields,
        **{**options, **(mla or {})},
        qkv_bias=bias,
        o_bias=kind != "qwen2" and bias,
        source_model_type=kind,
    )
    model = randomize_(LlamaMLAForCausalLM(config), seed)
    if zero_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    return model


# name -> (model spec, export options, kv_a_layernorm eps the vanilla child sets: None = transformers')
EXACT = {
    "llama_untied": (dict(kind="llama"), {}, None),
    "llama_tied_unequal_pairs": (
        dict(kind="llama", tie_word_embeddings=True, mla=dict(rope_pair_indices=[[[0, 2]], [[1, 3]]])),
        {},
        None,
    ),
    "mistral_window_covers_context": (dict(kind="mistral", sliding_window=64), {}, None),
    "qwen2_zero_biases": (dict(kind="qwen2", rms_norm_eps=1e-6, zero_biases=True), {}, None),
    "per_head_one_kv_head": (
        dict(kind="llama", num_key_value_heads=1, mla=dict(rope_layout="per_head", rope_pair_indices=None)),
        {},
        None,
    ),
    "flashmla_dims": (
        dict(kind="llama", mla=dict(rope_pair_indices=[[[0, 3]], [[0, 3]]])),
        dict(engine_dims="576"),
        None,
    ),
    "engines_eps": (dict(kind="llama"), dict(latent_norm_eps_for="engines"), 1e-5),
    "no_rope_pairs": (dict(kind="llama", mla=dict(rope_pairs=0, kv_lora_rank=20)), {}, None),
    "only_pair_0_flashmla": (
        dict(kind="llama", mla=dict(rope_pairs=1, rope_pair_indices=[[[0]], [[0]]])),
        dict(engine_dims="576"),
        None,
    ),
}

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_attn" or name.startswith("hf_attn."):
                raise ImportError(f"blocked: {name}")
    sys.meta_path.insert(0, Block())
    sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "hf_attn"))]
    import torch
    from transformers import AutoModelForCausalLM
    jobs = json.loads(sys.argv[1])
    reports = {}
    for name, job in jobs.items():
        model = AutoModelForCausalLM.from_pretrained(job["dir"]).eval()
        if job["kv_eps"] is not None:  # emulate vLLM / SGLang: kv_a_layernorm eps = rms_norm_eps
            for layer in model.model.layers:
                layer.self_attn.kv_a_layernorm.variance_epsilon = job["kv_eps"]
        data = torch.load(job["expected"])
        keep = data["mask"].bool()
        with torch.no_grad():
            logits = model(input_ids=data["ids"], attention_mask=data["mask"]).logits
            new = data["generated"].shape[1] - data["ids"].shape[1]
            gen = model.generate(input_ids=data["ids"], attention_mask=data["mask"], do_sample=False,
                                 max_new_tokens=new, pad_token_id=0)
        report = {
            "class": type(model).__name__,
            "diff": (logits - data["logits"]).abs()[keep].max().item(),
            "scale": data["logits"].abs()[keep].max().item(),
            "generate_equal": bool(torch.equal(gen, data["generated"])),
        }
        if job.get("sensitivity"):  # the comparison can fail: rotate-half instead of interleaved RoPE
            plain = AutoModelForCausalLM.from_pretrained(job["dir"], rope_interleave=False).eval()
            with torch.no_grad():
                wrong = plain(input_ids=data["ids"], attention_mask=data["mask"]).logits
            report["wrong_rope_diff"] = (wrong - data["logits"]).abs()[keep].max().item()
        reports[name] = report
    reports["hf_attn_loaded"] = any(m == "hf_attn" or m.startswith("hf_attn.") for m in sys.modules)
    print(json.dumps(reports))
    """
)


def batch(B: int = 2, T: int = 10, pad: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def save_source(model: LlamaMLAForCausalLM, path: Path) -> Path:
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')  # a side file to carry over
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every EXACT variant: source saved, exported, expected logits / generation, one vanilla child run."""
    root = tmp_path_factory.mktemp("export")
    jobs, sources = {}, {}
    for k, (name, (spec, options, kv_eps)) in enumerate(EXACT.items()):
        spec = dict(spec)
        model = deepseek_layout_model(spec.pop("kind"), seed=k, **spec)
        src = save_source(model, root / f"{name}-src")
        before = file_hashes(src)
        out = export.export_checkpoint(src=src, dst=root / f"{name}-out", **options)
        assert file_hashes(src) == before, "the export modified its source"
        ids, mask = batch(seed=k)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            generated = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=GEN_TOKENS, pad_token_id=0
            )
        expected = root / f"{name}-expected.pt"
        torch.save({"ids": ids, "mask": mask, "logits": logits, "generated": generated}, expected)
        jobs[name] = {"dir": str(out), "expected": str(expected), "kv_eps": kv_eps, "sensitivity": k == 0}
        sources[name] = (model, src, out)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(jobs)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), sources


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("name", list(EXACT))
def test_vanilla_deepseek_v3_reproduces_source(exported, name):
    reports, _ = exported
    assert reports["hf_attn_loaded"] is False
    res = reports[name]
    assert res["class"] == "DeepseekV3ForCausalLM"
    assert res["diff"] <= TOL * res["scale"], f"{name}: {res['diff']:.3g} > {TOL} * {res['scale']:.3g}"
    assert res["generate_equal"], f"{name}: {GEN_TOKENS}-token greedy generation differs"


def test_reference_is_sensitive_to_rope_layout(exported):
    """Loading the first export with rotate-half RoPE instead of interleaved changes the logits: the
    exactness comparison above can fail."""
    reports, _ = exported
    res = reports[next(iter(EXACT))]
    assert res["wrong_rope_diff"] > 100 * TOL * res["scale"]


def test_exported_files_are_what_the_engines_read(exported):
    """Exactly DeepSeek-V3's tensor names (those vLLM's and SGLang's loaders accept), the config fields they
    read, the tokenizer side files, a generation config, and none of llama_mla's remote code."""
    _, sources = exported
    model, src, out = sources["llama_tied_unequal_pairs"]
    cfg = json.loads((out / "config.json").read_text())
    L = model.config.num_hidden_layers
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["q_lora_rank"] is None and cfg["first_k_dense_replace"] == L
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["routed_scaling_factor"] == 1.0
    assert cfg["rope_interleave"] is True and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    # pairs {0, 2} and {1, 3}: s = 1, four slots (8 RoPE dims for 4 kept): theta' = theta ** (2 * 4 / 8)
    assert (cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (8, 4, 8)
    assert cfg["rope_theta"] == pytest.approx(model.config.rope_parameters["rope_theta"])
    assert cfg["hf_attn"]["history"][-1]["cache_numbers_per_token_and_layer"] == {"source": 16, "export": 20}
    from transformers import AutoConfig

    from hf_attn.eval.kv_cache import kv_bytes_per_token  # what an MLA engine caches for the export

    kv = kv_bytes_per_token(AutoConfig.from_pretrained(out))
    assert kv.numbers_per_token_per_layer == 20 and kv.total == 20 * L * 4
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    want = {f"model.layers.{i}.{n}" for i in range(L) for n in per_layer}
    want |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}  # lm_head: engines untie
    assert names == want
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(out.glob("*.py"))


def test_flashmla_dims_and_cache_cost(exported):
    _, sources = exported
    _, _, out = sources["flashmla_dims"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert cfg["hf_attn"]["history"][-1]["cache_numbers_per_token_and_layer"] == {"source": 16, "export": 576}


def test_pure_mapping_matches_streamed_export(exported):
    """deepseek_state_dict (in memory) equals what export_checkpoint streamed to disk."""
    from safetensors.torch import load_file

    _, sources = exported
    model, _, out = sources["llama_untied"]
    plan = export.plan_export(config=model.config)
    mapped = export.deepseek_state_dict(state_dict=model.state_dict(), plan=plan, config=model.config)
    on_disk = load_file(str(out / "model.safetensors"))
    assert mapped.keys() == on_disk.keys()
    assert all(torch.equal(mapped[k], on_disk[k]) for k in mapped)


# ------------------------------------------------------------------------------------------- refusals

REFUSED = {
    "per_head_two_kv_heads": (
        dict(kind="llama", mla=dict(rope_layout="per_head", rope_pair_indices=None)),
        [],
        "--layout deepseek",
    ),
    "no_latent_norm": (dict(kind="llama", mla=dict(latent_norm=False)), [], "latent_norm=False"),
    "qwen2_nonzero_bias": (dict(kind="qwen2"), [], "q_proj.bias is nonzero"),
    "sliding_window_below_context": (
        dict(kind="mistral", sliding_window=5),
        [],
        "--max-position-embeddings 5",
    ),
    "llama3_rope": (
        dict(
            kind="llama",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        [],
        "rope_type='llama3'",
    ),
    "flashmla_latent_too_wide": (
        dict(kind="llama", mla=dict(kv_lora_rank=513)),
        ["--engine-dims", "576"],
        "<= 512",
    ),
    "gelu_mlp": (dict(kind="llama", hidden_act="gelu"), [], "silu"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_exit_2_and_write_nothing(tmp_path, capsys, name):
    spec, flags, message = REFUSED[name]
    spec = dict(spec)
    src = save_source(deepseek_layout_model(spec.pop("kind"), **spec), tmp_path / "src")
    before, listing = file_hashes(src), sorted(os.listdir(tmp_path))
    argv = ["--to", "deepseek_v3", "--model", str(src), "--output", str(tmp_path / "out"), *flags]
    capsys.readouterr()  # drop save_pretrained's progress output
    assert exit_status(export.main, argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == listing  # no output, no temporary directory left behind
    assert file_hashes(src) == before


def test_refuses_a_checkpoint_that_is_not_llama_mla(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "llama"
    AutoModelForCausalLM.from_config(LlamaConfig(**SRC_TINY)).save_pretrained(src)
    capsys.readouterr()
    argv = ["--to", "deepseek_v3", "--model", str(src), "--output", str(tmp_path / "out")]
    assert exit_status(export.main, argv) == 2 and "mla --layout deepseek" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path, capsys):
    src = save_source(deepseek_layout_model("llama"), tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["--to", "deepseek_v3", "--model", str(src), "--output", str(out)]
    assert exit_status(export.main, argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert exit_status(export.main, [*argv, "--overwrite"]) == 2  # a directory hf-attn did not write
    assert "not a checkpoint hf-attn wrote" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert export.main([*argv, "--overwrite"]) == 0  # an empty directory, then its own export
    assert export.main([*argv, "--overwrite"]) == 0 and (out / "model.safetensors").exists()


def test_max_position_embeddings_makes_a_short_window_exportable(tmp_path):
    src = save_source(deepseek_layout_model("mistral", sliding_window=5), tmp_path / "src")
    out = export.export_checkpoint(src=src, dst=tmp_path / "out", max_position_embeddings=5)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 5


# ------------------------------------------------------------------------------------------- the math


@pytest.mark.parametrize(
    "d_c,D,eps_s,eps_t", [(12, 12, 1e-5, 1e-6), (12, 512, 1e-5, 1e-6), (7, 512, 1e-6, 1e-6)]
)
def test_latent_norm_rescaling_identity(d_c, D, eps_s, eps_t):
    """RMSNorm_eps_t(alpha [c; 0]) * [g sqrt(d_c / D); 0] == RMSNorm_eps_s(c) * g, including tiny latents
    where eps dominates (float64)."""
    plan = export.ExportPlan(
        num_layers=1,
        hidden_size=4,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        rope_pairs=1,
        latent_dim=d_c,
        kv_lora_rank=D,
        rope_slots=1,
        rope_stride=1,
        slots_per_stride=1,
        rope_theta=1e4,
        pairs=((0,),),
        eps_source=eps_s,
        eps_target=eps_t,
        max_position_embeddings=8,
    )
    g = torch.Generator().manual_seed(0)
    gain = torch.rand(d_c, generator=g, dtype=torch.float64) + 0.5
    for scale in (1e-4, 1e-2, 1.0, 30.0):
        c = scale * torch.randn(5, d_c, generator=g, dtype=torch.float64)
        want = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps_s) * gain
        padded = torch.cat([plan.latent_scale * c, c.new_zeros(5, D - d_c)], dim=-1)
        gain_t = torch.cat([gain * plan.gain_scale, gain.new_zeros(D - d_c)])
        got = padded * torch.rsqrt(padded.pow(2).mean(-1, keepdim=True) + eps_t) * gain_t
        torch.testing.assert_close(got[:, :d_c], want, rtol=1e-12, atol=0)
        assert torch.equal(got[:, d_c:], torch.zeros_like(got[:, d_c:]))
