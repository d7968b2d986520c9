"""torch's CPU threads on a shared machine: as many as the cores other processes leave free.

torch runs each CPU operation on its intra-op (OpenMP) threads, which meet at a barrier when the operation
ends. When another process holds one of the cores, every operation waits at that barrier for the thread that
lost its core, and the waiting threads spin, taking CPU time from both processes: a layer-by-layer
conversion with 2 threads on 2 cores beside one busy process ran several times slower than with 1 thread.
`CoreShare.update()`, called between layers, therefore sets the thread count to the cores the other
processes did not use since the previous call,

    others  = (busy CPU seconds of the whole machine - CPU seconds of this process) / wall seconds
    threads = clamp(round(cores - others), 1, limit)

busy seconds from /proc/stat, this process's from `time.process_time()` (all its threads), `cores` the CPUs
this process may run on and `limit` the thread count torch had when the share was made (what
OMP_NUM_THREADS or `torch.set_num_threads` chose: never more). Where /proc/stat is missing the threads stay
as they are. Only CPU threads change: a GPU computes as before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

MIN_INTERVAL_S = 0.5  # shorter intervals than this are not measured (the counters tick in 1/100 s)
PROBE_S = 0.3  # on entry: how long the other processes' load is measured before the first layer


@dataclass(frozen=True)
class _Sample:
    wall: float  # time.perf_counter()
    busy: float  # busy CPU seconds of the machine since boot
    own: float  # CPU seconds of this process


def _sample() -> _Sample | None:
    """Now, with the busy CPU seconds of every core since boot (the first line of /proc/stat); None where
    that is unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    busy = (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")
    return _Sample(time.perf_counter(), busy, time.process_time())


def available_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def threads_for(others: float, *, cores: int, limit: int) -> int:
    """The thread count for `others` cores busy with other processes: round(cores - others) in [1, limit]."""
    return max(1, min(limit, int(cores - others + 0.5)))


class CoreShare:
    """Keeps torch's CPU threads at the cores other processes leave free (see the module docstring); use as
    a context manager (on entry the load is measured for PROBE_S, on exit the thread count it found is
    restored) and call `update()` between layers."""

    def __init__(self) -> None:
        self.limit = torch.get_num_threads()
        self.cores = available_cores()
        self.counts: list[int] = []  # the thread count chosen at each update
        self._last = _sample()

    def __enter__(self) -> CoreShare:
        time.sleep(PROBE_S)  # (this process idle: what the others use)
        self.update(min_interval=PROBE_S / 2)
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.limit)

    def update(self, *, min_interval: float = MIN_INTERVAL_S) -> int:
        """Measure the other processes' load since the last update and set the threads; returns them."""
        now = _sample()
        threads = torch.get_num_threads()
        if now is not None and self._last is not None and now.wall - self._last.wall >= min_interval:
            wall = now.wall - self._last.wall
            others = max(0.0, (now.busy - self._last.busy) - (now.own - self._last.own)) / wall
            threads = threads_for(others, cores=self.cores, limit=self.limit)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            self._last = now
        self.counts.append(threads)
        return threads
