"""The work of each conversion stage (FLOPs or bytes) and this machine's rates for it (`benchmarks.stages`).

Notation (one decoder layer): E hidden size, F intermediate size, Hq query heads, d head dim, T tokens per
window, P_attn / P_mlp the attention / MLP parameters (the converted layer's attention has its own P_attn').
One token through a layer costs

    fwd(P_attn) = 2 (P_attn + P_mlp) + 2 Hq d T   (the matmuls, and QK^T and PV over T/2 causal keys)
    att(P_attn) = 2 P_attn + 2 Hq d T              (the attention half alone)

and a backward twice the forward of what it trains (weights and inputs) plus once what it only passes
through (the MLP, frozen: input gradients). Per stage, with L layers, N_c calibration and N_r refinement
tokens, S steps of one window each:

    calibration forward   N_c L fwd(P_attn)
    statistics (MLA)      N_c L 2 (E + 1)^2 (the float64 moment) + the attention pair scores: per window
                          2 Hq (T / 16) T 14 (d / 2) (every 16th query, 14 products per pair)
    statistics (GQA)      per window: 2 T E (Hq + 2 Hkv) d + 2 Hq T^2 d + 2 G (n r) T^2 (r d)
                          + 2 G (n r) T (r d)^2  (n = Hq / Hkv, r = Hkv / G)
    refine targets        N_r L fwd(P_attn)  (the source layer)
    refine forward        S T L att(P_attn')  (target "attention"; "layer": fwd(P_attn'))
    refine backward       S T L 2 att(P_attn')  (target "layer": + 2 P_mlp T)
    refine error          L (N_k (att(P_attn') or fwd(P_attn')) before, N_r fwd(P_attn') after), N_k the
                          tokens of the windows the keep rule reads (every KEEP_WINDOW_STRIDE-th)
    refine update         refit: 2 N_r L (att(P_attn') + 2 w^2) + 2 L w^3 / 3, w = Hq d (+1 with a bias)
    read, write           bytes: the layers read / the checkpoint read and written

The fits (eigendecompositions, alternating least squares) are not counted ("fit": no bound). Rates: fp32
(and fp64) matmul GFLOP/s at the model's shapes, memory GB/s of a large copy, file write (with fsync) and read
GB/s, measured once with the threads torch uses.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_attn.conversion.refine_fit import KEEP_WINDOW_STRIDE

QUERY_STRIDE = 16  # conversion.mla.rope_selection.QUERY_STRIDE: the attention pair scores' query subsample


@dataclass(frozen=True)
class Rates:
    """This machine's measured rates (`measure_rates`)."""

    fp32_gflops: float
    fp64_gflops: float
    memory_gbs: float
    write_gbs: float
    read_gbs: float
    threads: int


def _best_seconds(fn, repeat: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """GFLOP/s of (m, k) @ (k, n) in `dtype` (best of 5)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / _best_seconds(lambda: a @ b) / 1e9


def measure_rates(*, hidden: int, intermediate: int, workdir: Path, file_mb: int = 256) -> Rates:
    """Rates at a layer's shapes: (1024, E) @ (E, F) in fp32 and (E + 1, 1024) @ (1024, E + 1) in fp64 (the
    moment), a 256 MB copy, and a file of `file_mb` MB written (fsync) and read back in `workdir`."""
    fp32 = matmul_gflops(1024, hidden, intermediate, torch.float32)
    fp64 = matmul_gflops(hidden + 1, 1024, hidden + 1, torch.float64)
    src = torch.empty(64 * 1024**2, dtype=torch.float32)  # 256 MB
    dst = torch.empty_like(src)
    memory = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeat=3) / 1e9
    payload = os.urandom(1024**2) * file_mb
    path = Path(workdir) / ".rates-probe"
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        write = len(payload) / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        read = len(path.read_bytes()) / (time.perf_counter() - start) / 1e9
    finally:
        path.unlink(missing_ok=True)
    return Rates(fp32, fp64, memory, write, read, torch.get_num_threads())


@dataclass(frozen=True)
class Shape:
    """What the work model reads from a config and the checkpoints (per decoder layer)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    attn_params: int  # the source layer's attention parameters
    layer_bytes: int  # one source decoder layer's weights in its file dtype

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def attention(self, attn_params: int, window: int) -> float:
        """att(P_attn) per token."""
        return 2 * attn_params + 2 * self.heads * self.head_dim * window

    def forward(self, attn_params: int, window: int) -> float:
        """fwd(P_attn) per token."""
        return self.attention(attn_params, window) + 2 * self.mlp_params


def statistics_flops(shape: Shape, kind: str, tokens: int, window: int, kv_to: int | None) -> float:
    """The statistics stage of the closed form (see the module docstring); kind "mla" or "gqa"."""
    s, windows = shape, tokens / window
    if kind == "mla":
        pairs = 2 * s.heads * (window / QUERY_STRIDE) * window * 14 * (s.head_dim / 2)
        return s.layers * (tokens * 2 * (s.hidden + 1) ** 2 + windows * pairs)
    g = kv_to or 1
    r, n, d = s.kv_heads // g, s.heads // s.kv_heads, s.head_dim
    per_window = (
        2 * window * s.hidden * (s.heads + 2 * s.kv_heads) * d
        + 2 * s.heads * window**2 * d
        + 2 * g * (n * r) * window**2 * (r * d)
        + 2 * g * (n * r) * window * (r * d) ** 2
    )
    return s.layers * windows * per_window


def refine_flops(shape: Shape, refine: dict, conv_attn_params: int) -> dict[str, float]:
    """The refinement's stages from its record's settings (steps, tokens, target, refit)."""
    s, cfg = shape, refine["settings"]
    tokens, window = refine["calibration"]["tokens"], min(1024, refine["calibration"]["tokens"])
    steps, target = cfg["steps"], cfg.get("target", "layer")
    att, fwd = s.attention(conv_attn_params, window), s.forward(conv_attn_params, window)
    step = att if target == "attention" else fwd
    backward = 2 * att + (2 * s.mlp_params if target != "attention" else 0)
    width = s.heads * s.head_dim
    checked = -(-max(1, tokens // window) // KEEP_WINDOW_STRIDE) * window  # N_k
    refit = 2 * (tokens * (att + 2 * width**2) + 2 * width**3 / 3) if cfg.get("refit") else 0.0
    return {
        "refine targets": tokens * s.layers * s.forward(s.attn_params, window),
        "refine forward": steps * window * s.layers * step,
        "refine backward": steps * window * s.layers * backward,
        "refine error": s.layers * (checked * (att if target == "attention" else fwd) + tokens * fwd),
        "refine update": refit * s.layers,
    }


def stage_work(shape: Shape, records: list[dict], conv: dict) -> dict[str, tuple[float, str]]:
    """stage -> (work, unit "flop" | "fp64 flop" | "byte") of a conversion's records (closed form first,
    then the refinement if any); conv: {"attn_params": P_attn' per layer, "layer_bytes", "bytes" (the
    output's weights), "source_bytes"}."""
    closed, refined = records[0], (records[1] if len(records) > 1 else None)
    cal = closed.get("calibration") or {}
    tokens, window = cal.get("tokens", 0), cal.get("window", 1024)
    out: dict[str, tuple[float, str]] = {}
    if tokens:
        out["calibration forward"] = (
            tokens * shape.layers * shape.forward(shape.attn_params, window),
            "flop",
        )
        kv_to = (closed.get("num_key_value_heads") or {}).get("to")
        unit = "fp64 flop" if closed["kind"] == "mla" else "flop"
        out["statistics"] = (statistics_flops(shape, closed["kind"], tokens, window, kv_to), unit)
    read = shape.layers * shape.layer_bytes
    written = conv["bytes"] + conv["source_bytes"]  # what the closed form reads and writes whole
    if refined is not None:
        out.update({k: (v, "flop") for k, v in refine_flops(shape, refined, conv["attn_params"]).items()})
        read += shape.layers * (shape.layer_bytes + conv["layer_bytes"])
        written += 2 * conv["bytes"]
    out["read"] = (float(read), "byte")
    out["write"] = (float(written), "byte")
    return out


def bound_seconds(work: float, unit: str, rates: Rates, stage: str) -> float:
    """Seconds the work takes at the machine's rate for it (bytes: written at the write rate, read at the
    read rate, half each for the write stage, which reads what it copies)."""
    if unit == "flop":
        return work / (rates.fp32_gflops * 1e9)
    if unit == "fp64 flop":
        return work / (rates.fp64_gflops * 1e9)
    if stage == "write":
        return work / 2 / (rates.write_gbs * 1e9) + work / 2 / (rates.read_gbs * 1e9)
    return work / (rates.read_gbs * 1e9)
