"""Scramble the heads of an MHA checkpoint (seeded permutation per layer; same function)."""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.gqa.grouping import permute_layer

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
for f in src.iterdir():
    if f.suffix != ".safetensors":
        shutil.copy(f, dst / f.name)
config = json.loads((src / "config.json").read_text())
geo = AttentionGeometry.from_config(config)
gen = torch.Generator().manual_seed(0)
perms = [torch.randperm(geo.num_kv_heads, generator=gen).tolist() for _ in range(geo.num_layers)]
for f in src.glob("*.safetensors"):
    t = load_file(f)
    for l, perm in enumerate(perms):
        pre = f"model.layers.{l}.self_attn."
        w = {k[len(pre) :]: v for k, v in t.items() if k.startswith(pre)}
        if w:
            for k, v in permute_layer(w, perm, geo).items():
                t[pre + k] = v
    save_file(t, dst / f.name, metadata={"format": "pt"})
print(perms[:3])
