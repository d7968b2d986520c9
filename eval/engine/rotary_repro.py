"""Minimal reproduction: vLLM's CPU rotary op mis-rotates a 3-D (tokens, heads, rot_dim) query.

Runs in the vLLM environment (imports only torch, vllm and the standard library):

    .venv-engine/bin/python eval/engine/rotary_repro.py        # prints one JSON line; exit 0

vLLM's DeepSeek MLA layer (`vllm/model_executor/layers/mla.py`) rotates the (T, H, R) RoPE slice of its query
in place; on CPU, `torch.ops._C.rotary_embedding` reads any query as (tokens, heads · head_size), so for a 3-D
query it rotates only the first T heads of the flattened (T·H, R) view, head i with positions[i] (the cause in
full: docs/vllm-cpu-rotary-bug.md). A 2-D (T, H·R) query (Llama's layout) and the (T, 1, R) key are right. The
reproduction compares `forward_cpu` with `forward_native` (vLLM's PyTorch implementation, the same math) on:

- `mla_slice`: q[..., nope:] of a (T, H, nope + R) query, exactly what the MLA layer passes (the bug);
- `contiguous_3d`: a contiguous (T, H, R) query (the bug too: contiguity is not the cause, the 3-D shape is);
- `flat_2d`: the same numbers as (T, H·R) (right: the control).
"""

from __future__ import annotations

import json

TOKENS, HEADS, NOPE, ROPE = 5, 3, 16, 8
TOLERANCE = 1e-5  # fp32, |x| ~ 1: the same math agrees to rounding


def _rope():
    """vLLM's rotary embedding of a DeepSeek export (interleaved pairs: is_neox_style False), CPU, fp32."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            ROPE,
            max_position=4096,
            is_neox_style=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            dtype=torch.float32,
        )


def _max_diff(rope, positions, query, key) -> float:
    """max |forward_cpu - forward_native| over the rotated query and key (forward_cpu works in place)."""
    ref_q, ref_k = rope.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = rope.forward_cpu(positions, query, key)
    return max((got_q - ref_q).abs().max().item(), (got_k - ref_k).abs().max().item())


def probe() -> dict:
    """{layout: max |custom op - native|} for the three layouts, versions, and `bug` (mla_slice wrong)."""
    import torch
    import vllm

    rope = _rope()
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(TOKENS) + 100  # (T,)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=g)  # (T, H, nope + R)
    k = torch.randn(TOKENS, 1, ROPE, generator=g)  # (T, 1, R): one shared key, as in MLA
    diffs = {
        "mla_slice": _max_diff(rope, positions, q.clone()[..., NOPE:], k.clone()),
        "contiguous_3d": _max_diff(rope, positions, q[..., NOPE:].contiguous(), k.clone()),
        "flat_2d": _max_diff(
            rope, positions, q[..., NOPE:].reshape(TOKENS, HEADS * ROPE), k.view(TOKENS, ROPE)
        ),
    }
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "shape": {"tokens": TOKENS, "heads": HEADS, "nope": NOPE, "rope": ROPE},
        "max_abs_diff": diffs,
        "tolerance": TOLERANCE,
        "bug": diffs["mla_slice"] > TOLERANCE,
    }


if __name__ == "__main__":
    print(json.dumps(probe()))
