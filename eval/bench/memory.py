"""Peak memory of a block of code: the one home of the benchmarks' `/proc` readings.

On Linux the kernel keeps the resident set size (`VmRSS`) and its high-water mark (`VmHWM`) in
/proc/self/status; writing "5" to /proc/self/clear_refs resets the mark to the current RSS, so the peak of a
block is VmHWM read after it. Where that reset is impossible the process-lifetime `ru_maxrss` is the fallback
(marked as such). On CUDA the peak is `torch.cuda.max_memory_allocated`, reset before the block.
Used by `hf-attn bench decode` (in process) and `python -m benchmarks.stream` (in its fresh child processes).
"""

from __future__ import annotations

import resource
from pathlib import Path

HWM_RESET = "peak RSS (VmHWM, reset before the measurement)"
LIFETIME = "peak RSS (ru_maxrss, whole process lifetime)"


def status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (`VmRSS`, `VmHWM`) in bytes; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the resident high-water mark (VmHWM) to the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Peak memory of this process over a `with` block: RSS high-water mark on CPU, allocated bytes on CUDA.

    After the block: `before` (bytes in use at its start), `peak` (bytes) and `method` (how it was read)."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)).startswith("cuda")

    def __enter__(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            self.method = "torch.cuda.max_memory_allocated"
            return self
        self.before = status_bytes("VmRSS")
        self.method = HWM_RESET if reset_peak_rss() else LIFETIME
        return self

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:  # VmHWM, or the process-lifetime ru_maxrss where /proc has none
            hwm = status_bytes("VmHWM")
            self.peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False
