"""Safetensors shards written one tensor at a time (`ShardedWriter`), and attention layers spilled to disk
(`SpilledLayers`).

Writers are meant to be used inside `hf_attn.tooling.files.atomic_directory`, so a failure leaves no output.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from hf_attn.conversion.specs import DEFAULT_MAX_SHARD_BYTES
from hf_attn.tooling.weights import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE  # the names readers share

if TYPE_CHECKING:
    from hf_attn.tooling.weights import TensorInfo


_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# One tensor of a shard being written: name, dtype code, shape, data offsets [begin, end).
_Entry = tuple[str, str, tuple[int, ...], int, int]


def _header_blob(entries: list[_Entry]) -> bytes:
    """The JSON header of a shard holding `entries`, padded with spaces to a multiple of 8 bytes (so the data
    section starts 8-byte aligned)."""
    header = {"__metadata__": {"format": "pt"}}
    for name, dtype, shape, begin, end in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)


class ShardedWriter:
    """Stream tensors into safetensors shards of at most `max_shard_bytes` (one tensor may exceed it).

    Each tensor's bytes go to the shard file immediately, behind `HEADER_RESERVE` bytes kept for the header;
    when the shard is full its header is written into them (padded with spaces, which the safetensors JSON
    header allows), so every byte is written once and memory never holds more than the tensor being added. A
    header longer than the reserve (thousands of tensors in a shard) falls back to copying the data behind it
    in chunks. Tensors whose byte size is not a multiple of 8 are held back to the end of their shard so every
    other tensor stays 8-byte aligned. `close()` names the shards `model-0000k-of-0000n.safetensors` and
    writes `model.safetensors.index.json`, or a single `model.safetensors` when everything fits in one shard.
    """

    HEADER_RESERVE = 64 * 1024  # bytes before a shard's data kept for its header (~150 bytes per tensor)

    def __init__(self, directory: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[tuple[Path, list[str]]] = []  # finished shard files and their tensor names
        self.total_size = 0
        self._names: set[str] = set()
        self._data = None  # open scratch file of the current shard
        self._entries: list[_Entry] = []
        self._held: list[tuple[str, torch.Tensor]] = []
        self._size = 0

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._data is not None:
            self._data.close()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"Tensor {name!r} written twice")
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"Tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        self._names.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._size and self._size + nbytes > self.max_shard_bytes:
            self._finish_shard()
        self._size += nbytes
        self.total_size += nbytes
        if nbytes % 8:
            self._held.append((name, tensor))
        else:
            self._write(name, tensor)

    def _scratch_path(self) -> Path:
        """The current shard's file until `close` gives it its final name."""
        return self.directory / f".shard-{len(self.shards)}.safetensors"

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        if self._data is None:
            self._data = open(self._scratch_path(), "w+b")
            self._data.seek(8 + self.HEADER_RESERVE)
        begin = self._data.tell() - 8 - self.HEADER_RESERVE
        if tensor.numel():
            self._data.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        end = begin + tensor.numel() * tensor.element_size()
        self._entries.append((name, _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), begin, end))

    def _finish_shard(self) -> None:
        for name, tensor in self._held:
            self._write(name, tensor)
        self._held = []
        if self._data is None:
            return
        blob = _header_blob(self._entries)
        path = self._scratch_path()
        if len(blob) <= self.HEADER_RESERVE:  # the header fits the room left before the data: write it there
            self._data.seek(0)
            self._data.write(struct.pack("<Q", self.HEADER_RESERVE))
            self._data.write(blob + b" " * (self.HEADER_RESERVE - len(blob)))
            self._data.close()
        else:  # too many tensors for the reserve: header first, then the data copied behind it in chunks
            self._data.close()
            moved = path.with_suffix(".data")
            os.rename(path, moved)
            with open(moved, "rb") as data, open(path, "wb") as out:
                out.write(struct.pack("<Q", len(blob)))
                out.write(blob)
                data.seek(8 + self.HEADER_RESERVE)
                shutil.copyfileobj(data, out, 16 * 1024 * 1024)
            os.unlink(moved)
        self.shards.append((path, [e[0] for e in self._entries]))
        self._data, self._entries, self._size = None, [], 0

    def close(self) -> list[Path]:
        """Finish the last shard, give the shards their final names, write the index; returns the files."""
        self._finish_shard()
        if not self.shards:
            raise ValueError("ShardedWriter closed without any tensor")
        if len(self.shards) == 1:
            final = self.directory / SINGLE_FILE
            self.shards[0][0].rename(final)
            return [final]
        n = len(self.shards)
        weight_map, files = {}, []
        for k, (path, names) in enumerate(self.shards):
            final = self.directory / f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files


class SpilledLayers(MutableMapping):
    """New attention tensors per layer ("q_proj.weight", ... of `model.layers.i.self_attn`), kept on disk:
    layer i is written to `directory`/layer-i.safetensors in the dtype of the tensor it replaces (`index`:
    name -> TensorInfo of the checkpoint being rewritten; what the save casts to anyway) and read back on
    access, the last layer read cached (calibrated GQA's fits, refinement's refitted layers). None entries
    (absent biases) are not stored and read back as absent (`.get` gives None)."""

    def __init__(self, directory: Path, index: dict[str, TensorInfo]) -> None:
        self.directory, self.index = Path(directory), index
        self._layers: set[int] = set()
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def _path(self, layer: int) -> Path:
        return self.directory / f"layer-{layer}.safetensors"

    def __setitem__(self, layer: int, tensors: dict[str, torch.Tensor | None]) -> None:
        kept = {}
        for key, tensor in tensors.items():
            if tensor is not None:
                dtype = self.index[f"model.layers.{layer}.self_attn.{key}"].dtype
                kept[key] = tensor.to(device="cpu", dtype=dtype).contiguous()
        save_file(kept, str(self._path(layer)))
        self._layers.add(layer)
        self._cached = None

    def __getitem__(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self._layers:
            raise KeyError(layer)
        if self._cached is None or self._cached[0] != layer:
            self._cached = None  # drop the previous layer before reading the next
            self._cached = (layer, load_file(str(self._path(layer))))
        return self._cached[1]

    def __delitem__(self, layer: int) -> None:
        self._layers.remove(layer)
        self._path(layer).unlink()
        self._cached = None

    def __iter__(self):
        return iter(sorted(self._layers))

    def __len__(self) -> int:
        return len(self._layers)
