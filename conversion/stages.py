"""Where a conversion's time goes: wall seconds per stage, each stage counted without the stages inside it.

    with stages.recording() as seconds:        # stage name -> seconds, filled in as the work runs
        with stages.stage("calibration forward"):
            ...                                # counted to "calibration forward"
            with stages.stage("statistics"):
                ...                            # counted to "statistics" only
    seconds == {"calibration forward": 1.2, "statistics": 0.4}

The converters and the refinement mark their stages (STAGES) unconditionally; outside `recording` a stage
costs one check. Recordings nest: an inner one starts empty and, when it ends, adds its seconds to the one
around it, so each conversion record carries its own stages (`"stage_seconds"`) and the command's total is
their sum. Time spent outside every stage of a recording is counted to "other".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# the stages the conversion code marks, in pipeline order
STAGES = (
    "read",  # weights read from the checkpoints (one decoder layer at a time)
    "calibration forward",  # the source's layer-by-layer forward over the calibration text
    "statistics",  # what the closed forms accumulate from each window's attention input
    "fit",  # the closed-form fits: pooling, RoPE choice, allocation, factorization
    "refine targets",  # the source layer's output on its own stream (once per layer)
    "refine forward",  # the converted layer's forward in the refinement steps
    "refine backward",  # ... its backward
    "refine update",  # the optimizer's steps and the closed-form output refit
    "refine error",  # the before/after error over the calibration windows, and the stream carried on
    "write",  # output tensors streamed into shards (reading what is copied as is)
)
OTHER = "other"

_active: list[dict[str, float]] = []  # open recordings, innermost last
_running: list[list] = []  # open stages: [name, start of the part not yet counted]


def _charge(now: float) -> None:
    """Count the time since the innermost open stage last resumed to it, in the innermost recording."""
    if _running and _active:
        name, since = _running[-1]
        _active[-1][name] = _active[-1].get(name, 0.0) + now - since
        _running[-1][1] = now


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the block's wall time to `name` (minus the stages opened inside it)."""
    if not _active:
        yield
        return
    now = time.perf_counter()
    _charge(now)
    _running.append([name, now])
    try:
        yield
    finally:
        _charge(time.perf_counter())
        _running.pop()
        if _running:
            _running[-1][1] = time.perf_counter()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """A dict stage -> seconds of the work inside the block (see the module docstring)."""
    now = time.perf_counter()
    _charge(now)
    seconds: dict[str, float] = {}
    _active.append(seconds)
    _running.append([OTHER, now])
    depth = len(_running)
    try:
        yield seconds
    finally:
        del _running[depth:]  # (stages left open by an exception)
        _charge(time.perf_counter())
        _running.pop()
        _active.pop()
        if _active:
            for name, value in seconds.items():
                _active[-1][name] = _active[-1].get(name, 0.0) + value
        if _running:
            _running[-1][1] = time.perf_counter()


def snapshot() -> dict[str, float]:
    """The innermost recording so far, `rounded` (the stage running now counted up to now); {} outside."""
    if not _active:
        return {}
    _charge(time.perf_counter())
    return rounded(_active[-1])


def rounded(seconds: dict[str, float]) -> dict[str, float]:
    """The stages of a recording in STAGES order ("other" last), to 0.01 s, the empty ones left out."""
    order = [*STAGES, OTHER] + sorted(set(seconds) - {*STAGES, OTHER})
    return {name: round(seconds[name], 2) for name in order if seconds.get(name, 0.0) >= 0.005}
