"""GQA -> MHA expansion (conversion.gqa.expand): exact logits on the real SmolLM2, repeated rows against a
computation written here, and the errors users see."""

import json
from pathlib import Path

import pytest
import torch
from conftest import exit_status
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.specs import ExpandSpec, WriteSpec
from hf_attn.tooling.files import checkpoint_hash, sha256_file

TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=6,
    max_position_embeddings=128,
)


def make_tiny(path: Path, config_cls=LlamaConfig) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**TINY), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(path)
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
def test_smollm2_expand_to_mha_reproduces_logits(tmp_path, smollm2_path):
    before = {p.name: sha256_file(p) for p in smollm2_path.iterdir()}
    dst = expand.expand_checkpoint(ExpandSpec(), src=smollm2_path, dst=tmp_path / "mha")
    assert {p.name: sha256_file(p) for p in smollm2_path.iterdir()} == before
    config = json.loads((dst / "config.json").read_text())
    assert config["num_key_value_heads"] == 9 == config["num_attention_heads"]
    assert config["hf_attn"]["history"][-1]["source_hash"] == checkpoint_hash(smollm2_path)
    assert (dst / "tokenizer.json").exists() and (dst / "generation_config.json").exists()

    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, path in (("src", smollm2_path), ("mha", dst)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (9 * 64, 576)
    assert torch.equal(logits["src"], logits["mha"])


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
@pytest.mark.parametrize("target", [None, 4, 2])
def test_repeated_rows_match_independent_computation(tmp_path, config_cls, target):
    src = make_tiny(tmp_path / "src", config_cls)
    dst = expand.expand_checkpoint(ExpandSpec(num_kv_heads=target), src=src, dst=tmp_path / "dst")
    h = TINY["num_attention_heads"] if target is None else target
    s, d = h // TINY["num_key_value_heads"], TINY["head_dim"]
    old, new = weights(src), weights(dst)
    assert set(old) == set(new)
    for name, w in old.items():
        if ".k_proj." in name or ".v_proj." in name:
            want = torch.cat(
                [w[(j // s) * d : (j // s + 1) * d] for j in range(h)]
            )  # new head j copies j // s
            assert torch.equal(new[name], want), name
        else:
            assert torch.equal(new[name], w), name
    assert json.loads((dst / "config.json").read_text())["num_key_value_heads"] == h


def test_expanded_tiny_model_gives_the_same_logits(tmp_path):
    src = make_tiny(tmp_path / "src", Qwen2Config)
    dst = expand.expand_checkpoint(
        ExpandSpec(), src=src, dst=tmp_path / "dst", write=WriteSpec(save_dtype="float32")
    )
    ids = torch.arange(30)[None] % 96
    out = []
    for path in (src, dst):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        with torch.no_grad():
            out.append(model(input_ids=ids).logits)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)


def test_errors(tmp_path, capsys):
    src = make_tiny(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"1 is smaller than the source's 2 KV heads.*hf-attn convert gqa"):
        expand.expand_checkpoint(ExpandSpec(num_kv_heads=1), src=src, dst=out)
    with pytest.raises(ValueError, match=r"--num-kv-heads 3 .* 2 KV heads .* 8 query heads.*one of 2, 4, 8"):
        expand.expand_checkpoint(ExpandSpec(num_kv_heads=3), src=src, dst=out)
    expand.expand_checkpoint(ExpandSpec(), src=src, dst=out)
    capsys.readouterr()
    assert exit_status(convert_cli.expand_main, ["--model", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and "--overwrite" in err and "\n" not in err
    convert_cli.expand_main(["--model", str(src), "--output", str(out), "--overwrite", "--num-kv-heads", "4"])
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 4
