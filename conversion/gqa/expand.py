"""GQA/MQA -> MHA (or more KV heads): repeat each K/V head, an exact conversion.

    hf-attn convert expand --model SRC --output DST [--num-kv-heads H] [--save-dtype ...] [--overwrite]

Source KV head g becomes the new heads g*s ... (g+1)*s - 1 with s = H / Hkv, rows copied unchanged (biases
too), so query head h still reads the same keys and values: it read head h // (Hq/Hkv) and now reads
h // (Hq/H), a copy of it (the `repeat_kv` order). The logits are those of the source; `hf-attn convert gqa
--method mean` pools the copies back bit for bit. H defaults to the number of query heads (MHA).
Streams tensor by tensor: memory is one tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_attn.conversion.checkpoint.io import (
    AttentionGeometry,
    TensorInfo,
    add_record,
    conversion_record,
    dtype_name,
    names_in_file_order,
    open_source,
    parse_attn_key,
    read_tensor,
    save_streamed,
)
from hf_attn.conversion.specs import ExpandSpec, WriteSpec, check_num_kv_heads
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import checkpoint_hash

PROG = "hf-attn convert expand"


def check_expansion(geometry: AttentionGeometry, num_kv_heads: int | None) -> int:
    """The target number of KV heads (None -> the number of query heads); UserError naming the values."""
    hkv, hq = geometry.num_kv_heads, geometry.num_heads
    target = hq if num_kv_heads is None else num_kv_heads
    check_num_kv_heads(target)
    if target < hkv:
        raise UserError(
            f"--num-kv-heads {target} is smaller than the source's {hkv} KV heads: expansion only adds "
            f"heads; to pool them use `hf-attn convert gqa --num-kv-heads {target}`"
        )
    valid = [h for h in range(hkv, hq + 1) if h % hkv == 0 and hq % h == 0]
    if target % hkv or hq % target:
        raise UserError(
            f"--num-kv-heads {target} must be a multiple of the source's {hkv} KV heads and divide its "
            f"{hq} query heads; choose one of {', '.join(map(str, valid))}"
        )
    return target


@torch.inference_mode()
def repeat_heads(tensor: torch.Tensor, *, num_kv_heads: int, repeats: int, head_dim: int) -> torch.Tensor:
    """K or V weight (Hkv*d, C) or bias (Hkv*d,) -> (Hkv*s*d, C) or (Hkv*s*d,): each head repeated s times."""
    assert tensor.shape[0] == num_kv_heads * head_dim, (tuple(tensor.shape), num_kv_heads, head_dim)
    rest = tuple(tensor.shape[1:])
    heads = tensor.reshape(num_kv_heads, head_dim, *rest)  # (Hkv, d, C) or (Hkv, d)
    out = heads.repeat_interleave(repeats, dim=0)  # (Hkv*s, d, C): new head j = source head j // s
    return out.reshape(num_kv_heads * repeats * head_dim, *rest).contiguous()


def _expanded_tensors(
    index: dict[str, TensorInfo], geometry: AttentionGeometry, repeats: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for name in tqdm(names_in_file_order(index), desc="expand", unit="tensor"):
        tensor = read_tensor(index[name])
        parsed = parse_attn_key(name)
        if parsed is not None and parsed[1] in ("k_proj", "v_proj"):
            tensor = repeat_heads(
                tensor, num_kv_heads=geometry.num_kv_heads, repeats=repeats, head_dim=geometry.head_dim
            )
        yield name, tensor
        del tensor  # hold one tensor at a time


def expand_checkpoint(
    spec: ExpandSpec = ExpandSpec(),
    *,
    src: str | Path | None,
    dst: str | Path,
    write: WriteSpec = WriteSpec(),
) -> Path:
    """Write `dst`: the checkpoint `src` (None: the embedded SmolLM2) with its K/V heads repeated up to
    `spec.num_kv_heads` (default: MHA)."""
    source = open_source(src, dst=dst, overwrite=write.overwrite, dtype=write.save_dtype)
    config, geometry, dtype = source.config, source.geometry, source.dtype
    target = check_expansion(geometry, spec.num_kv_heads)
    repeats = target // geometry.num_kv_heads
    record = conversion_record(
        kind="expand",
        source=source.dir,
        source_hash=checkpoint_hash(source.dir),
        settings={"method": "repeat", "num_kv_heads": spec.num_kv_heads},
        num_key_value_heads={"from": geometry.num_kv_heads, "to": target},
        sources_of_new_heads=[j // repeats for j in range(target)],
        dtype=dtype_name(dtype) if dtype is not None else config.get("dtype", config.get("torch_dtype")),
    )
    return save_streamed(
        src_dir=source.dir,
        dst=dst,
        tensors=_expanded_tensors(source.index, geometry, repeats),
        config=add_record({**config, "num_key_value_heads": target}, record),
        overwrite=write.overwrite,
        dtype=dtype,
        max_shard_bytes=write.max_shard_bytes,
    )


def describe(record: dict) -> str:
    """One line on an `expand_checkpoint` conversion record (for the command)."""
    heads = record["num_key_value_heads"]
    return f"expanded {heads['from']} -> {heads['to']} KV heads"
