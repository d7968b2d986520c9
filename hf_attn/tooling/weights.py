"""The one reader of a checkpoint's weights, shared by the converters and the strict loading checks: the
files transformers reads (`weight_files`), their safetensors headers (`tensor_index`, nothing loaded), one
tensor at a time with a plain file read (`read_tensor`), and the one rule for non-finite weights, refused
before any work (`check_finite`). Every problem is a `UserError` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.tooling.errors import UserError, one_line
from hf_attn.tooling.files import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
NAMED_FILE_KEY = "transformers_weights"  # in config.json: the weights file to load, whatever else is there

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_CHECK_CHUNK = 1 << 24  # elements tested for finiteness at once (bounds the temporary mask)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # tested as stored; others as float32


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and byte range (absolute offsets in the file)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _shards(index: Path) -> list[Path]:
    """The files a shard index lists, in order of first mention; UserError for a bad index or a lost shard."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [index.parent / n for n in dict.fromkeys(weight_map.values())]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{index} is not a shard index ({one_line(err)}); repair or replace it") from err
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{index} lists missing shards: {', '.join(missing[:3])}; copy them in")
    return files


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files transformers' `from_pretrained` reads from the directory `model_dir`, in its
    precedence: the file config.json names in `transformers_weights`, else `model.safetensors`, else the
    shards `model.safetensors.index.json` lists, else `pytorch_model.bin`, else the shards of its index.
    Anything else there (a stale index beside `model.safetensors`, an old `.bin`) is not read, as transformers
    does not read it. UserError when there are none or an index is unusable."""
    directory = Path(model_dir)
    config = read_json(directory / "config.json")  # (an unreadable config is reported elsewhere)
    named = config.get(NAMED_FILE_KEY) if isinstance(config, dict) else None
    if isinstance(named, str) and named:
        path = (directory / named).resolve()
        if directory.resolve() not in path.parents or not path.is_file():
            raise UserError(
                f"{directory / 'config.json'} names {NAMED_FILE_KEY}={named!r}, which is not a file inside "
                f"{directory}; copy it in or remove the key"
            )
        return _shards(path) if named.endswith(".index.json") else [path]
    for name in (SINGLE_FILE, INDEX_FILE, BIN_FILE, BIN_INDEX_FILE):
        if (directory / name).is_file():
            return _shards(directory / name) if name.endswith(".index.json") else [directory / name]
    raise UserError(
        f"{directory} has no weights transformers can load (none of {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE}, "
        f"{BIN_INDEX_FILE}); save it with `save_pretrained`"
    )


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts; UserError naming `path` unless the
    header parses and its tensors lie within the file."""
    size = path.stat().st_size
    fix = "the file is damaged or truncated; copy it again"
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        ends = [int(h["data_offsets"][1]) for k, h in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({one_line(err)}); {fix}") from err
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise UserError(f"{path} holds {size} bytes but its tensors need {need}; {fix}")
    return header, 8 + n


def tensor_index(model_dir: str | os.PathLike) -> dict[str, TensorInfo]:
    """Name -> TensorInfo for every tensor of the checkpoint transformers would load (`weight_files`), from
    the headers only (nothing is loaded); UserError for a `.bin` checkpoint."""
    files = weight_files(model_dir)
    if any(f.suffix != ".safetensors" for f in files):
        raise UserError(
            f"{model_dir} holds its weights as {files[0].name}; this reads safetensors only: re-save it with "
            "`save_pretrained(safe_serialization=True)`"
        )
    out = {}
    for path in files:
        header, data_start = safetensors_header(path)
        header.pop("__metadata__", None)
        for name, h in header.items():
            if h["dtype"] not in SAFETENSORS_DTYPES:
                raise UserError(f"{path.name}: tensor {name} has unsupported dtype {h['dtype']}")
            begin, end = h["data_offsets"]
            out[name] = TensorInfo(
                path, SAFETENSORS_DTYPES[h["dtype"]], tuple(h["shape"]), data_start + begin, data_start + end
            )
    return out


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Read one tensor with a plain file read (no mmap, so memory is exactly this tensor)."""
    raw = torch.empty(info.end - info.begin, dtype=torch.uint8)
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        got = f.readinto(memoryview(raw.numpy()))
    if got != info.end - info.begin:
        raise OSError(f"{info.file}: truncated tensor data (read {got} of {info.end - info.begin} bytes)")
    return raw.view(info.dtype).reshape(info.shape)


def names_in_file_order(index: dict[str, TensorInfo]) -> list[str]:
    """Tensor names sorted by (file, offset): reading them in this order is sequential on disk."""
    return sorted(index, key=lambda n: (str(index[n].file), index[n].begin))


def _non_finite(tensor: torch.Tensor) -> tuple[int, str] | None:
    """(how many values are not finite, the first kind met: NaN / inf / -inf), or None when all are."""
    count, kind = 0, None
    for chunk in tensor.detach().reshape(-1).split(_CHECK_CHUNK):
        chunk = chunk if chunk.dtype in _FLOATS else chunk.float()
        if not chunk.numel():
            continue
        lo, hi = torch.aminmax(chunk)  # a NaN or an infinity reaches one of them: one pass, no mask
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            continue
        bad = ~torch.isfinite(chunk)
        n = int(bad.sum())
        if n and kind is None:
            first = float(chunk[bad][0])
            kind = "NaN" if first != first else ("inf" if first > 0 else "-inf")
        count += n
    return None if kind is None else (count, kind)


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], *, where: str | os.PathLike) -> None:
    """UserError naming the first floating tensor of `tensors` ((name, tensor) pairs, in order) that holds a
    NaN or an infinity: every number computed from such weights would be meaningless."""
    for name, tensor in tensors:
        bad = _non_finite(tensor) if tensor.is_floating_point() else None
        if bad is not None:
            raise UserError(
                f"{where}: {name} holds {bad[1]} ({bad[0]} of {tensor.numel()} values not finite): weights "
                "that are not finite make every result meaningless; repair or re-export the checkpoint"
            )


def check_finite_weights(model_dir: str | os.PathLike, index: dict[str, TensorInfo]) -> None:
    """`check_finite` over every floating tensor of `index` (the `tensor_index` of the safetensors
    checkpoint `model_dir`), read one at a time in file order."""
    floating = (n for n in names_in_file_order(index) if index[n].dtype.is_floating_point)
    check_finite(((n, read_tensor(index[n])) for n in floating), where=model_dir)
