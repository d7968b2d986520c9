"""vLLM's CPU rotary bug, pinned (docs/vllm-cpu-rotary-bug.md): `eval/engine/rotary_repro.py` runs in the
engine environment and compares vLLM's rotary custom op with vLLM's own native implementation.

- The control (a 2-D query, Llama's layout) must agree: otherwise the reproduction itself is broken.
- The MLA query slice is expected to disagree (xfail, strict) while the bug is there. When a newer vllm-cpu
  fixes it, the strict xfail turns into a FAILURE that says so: then drop the workaround
  (`worker.ROTARY_WORKAROUND`, applied only when the probe reports the bug) and this expectation.
"""

from __future__ import annotations

import pytest
from test_engine import engine_or_skip

from hf_attn.eval.engine import environment as env


@pytest.fixture(scope="module")
def repro():
    info = engine_or_skip()
    return env.run_rotary_repro(python=info.python)


def test_control_layout_agrees(repro):
    """(T, H * rot_dim), the layout Llama-family models pass: the custom op is right there."""
    assert repro["max_abs_diff"]["flat_2d"] <= repro["tolerance"], repro


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32.0: the CPU rotary op reads a 3-D (tokens, heads, rot_dim) query as 2-D and "
    "mis-rotates the MLA query; engine-check applies compilation_config custom_ops -rotary_embedding. "
    "XPASS means the installed vllm-cpu fixed it: remove the workaround and this xfail",
)
def test_mla_query_slice_rotated_like_native(repro):
    assert repro["max_abs_diff"]["mla_slice"] <= repro["tolerance"], repro
    assert repro["max_abs_diff"]["contiguous_3d"] <= repro["tolerance"], repro


def test_probe_and_workaround_agree(repro):
    """The probe says bug exactly when the MLA slice disagrees; the worker applies the workaround then."""
    from hf_attn.eval.engine import worker

    assert repro["bug"] == (repro["max_abs_diff"]["mla_slice"] > repro["tolerance"])
    assert worker.ROTARY_WORKAROUND == {"custom_ops": ["-rotary_embedding"]}
