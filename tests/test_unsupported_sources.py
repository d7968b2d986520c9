"""Refusals before any work: every converter command (expand, gqa, mla per-head and DeepSeek layout, export)
refuses an architecture whose math the conversion does not cover with one line naming the feature, exit status
2, and no output directory. The sources are config.json files only (built with transformers' own config
classes): the support check (`conversion.checkpoint.io.check_supported`) runs before any tensor is read.
"""

from __future__ import annotations

import pytest
from conftest import exit_status
from transformers import (
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    Olmo2Config,
    Phi3Config,
    PhiConfig,
    Qwen3Config,
    StableLmConfig,
)

from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import export

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# name -> (config, words the refusal must contain: the model type or field, and the feature)
SOURCES = {
    "qwen3": (Qwen3Config(**SHAPE, head_dim=8), ("qwen3", "q_norm/k_norm")),
    "olmo2": (Olmo2Config(**SHAPE), ("olmo2", "q_norm/k_norm")),
    "gemma": (GemmaConfig(**SHAPE, head_dim=8), ("gemma", "scaled embeddings", "(1 + weight) RMSNorm")),
    "gemma2": (Gemma2Config(**SHAPE, head_dim=8), ("gemma2", "soft-capping", "scaled embeddings")),
    "phi3": (Phi3Config(**SHAPE), ("phi3", "fused qkv_proj")),
    "phi": (PhiConfig(**SHAPE), ("phi", "partial rotary")),
    "stablelm": (StableLmConfig(**SHAPE), ("stablelm", "partial rotary")),
    "llama_partial_rotary": (LlamaConfig(**SHAPE, partial_rotary_factor=0.5), ("partial_rotary_factor=0.5",)),
    "llama_qk_norm": (LlamaConfig(**SHAPE, qk_norm=True), ("qk_norm",)),
    "llama_softcap": (LlamaConfig(**SHAPE, attn_logit_softcapping=50.0), ("soft-capping",)),
}

COMMANDS = {
    "expand": (convert_cli.expand_main, []),
    "gqa_mean": (convert_cli.gqa_main, ["--num-kv-heads", "1", "--method", "mean"]),
    "gqa_calibrated": (convert_cli.gqa_main, ["--num-kv-heads", "1", "--method", "calibrated"]),
    "mla_per_head": (convert_cli.mla_main, ["--kv-lora-rank", "8"]),
    "mla_deepseek": (
        convert_cli.mla_main,
        ["--kv-lora-rank", "8", "--rope-pairs", "1", "--layout", "deepseek"],
    ),
    "export": (export.main, ["--to", "deepseek_v3"]),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("unsupported")
    for name, (config, _) in SOURCES.items():
        config.save_pretrained(root / name)  # config.json only: the check must come before any tensor read
    return root


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("source", SOURCES)
def test_refused_before_any_work(sources, tmp_path, capsys, source, command):
    main, extra = COMMANDS[command]
    out = tmp_path / "out"
    status = exit_status(main, ["--model", str(sources / source), "--output", str(out), *extra])
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    for word in SOURCES[source][1]:
        assert word in err, (word, err)
    assert "not covered by the conversion math" in err or "Unsupported" in err, err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary directory left either
