"""How much a per-KV-head RoPE allocation could gain over the per-layer one (docs/research/mla-allocation.md).

    python -m benchmarks.experiments.mla_per_head_bound [TOKENS]

One `attention` calibration of the embedded SmolLM2 on the default calibration text (as `hf-attn convert mla`
does), then, at each mean r, the share of the summed pair score (the attention-score error of a lost
rotation) that is dropped by: the same r everywhere (`uniform`), r per layer (`greedy`, the converter's
default), and r per (layer, KV head) under the same total, which `llama_mla`'s format cannot hold (one RoPE
width per layer). Both greedy allocations are `allocation.greedy_allocate` optima (at least one pair each).
"""

import sys

import torch

from hf_attn.conversion import mla
from hf_attn.conversion.checkpoint.io import open_source
from hf_attn.conversion.mla import ranks as alloc
from hf_attn.conversion.specs import DEFAULT_CALIBRATION_TOKENS, CalibrationSpec

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CALIBRATION_TOKENS
source = open_source(None)
L, H = source.geometry.num_layers, source.geometry.num_kv_heads
calibration = mla.calibrate(
    src_dir=source.dir,
    geometry=source.geometry,
    moments=False,
    pair_norms=False,
    calibration=CalibrationSpec(tokens=tokens),
)
ranked = [
    torch.sort(calibration.pair_scores["attention"][i].double(), 1, descending=True).values for i in range(L)
]
total = sum(float(s.sum()) for s in ranked)  # ranked[i]: (Hkv, d/2), each head's scores best first


def dropped(counts: list[list[int]]) -> float:
    """Share of the summed score lost when head h of layer i keeps its counts[i][h] best pairs."""
    return 1 - sum(float(ranked[i][h, :n].sum()) for i in range(L) for h, n in enumerate(counts[i])) / total


print("| mean r | uniform | per layer (greedy) | per KV head |\n|---:|---:|---:|---:|")
for r in (12, 8, 6, 4, 3, 2):
    per_layer = alloc.allocate_pairs(
        [calibration.pair_scores["attention"][i] for i in range(L)], total_pairs=L * r
    )
    gains = [ranked[i][h, 1:] for i in range(L) for h in range(H)]  # one "layer" per (layer, head)
    per_head = alloc.greedy_allocate(gains, minimum=[1] * (L * H), budget=L * H * r)
    rows = (
        [[r] * H for _ in range(L)],
        [[n] * H for n in per_layer],
        [per_head[i * H : (i + 1) * H] for i in range(L)],
    )
    print(f"| {r} | " + " | ".join(f"{dropped(c):.3f}" for c in rows) + " |")
