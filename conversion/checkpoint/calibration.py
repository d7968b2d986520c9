"""Calibration text and attention-layer inputs, shared by the calibrated converters (GQA pooling, MLA).

The text: `calibration_ids` (default: the `mix` corpus, five Austen novels and five sections of the Python
3.11 documentation; *Persuasion* and the Python FAQ are kept for evaluation), `source_ids` in a checkpoint's
tokenizer (how the converters and the refinement read it). The statistic a calibration pass
(`layerwise.LayerwiseModel.for_each_attention_input`) usually accumulates is `augmented_moment` M, from
which every second moment of q, k and v (with biases) follows: E[k k^T] = [W_k | b_k] M [W_k | b_k]^T / N.
Memory: (C + 1)^2 float64 per layer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from hf_attn.conversion.specs import CalibrationSpec
from hf_attn.tooling import assets, loading
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import sha256_file

_CHARS_PER_TOKEN_GUESS = 8  # tokenize this many characters per wanted token first (then all, if too few)


def default_calibration_files() -> list[Path]:
    """The default calibration text (`CalibrationSpec().files()`), never an evaluation text."""
    files = CalibrationSpec().files()
    evaluation = {p.resolve() for p in assets.embedded_eval_files()}
    assert not evaluation & {p.resolve() for p in files}, "calibration text overlaps evaluation text"
    return files


def file_shares(files: list[Path], tokens: int) -> dict[Path, int]:
    """How many of `tokens` each distinct file gives: shares proportional to how often the file is listed
    (equal shares for a list without repeats), the remainder one token each to the first files listed."""
    counts = Counter(files)
    shares = {f: tokens * c // len(files) for f, c in counts.items()}
    for f in list(counts)[: tokens - sum(shares.values())]:
        shares[f] += 1
    return shares


def as_calibration(calibration: CalibrationSpec | Iterable[str | os.PathLike] | None) -> CalibrationSpec:
    """`calibration` as a CalibrationSpec: a spec as it is, a list of files as its `text` (checked there, the
    one check of calibration files), None as the default (the `mix` corpus)."""
    if isinstance(calibration, CalibrationSpec):
        return calibration
    if calibration is None:
        return CalibrationSpec()
    files = tuple(str(f) for f in calibration)
    if not files:
        raise UserError("No calibration text files given")
    return CalibrationSpec(text=files)


def calibration_ids(
    tokenizer,
    calibration: CalibrationSpec | Iterable[str | os.PathLike] | None = None,
    tokens: int | None = None,
) -> torch.LongTensor:
    """`tokens` ids (default: the spec's `tokens`), (tokens,), from the start of each distinct file of
    `calibration` (`as_calibration`) in the shares of `file_shares` (a file listed k times gives k shares,
    contiguous; no special tokens added)."""
    if tokens is not None and tokens <= 0:
        raise UserError(f"--calibration-tokens must be positive, got {tokens}")
    spec = as_calibration(calibration)
    tokens = spec.tokens if tokens is None else tokens
    shares = file_shares(spec.files(), tokens)
    pieces, available = [], 0
    for path, share in shares.items():
        text = Path(path).read_text(encoding="utf-8")
        ids = tokenizer(text[: share * _CHARS_PER_TOKEN_GUESS], add_special_tokens=False)["input_ids"]
        if len(ids) < share:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces.append(torch.tensor(ids[:share], dtype=torch.long))
        available += len(ids)
    out = torch.cat(pieces)
    if len(out) < tokens:
        raise UserError(
            f"The calibration text has too few tokens: asked for {tokens}, the {len(shares)} file(s) give "
            f"{len(out)} in their shares ({available} in all); pass fewer --calibration-tokens or more text."
        )
    return out


def source_ids(model_dir: Path, calibration: CalibrationSpec, tokens: int | None = None) -> torch.LongTensor:
    """`calibration_ids` of `calibration` in the tokenizer of the checkpoint at `model_dir`: (tokens,)."""
    return calibration_ids(loading.load_tokenizer(model_dir), calibration, tokens)


def calibration_record(calibration: CalibrationSpec, tokens: int) -> dict:
    """The calibration text as a conversion record states it: the spec's file names and sha256, `tokens` and
    the window."""
    files = [{"name": Path(f).name, "sha256": sha256_file(f)} for f in calibration.files()]
    return {"files": files, "tokens": tokens, "window": calibration.window}


def augmented_moment(x: torch.Tensor) -> torch.Tensor:
    """sum_t [x_t; 1][x_t; 1]^T in float64: x (..., C) -> M (C + 1, C + 1).

    The last row/column holds sum x and the token count, so biases are covered: for a projection W (out, C)
    with bias b, sum_t (W x_t + b)(W x_t + b)^T = [W | b] M [W | b]^T.
    """
    x = x.reshape(-1, x.shape[-1]).double()  # (N, C)
    xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # (N, C + 1)
    return xa.T @ xa  # (C + 1, C + 1)


def causal_probabilities(
    q_rot: torch.Tensor, k_rot: torch.Tensor, query_positions: torch.Tensor, *, window: int | None
) -> torch.Tensor:
    """The source's attention probabilities on one calibration window, as statistics need them.

    q_rot (Tq, Hkv, G, d): post-RoPE queries at `query_positions` (Tq,), grouped by the KV head they read;
    k_rot (T, Hkv, d): post-RoPE keys of every position (the same dimension order as the queries);
    window: the layer's sliding window (None: full causal) -> p (Hkv, G, Tq, T), scale d**-0.5."""
    T, d = k_rot.shape[0], k_rot.shape[-1]
    scores = torch.einsum("tgjd,sgd->gjts", q_rot, k_rot) * d**-0.5  # (Hkv, G, Tq, T)
    s_pos = torch.arange(T)
    keep = query_positions[:, None] >= s_pos[None]  # (Tq, T)
    if window is not None:
        keep &= query_positions[:, None] - s_pos[None] < window
    return scores.masked_fill(~keep, float("-inf")).softmax(-1)  # (Hkv, G, Tq, T)
