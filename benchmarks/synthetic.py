"""Synthetic Llama checkpoints shaped like real ones (`benchmarks.scale`, `.engine`, `.gpu`).

`write_synthetic` writes the model's exact config (hidden size, layers, heads, KV heads, intermediate size,
vocabulary, RoPE theta and scaling, untied embeddings), bf16 weights drawn from a seeded normal of small std
(norm weights 1) so forward passes stay finite, generated tensor by tensor in row blocks (never the whole
model, never a whole tensor in float32), sharded like the hub's checkpoints. The tokenizer is a word-level one
trained on the calibration text with a vocabulary smaller than the model's, so every id it gives is a valid
embedding row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hf_attn.tooling.errors import UserError

# (shape notation) H query heads, G KV heads, D head dim, d hidden, f intermediate, V vocabulary, L layers
SHAPES: dict[str, dict] = {
    "llama-2-7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
SHAPES["llama-3-8b"] = {  # what differs from Llama-2-7B
    **SHAPES["llama-2-7b"],
    **dict(
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}
# a few-MB stand-in with the same structure (GQA, llama3 scaling, untied), for tests and dry runs
SHAPES["tiny"] = {
    **SHAPES["llama-3-8b"],
    **dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
        rope_scaling={**SHAPES["llama-3-8b"]["rope_scaling"], "original_max_position_embeddings": 128},
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# the tiny one as multi-head attention (no GQA) without RoPE scaling, for `benchmarks.engine`'s quick pair
SHAPES["tiny-mha"] = {**SHAPES["tiny"], **dict(hidden_size=128, num_key_value_heads=4, head_dim=32)}
SHAPES["tiny-mha"].update(intermediate_size=256, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None)
HUB_SHARD_BYTES = 5_000_000_000  # the hub's max_shard_size="5GB"
WEIGHT_STD = 0.02
ROW_BLOCK_BYTES = 64 * 1024**2  # float32 bytes drawn at a time
UNK = "[UNK]"


def llama_config(shape: dict) -> dict:
    """config.json of a Llama checkpoint with these dimensions, in the hub's (transformers 4) spelling."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        initializer_range=WEIGHT_STD,
        mlp_bias=False,
        pretraining_tp=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        use_cache=True,
        **shape,
    )
    if config["rope_scaling"] is None:
        del config["rope_scaling"]
    return config


def tensor_shapes(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of the Llama checkpoint with its shape, in the hub's order (embeddings, layers, head)."""
    d, f, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    H, G, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    out = [("model.embed_tokens.weight", (V, d))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d,)),
            (p + "mlp.down_proj.weight", (d, f)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "self_attn.k_proj.weight", (G * D, d)),
            (p + "self_attn.o_proj.weight", (d, H * D)),
            (p + "self_attn.q_proj.weight", (H * D, d)),
            (p + "self_attn.v_proj.weight", (G * D, d)),
        ]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (V, d))]
    return out


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """bf16 weight: ones for norms, else N(0, WEIGHT_STD^2) drawn in float32 blocks of rows, (shape)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, ROW_BLOCK_BYTES // (4 * shape[-1]))
    for start in range(0, shape[0], rows):
        block = torch.randn((min(rows, shape[0] - start), shape[-1]), generator=generator)  # (rows, cols)
        out[start : start + rows] = block.mul_(WEIGHT_STD)
    return out


def write_tokenizer(directory: Path, *, vocab_size: int, files: list[Path]) -> None:
    """A word-level tokenizer trained on `files`, with fewer than `vocab_size` ids (all valid embeddings)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    size = min(vocab_size, 16000)
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=size, special_tokens=[UNK, "<s>", "</s>"])
    tokenizer.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=UNK, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


def write_synthetic(
    directory: str | os.PathLike,
    *,
    shape: str | dict,
    seed: int = 0,
    max_shard_bytes: int = HUB_SHARD_BYTES,
    tokenizer_files: list[Path] | None = None,
    progress: bool = True,
) -> Path:
    """Write a random bf16 Llama checkpoint of `shape` (a SHAPES key, or such dims themselves) into new
    `directory`; returns it. config.json comes last: its presence marks a complete checkpoint."""
    from tqdm import tqdm

    from hf_attn.conversion.checkpoint.calibration import default_calibration_files
    from hf_attn.conversion.checkpoint.io import write_config
    from hf_attn.conversion.checkpoint.shards import ShardedWriter

    if isinstance(shape, str) and shape not in SHAPES:
        raise UserError(f"Unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    label = shape if isinstance(shape, str) else f"{dims['num_hidden_layers']}-layer checkpoint"
    directory = Path(directory)
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    names = tensor_shapes(dims)
    with ShardedWriter(directory, max_shard_bytes=max_shard_bytes) as writer:
        for name, tensor_shape in tqdm(names, desc=f"write {label}", unit="tensor", disable=not progress):
            tensor = random_tensor(name, tensor_shape, generator)
            writer.add(name, tensor)
            del tensor
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": dims["bos_token_id"], "eos_token_id": dims["eos_token_id"]}) + "\n"
    )
    files = default_calibration_files() if tokenizer_files is None else tokenizer_files
    write_tokenizer(directory, vocab_size=dims["vocab_size"], files=files)
    write_config(directory, llama_config(dims))
    return directory


__all__ = [
    "HUB_SHARD_BYTES",
    "SHAPES",
    "WEIGHT_STD",
    "llama_config",
    "random_tensor",
    "tensor_shapes",
    "write_synthetic",
    "write_tokenizer",
]
