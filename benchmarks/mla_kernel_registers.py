"""Registers and spills of the MLA decode split kernel, compiled ahead of time for a CUDA architecture without
a GPU (Triton's compiler + its bundled ptxas `-v` report). A compile check and a register-pressure check for
the launch heuristics, not a speed measurement.

    python -m benchmarks.mla_kernel_registers [--arch 90] [--dtype float16]

Each row is a launch configuration `mla_decode` picks by default for a shape (the defaults are read from
`hf_attn.kernels.mla_decode`), plus neighbours given with `--block-n` / `--num-warps`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import tempfile

from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.errors import UserError, check_number

PROG = "python -m benchmarks.mla_kernel_registers"
# name -> (d_c, RoPE width 2r, rows M = Hkv * G * T, RoPE-key heads per KV head (True) or shared (False))
SHAPES = {
    "llama3-8b per-head T=1": (512, 48, 32, True),
    "llama3-8b shared T=1": (512, 48, 32, False),
    "llama3-8b per-head T=4": (512, 48, 128, True),
    "smollm2 per-head T=1": (256, 24, 9, True),
    "smollm2 per-head T=4": (256, 24, 36, True),
    "deepseek-like d_c=512 r=64 16 heads": (512, 64, 16, False),
}
TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def launch_config(dc: int, rope: int, rows: int, block_n=None, num_warps=None) -> dict:
    """The block sizes and warps `mla_decode` uses by default (mirrors its heuristics)."""
    import triton

    from hf_attn.kernels import mla_decode as k

    block_dc = max(k._MIN_BLOCK, triton.next_power_of_2(dc))
    block_m = max(k._MIN_BLOCK, min(triton.next_power_of_2(rows), k._MAX_ACC_ELEMENTS // block_dc))
    block_r = max(k._MIN_BLOCK, triton.next_power_of_2(rope)) if rope else k._MIN_BLOCK
    if block_n is None:
        block_n = 64 if block_dc <= 256 else 32
    if num_warps is None:
        num_warps = 4 if block_m * block_dc <= 4 * 1024 else 8
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DC=block_dc, BLOCK_R=block_r, num_warps=num_warps)


def ptxas_report(
    *, dtype: str, arch: int, per_head: bool, has_rope: bool, cfg: dict, mask_kind: int = 0
) -> dict:
    """Compile the split kernel for sm_<arch> and return ptxas's registers / spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_attn.kernels import mla_decode as k

    fn = k._mla_decode_split
    t = TRITON_DTYPES[dtype]
    sig = {name: "i32" for name in fn.arg_names}
    sig.update({n: f"*{t}" for n in ("QR", "QL", "C", "KR")}, MASK="*u8" if mask_kind == 1 else f"*{t}")
    sig.update({n: "*fp32" for n in ("PACC", "PM", "PL")}, qk_scale="fp32", mask_floor="fp32")
    const = {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_DC", "BLOCK_R")}
    const.update(HAS_ROPE=has_rope, PER_HEAD_ROPE=per_head, MASK_KIND=mask_kind, DOT_FP32=False)
    const["PRECISION"] = "ieee" if dtype == "float32" else "tf32"
    sig.update({key: "constexpr" for key in const})
    compiled = triton.compile(
        ASTSource(fn, sig, const),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": cfg["num_warps"], "num_stages": 2},  # mla_decode's default stages
    )
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(
        (
            os.path.join(bin_dir, n)
            for n in ("ptxas-blackwell", "ptxas")
            if os.path.exists(os.path.join(bin_dir, n))
        ),
        None,
    )
    if ptxas is None:
        raise UserError(f"no ptxas under {bin_dir}; install triton's NVIDIA backend")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"ptxas failed for --arch {arch}: {last}; try another --arch (90: H100)")
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
        "spill_load_bytes": int(spills.group(2)) if spills else None,
        "shared_bytes": compiled.metadata.shared,
    }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100)")
    p.add_argument("--dtype", default="float16", choices=list(TRITON_DTYPES))
    p.add_argument("--block-n", type=int, nargs="*", default=[], help="extra BLOCK_N values to report")
    p.add_argument("--num-warps", type=int, nargs="*", default=[], help="extra num_warps values to report")
    return p


def check_args(args: argparse.Namespace) -> None:
    """UserError naming the flag and the value: an architecture below sm_70, a BLOCK_N or num_warps that is
    not a power of two (Triton's blocks and warps are), BLOCK_N below 16 (tl.dot's smallest)."""
    check_number("--arch", args.arch, minimum=70, inclusive=True, integer=True)
    for flag, values, least in (("--block-n", args.block_n, 16), ("--num-warps", args.num_warps, 1)):
        for value in values:
            if value < least or value & (value - 1):
                raise UserError(f"{flag} must be a power of two >= {least}, got {value}")
    if importlib.util.find_spec("triton") is None:
        raise UserError("needs triton; install it with `pip install hf-attn[kernels]`")


def report(args: argparse.Namespace) -> None:
    """The command's work: the checks, then one table row per shape and launch configuration."""
    check_args(args)
    print("| shape | BLOCK_M | BLOCK_N | BLOCK_DC | BLOCK_R | warps | registers | spills st/ld | smem |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (dc, rope, rows, per_head) in SHAPES.items():
        default = launch_config(dc, rope, rows)
        variants = [default]
        variants += [launch_config(dc, rope, rows, block_n=n) for n in args.block_n]
        variants += [launch_config(dc, rope, rows, num_warps=w) for w in args.num_warps]
        for cfg in variants:
            r = ptxas_report(dtype=args.dtype, arch=args.arch, per_head=per_head, has_rope=rope > 0, cfg=cfg)
            print(
                f"| {name}{' (default)' if cfg is default else ''} | {cfg['BLOCK_M']} | {cfg['BLOCK_N']} "
                f"| {cfg['BLOCK_DC']} | {cfg['BLOCK_R']} | {cfg['num_warps']} | {r['registers']} "
                f"| {r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['shared_bytes']} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: report(args))


if __name__ == "__main__":
    raise SystemExit(main())
