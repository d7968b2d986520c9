"""`conversion.stages` (seconds per stage, nested stages counted once) and `conversion.checkpoint.threads`
(torch's CPU threads from the other processes' load), against a hand-driven clock and hand-computed thread
counts."""

from __future__ import annotations

import pytest
import torch

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint import threads


class Clock:
    """A perf_counter that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(stages.time, "perf_counter", fake)
    return fake


def test_nested_stages_count_their_own_time_once(clock):
    with stages.recording() as seconds:
        clock.tick(1)  # outside every stage: "other"
        with stages.stage("calibration forward"):
            clock.tick(2)
            with stages.stage("statistics"):
                clock.tick(3)
            clock.tick(4)
        with stages.stage("write"):
            clock.tick(5)
            with stages.stage("fit"):
                clock.tick(6)
            snapshot = stages.snapshot()  # while "write" runs: counted up to now
    assert seconds == {"other": 1, "calibration forward": 6, "statistics": 3, "write": 5, "fit": 6}
    assert snapshot == {"calibration forward": 6, "statistics": 3, "fit": 6, "write": 5, "other": 1}
    assert list(stages.rounded(seconds)) == ["calibration forward", "statistics", "fit", "write", "other"]


def test_inner_recording_adds_to_the_outer_one_and_nothing_outside_a_recording(clock):
    with stages.stage("fit"):  # no recording: nothing counted, nothing kept
        clock.tick(7)
    assert stages.snapshot() == {}
    with stages.recording() as outer:
        with stages.stage("read"):
            clock.tick(1)
            with stages.recording() as inner:
                with stages.stage("refine forward"):
                    clock.tick(2)
                clock.tick(3)  # inside the inner recording, outside its stages
            clock.tick(4)
    assert inner == {"refine forward": 2, "other": 3}
    assert outer == {"read": 5, "refine forward": 2, "other": 3}


def test_a_stage_left_by_an_exception_is_closed(clock):
    with stages.recording() as seconds:
        with pytest.raises(RuntimeError):
            with stages.stage("statistics"):
                clock.tick(2)
                raise RuntimeError("stop")
        clock.tick(1)
    assert seconds == {"statistics": 2, "other": 1}


@pytest.mark.parametrize(
    "others,cores,limit,want",
    [
        (0.0, 2, 2, 2),
        (0.4, 2, 2, 2),
        (0.67, 2, 2, 1),
        (1.0, 2, 2, 1),
        (3.5, 2, 2, 1),
        (0.0, 8, 4, 4),
        (2.2, 8, 8, 6),
    ],
)
def test_threads_are_the_cores_the_others_leave(others, cores, limit, want):
    assert threads.threads_for(others, cores=cores, limit=limit) == want


def test_core_share_follows_the_load_and_restores_the_thread_count(monkeypatch):
    samples = iter(
        [
            threads._Sample(wall=0.0, busy=0.0, own=0.0),
            threads._Sample(wall=1.0, busy=1.9, own=0.9),  # others busy 1.0 core-second in 1 s: 1 thread
            threads._Sample(wall=2.0, busy=2.9, own=1.8),  # others 0.1: both threads
        ]
    )
    monkeypatch.setattr(threads, "_sample", lambda: next(samples))
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads, "PROBE_S", 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads.CoreShare() as share:
            assert torch.get_num_threads() == 1
            assert share.update() == 2 and torch.get_num_threads() == 2
            torch.set_num_threads(1)
        assert torch.get_num_threads() == 2 and share.counts == [1, 2]
    finally:
        torch.set_num_threads(before)
