"""Where a command computes: the one `--device` rule of every command (`resolve_device`; `DEVICES`,
`DEFAULT_DEVICE` and `DEVICE_HELP` are the choices, default and help of every `--device` flag), and the one
line that says where. Under `accelerate launch` the accelerator places each process (`cuda:<local rank>`):
commands that run through an `Accelerator` resolve `--device` only to decide whether it runs on the CPU, and
then use the accelerator's device.

A command says where it runs once, on stderr (`announce_device`: `hf-attn convert mla: device cpu`), when a
stage first puts work on a device, after every input check so that a bad input stays one line; `run_command`
opens the scope (`announcing`): tests, notebooks and library callers get no such line. A bfloat16 option on
a device that emulates bfloat16 gets one warning line the same way (`warn_emulated_bfloat16`).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hf_attn.tooling.errors import UserError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")  # the choices of every --device flag
DEFAULT_DEVICE = "auto"
DEVICE_HELP = "auto: CUDA where torch sees it, else the CPU; cpu or cuda forces one"


def resolve_device(name: str = DEFAULT_DEVICE, *, flag: str = "--device") -> torch.device:
    """The device `name` asks for: "auto" -> cuda where `torch.cuda.is_available()`, else cpu; "cpu";
    "cuda" or "cuda:N" (UserError naming the value and the fix when torch sees no such CUDA device)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, colon, index = str(name).partition(":")
    if name == "cpu":
        return torch.device("cpu")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise UserError(f"Unknown {flag} {name!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")
    if not torch.cuda.is_available():
        raise UserError(
            f"{flag} {name}: torch sees no CUDA device (torch {torch.__version__}); use {flag} cpu (or "
            f"{flag} auto), or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if colon and int(index) >= count:
        raise UserError(f"{flag} {name}: torch sees {count} CUDA device(s); use cuda:0 .. cuda:{count - 1}")
    return torch.device(name)


def native_bfloat16(device) -> bool:
    """Whether `device` runs bfloat16 matmuls at least as fast as float32: a CUDA GPU that supports bfloat16,
    or a CPU on which torch uses AVX-512 (where oneDNN has bfloat16 kernels). Elsewhere torch emulates them:
    on an AVX2 CPU a (1024, 576) x (576, 576) product takes about 20x its float32 time."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def describe_device(device) -> str:
    """'cpu', or 'cuda (NVIDIA H100 80GB HBM3)' / 'cuda:1 (...)' with the GPU's name."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    try:
        return f"{device} ({torch.cuda.get_device_name(device)})"
    except (RuntimeError, AssertionError):  # (a name torch cannot read: the device alone)
        return str(device)


_SCOPE: contextvars.ContextVar[tuple[str, set] | None] = contextvars.ContextVar(
    "hf_attn.device", default=None
)


@contextlib.contextmanager
def announcing(prog: str) -> Iterator[None]:
    """Inside: `announce_device` prints `prog: device ...` on stderr, once per kind of device."""
    token = _SCOPE.set((prog, set()))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def announce_device(device) -> None:
    """Say where the running command computes (`prog: device cuda (NAME)`), the first time it uses a device
    of this kind; nothing outside a command (`announcing`)."""
    scope, kind = _SCOPE.get(), getattr(device, "type", str(device).partition(":")[0])
    if scope is None or kind in scope[1]:
        return
    scope[1].add(kind)
    print(f"{scope[0]}: device {describe_device(device)}", file=sys.stderr, flush=True)


def warn_emulated_bfloat16(device, flag: str) -> None:
    """Warn once per command, on stderr, that `flag bfloat16` runs emulated on `device` (`native_bfloat16`
    false): the run is correct but far slower than in float32. Nothing outside a command (`announcing`)."""
    scope = _SCOPE.get()
    if scope is None or flag in scope[1] or native_bfloat16(device):
        return
    scope[1].add(flag)
    print(
        f"{scope[0]}: warning: {flag} bfloat16 on {describe_device(device)}: this device has no native "
        f"bfloat16 matmuls and torch emulates them (about 20x slower than float32); {flag} float32 is faster",
        file=sys.stderr,
        flush=True,
    )
