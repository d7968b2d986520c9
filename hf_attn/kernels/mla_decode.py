"""Flash-decoding Triton kernel for MLA's absorbed decode: a few query tokens against a latent KV cache.

Shape notation used throughout this module:
    B    batch size
    Hkv  KV heads (KV groups); G query heads per group; T query tokens (decode: 1 or a few)
    M    = Hkv * G * T query rows of one batch element, row m = (h * G + g) * T + t
    S    cached tokens (including the T new ones)
    DC   latent width (kv_lora_rank), any size
    R    RoPE key width per RoPE-key head (2r), any size including 0
    Hr   RoPE-key heads in the cache: Hkv (one RoPE key per KV head, head-major) or 1 (one shared key)

The function computed (the attention part of `llama_mla`'s absorbed path; W_uk and W_uv stay outside):

    score[b, h, m, s] = (q_rope[b, h, m] . k_rope[b, s, h or 0] + q_latent[b, h, m] . latent[b, s])
                        * scaling + additive mask, or -inf where the mask drops key s for row m's token t
    out[b, h, m]      = sum_s softmax_s(score[b, h, m, :]) * latent[b, s]   (zeros where every key is dropped)

Two kernels (flash-decoding):
1. split: grid (row blocks, splits, B). Each program takes BLOCK_M query rows (all KV heads' rows together;
   one block when M <= BLOCK_M) and walks its slice of the sequence in tiles of BLOCK_N tokens with an online
   softmax (running max, running sum, fp32 accumulator). Per tile it loads the latent tile (BLOCK_N, DC) once
   and uses it in one matmul for the latent scores of all rows and again in one matmul for the weighted sum;
   the cached RoPE keys are loaded once per RoPE-key head met by the block, each (BLOCK_N, R) tile scored by
   one matmul against the block's rows of that head (zeros for the others; q_rope reloads hit L1). So each
   cached number is read once per row block: once in all when M <= BLOCK_M (BLOCK_M x DC, the fp32
   accumulator, is kept at most 16k elements: 32 rows at DC = 512, 64 at DC = 256); the row blocks of a split
   run side by side (fastest grid axis) and share the tiles in L2. It writes an unnormalised partial
   (M, DC) and its max and sum per row.
2. combine: grid (B * M,). Rescales the partials of all splits to a common max and normalises; rows with
   no attendable key (every split's max is -inf) get zeros and a log-sum-exp of -inf.
Scores, softmax and accumulation are fp32 whatever the input dtype (fp16 / bf16 / fp32); the probabilities are
cast to the latent dtype for the weighted-sum matmul, as the PyTorch path does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["mla_decode"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16 on GPUs
_MAX_ACC_ELEMENTS = 16 * 1024  # BLOCK_M * BLOCK_DC: fp32 accumulator of one program, kept in registers


@triton.jit
def _mla_decode_split(
    QR, QL, C, KR, MASK, PACC, PM, PL,
    stride_qr_b, stride_qr_m, stride_qr_d,
    stride_ql_b, stride_ql_m, stride_ql_d,
    stride_c_b, stride_c_s, stride_c_d,
    stride_kr_b, stride_kr_s, stride_kr_d,
    stride_mask_b, stride_mask_t, stride_mask_s,
    M, GT, T, S, DC, R, SPLIT_LEN, N_SPLITS,
    qk_scale, mask_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr, PER_HEAD_ROPE: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One (row block, split, batch): online softmax over tokens [split * SPLIT_LEN, ...) for BLOCK_M rows."""
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # b * stride_b exceeds int32 for large caches
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,): row m = (h * G + g) * T + t
    row_ok = rows < M
    dcs = tl.arange(0, BLOCK_DC)  # (BLOCK_DC,)
    dc_ok = dcs < DC

    q_lat = tl.load(  # (BLOCK_M, BLOCK_DC)
        QL + b * stride_ql_b + rows[:, None] * stride_ql_m + dcs[None, :] * stride_ql_d,
        mask=row_ok[:, None] & dc_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:  # interpreter + bf16 only (see _DOT_FP32)
        q_lat = q_lat.to(tl.float32)
    if HAS_ROPE:
        rs = tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        r_ok = rs < R
        qr_ptrs = QR + b * stride_qr_b + rows[:, None] * stride_qr_m + rs[None, :] * stride_qr_d
        kr_cols = KR + b * stride_kr_b + rs * stride_kr_d  # (BLOCK_R,) columns of RoPE-key head 0
        head_lo = 0  # RoPE-key heads met by this row block: [head_lo, head_hi)
        head_hi = 1
        if PER_HEAD_ROPE:  # rows of KV head h read RoPE-key head h
            head_lo = (tl.program_id(0) * BLOCK_M) // GT
            head_hi = (tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, M) - 1) // GT + 1
    if MASK_KIND != 0:
        mask_rows = MASK + b * stride_mask_b + (rows % T) * stride_mask_t  # (BLOCK_M,): row m is token m % T

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)  # running sum of exp2(score - m_i) * latent
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, S)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        col_ok = cols < end
        c = tl.load(  # (BLOCK_N, BLOCK_DC): read once, used by both matmuls
            C + b * stride_c_b + cols[:, None] * stride_c_s + dcs[None, :] * stride_c_d,
            mask=col_ok[:, None] & dc_ok[None, :],
            other=0.0,
        )
        c_dot = c
        if DOT_FP32:
            c_dot = c.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c_dot), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if HAS_ROPE:
            s = _add_rope_scores(
                s, qr_ptrs, kr_cols, rows, row_ok, r_ok, cols, col_ok, head_lo, head_hi, GT, R,
                stride_kr_s, stride_kr_d, PER_HEAD_ROPE, PRECISION, DOT_FP32,
            )  # fmt: skip
        s = s * qk_scale
        keep = row_ok[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_N)
        if MASK_KIND != 0:
            s, keep = _apply_mask(s, keep, mask_rows, cols, stride_mask_s, mask_floor, MASK_KIND)
        s = tl.where(keep, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, c, c_dot, m_i, l_i, acc, PRECISION)

    part = b * N_SPLITS + split
    tl.store(PM + part * M + rows, m_i, mask=row_ok)
    tl.store(PL + part * M + rows, l_i, mask=row_ok)
    tl.store(
        PACC + (part * M + rows[:, None]) * DC + dcs[None, :], acc, mask=row_ok[:, None] & dc_ok[None, :]
    )


@triton.jit
def _add_rope_scores(
    s, qr_ptrs, kr_cols, rows, row_ok, r_ok, cols, col_ok, head_lo, head_hi, GT, R, stride_kr_s, stride_kr_d,
    PER_HEAD_ROPE: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """s (BLOCK_M, BLOCK_N) plus the RoPE scores: one matmul per RoPE-key head in [head_lo, head_hi), its
    (BLOCK_R, BLOCK_N) tile read once, against the block's query rows of that head (zeros elsewhere)."""
    for hr in range(head_lo, head_hi):
        in_head = row_ok
        if PER_HEAD_ROPE:
            in_head = row_ok & (rows // GT == hr)
        q_rope = tl.load(qr_ptrs, mask=in_head[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_R)
        kr = tl.load(  # (BLOCK_R, BLOCK_N)
            kr_cols[:, None] + hr * R * stride_kr_d + cols[None, :] * stride_kr_s,
            mask=r_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            q_rope = q_rope.to(tl.float32)
            kr = kr.to(tl.float32)
        s += tl.dot(q_rope, kr, input_precision=PRECISION)
    return s


@triton.jit
def _apply_mask(s, keep, mask_rows, cols, stride_mask_s, mask_floor, MASK_KIND: tl.constexpr):
    """(s, keep) (BLOCK_M, BLOCK_N) after the mask's tile: a boolean mask (MASK_KIND 1, uint8 view, nonzero =
    attend) narrows `keep`; an additive one (2) is added to s (log2 units) and drops keys <= mask_floor."""
    if MASK_KIND == 1:
        mk = tl.load(mask_rows[:, None] + cols[None, :] * stride_mask_s, mask=keep, other=0)
        keep = keep & (mk != 0)
    elif MASK_KIND == 2:  # values <= mask_floor (about dtype min / 2) drop the key
        mk = tl.load(mask_rows[:, None] + cols[None, :] * stride_mask_s, mask=keep, other=0.0)
        mk = mk.to(tl.float32)
        keep = keep & (mk > mask_floor)
        s += tl.where(keep, mk, 0.0) * 1.4426950408889634
    return s, keep


@triton.jit
def _online_softmax_step(s, c, c_dot, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of the online softmax: s (BLOCK_M, BLOCK_N) masked scores (log2 units, -inf = dropped), c
    (BLOCK_N, BLOCK_DC) the latent tile (c_dot: as the matmul takes it) -> the updated running max m_i
    (BLOCK_M,), running sum l_i (BLOCK_M,) and accumulator acc (BLOCK_M, BLOCK_DC)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept yet: no NaN
    alpha = tl.exp2(m_i - m_ref)  # (BLOCK_M,), 0 while m_i is -inf
    p = tl.exp2(s - m_ref[:, None])  # (BLOCK_M, BLOCK_N), 0 where dropped
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(c.dtype).to(c_dot.dtype)  # rounded to the latent dtype, as the PyTorch path does
    acc = acc * alpha[:, None] + tl.dot(p, c_dot, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_combine(
    PACC, PM, PL, OUT, LSE,
    M, DC, N_SPLITS,
    BLOCK_DC: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):  # fmt: skip
    """One (batch, row): merge the splits' partials; zeros and lse -inf for fully masked rows."""
    pid = tl.program_id(0)
    bh = pid // M  # the batch index
    row = pid % M
    ks = tl.arange(0, BLOCK_SPLITS)  # (BLOCK_SPLITS,)
    k_ok = ks < N_SPLITS
    m = tl.load(PM + (bh * N_SPLITS + ks) * M + row, mask=k_ok, other=float("-inf"))
    l = tl.load(PL + (bh * N_SPLITS + ks) * M + row, mask=k_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(tl.exp2(m - m_ref) * l, 0)  # 0 iff no split kept a key
    dcs = tl.arange(0, BLOCK_DC)
    dc_ok = dcs < DC
    acc = tl.zeros([BLOCK_DC], tl.float32)
    for k in range(0, N_SPLITS):
        part = bh * N_SPLITS + k
        w = tl.exp2(tl.load(PM + part * M + row) - m_ref)
        acc += w * tl.load(PACC + (part * M + row) * DC + dcs, mask=dc_ok, other=0.0)
    inv = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(OUT + pid * DC + dcs, (acc * inv).to(OUT.dtype.element_ty), mask=dc_ok)
    lse = tl.where(total > 0.0, (m_ref + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(LSE + pid, lse)


# Triton's CPU interpreter (TRITON_INTERPRET=1, checked with triton 3.9) multiplies the raw bits of bf16
# tl.dot operands. Under it, bf16 operands are cast to fp32 for the dots: exact (a bf16 product fits in fp32),
# so the math matches the GPU's bf16 MMA with fp32 accumulation up to summation order.
_DOT_FP32 = type(_mla_decode_split).__name__ == "InterpretedFunction"


def mla_decode(
    q_rope: torch.Tensor,
    q_latent: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scaling: float,
    rope_heads: int | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of the absorbed MLA decode over a latent cache (see the module docstring).

    Shapes:
        q_rope      (B, Hkv, G, T, R)       RoPE part of the queries (rotated); R may be 0
        q_latent    (B, Hkv, G, T, DC)      W_uk,g^T q_nope per query head
        latent      (B, 1, S, DC)           cached latent c (the cache's "keys")
        k_rope      (B, 1, S, Hr * R)       cached RoPE keys, head-major (the cache's "values"), Hr = 1 or Hkv
        mask        None (every key), or bool (True = attend) / additive float, broadcastable to
                    (B, 1, T, S); an additive value <= finfo(mask.dtype).min / 2 drops the key
        returns     out (B, Hkv, G, T, DC) in latent's dtype, zeros on rows without an attendable key;
                    with return_lse also lse (B, Hkv, G, T) fp32, natural log of the softmax denominator of
                    the scaled, masked scores (-inf on those rows)

    `rope_heads` is Hr (inferred from the widths when None). q_rope, q_latent, latent and k_rope share one
    dtype (fp16, bf16 or fp32) and one device; scores and softmax run in fp32. `num_splits`, `block_n`,
    `num_warps`, `num_stages` override the launch heuristics (tuning and tests only).
    """
    B, Hkv, G, T, R, DC, S, Hr = _check(q_rope, q_latent, latent, k_rope, rope_heads)
    M = Hkv * G * T
    out = latent.new_empty(B, Hkv, G, T, DC)
    lse = torch.empty(B, Hkv, G, T, dtype=torch.float32, device=latent.device)
    if M == 0 or B == 0:  # nothing to compute: empty outputs
        return (out, lse) if return_lse else out
    if S == 0:  # nothing to attend to: every row is fully masked
        return (out.zero_(), lse.fill_(-math.inf)) if return_lse else out.zero_()
    mask_kind, mask_arg, mask_strides, mask_floor = _mask_args(mask, B, T, S, latent)
    launch = _plan_launch(
        B, M, S, DC, R, latent.device, num_splits=num_splits, block_n=block_n, num_warps=num_warps
    )
    num_splits = launch.num_splits

    q_rope3 = q_rope.reshape(B, M, R)  # (B, Hkv*G*T, R), a view where strides allow
    q_lat3 = q_latent.reshape(B, M, DC)  # (B, Hkv*G*T, DC)
    c = latent.squeeze(1)  # (B, S, DC)
    kr = k_rope.squeeze(1)  # (B, S, Hr * R)
    part_acc = torch.empty(B, num_splits, M, DC, dtype=torch.float32, device=latent.device)
    part_m = torch.empty(B, num_splits, M, dtype=torch.float32, device=latent.device)
    part_l = torch.empty_like(part_m)
    dot_fp32 = _DOT_FP32 and latent.dtype == torch.bfloat16
    precision = "ieee" if latent.dtype == torch.float32 or dot_fp32 else "tf32"  # fp32 stays fp32 (no TF32)
    _mla_decode_split[(launch.row_blocks, num_splits, B)](  # row blocks fastest: they share L2 cache tiles
        q_rope3, q_lat3, c, kr, mask_arg, part_acc, part_m, part_l,
        *q_rope3.stride(), *q_lat3.stride(), *c.stride(), *kr.stride(), *mask_strides,
        M, G * T, T, S, DC, R, launch.split_len, num_splits,
        float(scaling) * _LOG2E, mask_floor,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_DC=launch.block_dc, BLOCK_R=launch.block_r,
        HAS_ROPE=R > 0, PER_HEAD_ROPE=Hr > 1, MASK_KIND=mask_kind, PRECISION=precision, DOT_FP32=dot_fp32,
        num_warps=launch.num_warps, num_stages=2 if num_stages is None else num_stages,
    )  # fmt: skip
    _mla_decode_combine[(B * M,)](
        part_acc, part_m, part_l, out, lse, M, DC, num_splits,
        BLOCK_DC=launch.block_dc, BLOCK_SPLITS=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
    )  # fmt: skip
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _Launch:
    """Block sizes, sequence splits and warps of one `mla_decode` launch."""

    block_m: int  # query rows per program
    block_n: int  # cached tokens per tile
    block_dc: int  # latent width, padded to a power of two
    block_r: int  # RoPE key width, padded to a power of two
    row_blocks: int  # programs along the rows, cdiv(M, block_m)
    split_len: int  # tokens per split, a multiple of block_n
    num_splits: int  # splits of the sequence, each holding at least one token
    num_warps: int


def _plan_launch(
    B: int, M: int, S: int, DC: int, R: int, device: torch.device, *, num_splits, block_n, num_warps
) -> _Launch:
    """The launch heuristics for B batch elements of M query rows over S cached tokens of latent width DC
    and RoPE width R; `num_splits`, `block_n`, `num_warps` override them where not None (ValueError when
    out of range)."""
    block_dc = max(_MIN_BLOCK, triton.next_power_of_2(DC))
    block_r = max(_MIN_BLOCK, triton.next_power_of_2(R)) if R else _MIN_BLOCK
    block_m = max(_MIN_BLOCK, min(triton.next_power_of_2(M), _MAX_ACC_ELEMENTS // block_dc))
    row_blocks = triton.cdiv(M, block_m)
    block_n = 64 if block_n is None else block_n  # won on sm_90 at d_c 128, 512 (docs/research/mla-kernel.md)
    if block_n < _MIN_BLOCK or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {_MIN_BLOCK}, got {block_n}")
    n_blocks = triton.cdiv(S, block_n)
    num_splits = _default_splits(B * row_blocks, n_blocks, device) if num_splits is None else num_splits
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(n_blocks, min(num_splits, n_blocks)) * block_n  # a multiple of block_n
    num_splits = triton.cdiv(S, split_len)  # every split holds at least one token
    num_warps = 4 if num_warps is None else num_warps  # 4 beat 8 at d_c 512 despite ptxas's spills
    return _Launch(block_m, block_n, block_dc, block_r, row_blocks, split_len, num_splits, num_warps)


def _default_splits(programs_per_split: int, n_blocks: int, device: torch.device) -> int:
    """The most splits whose programs fit in two waves over the SMs (a started third wave costs about as
    much as a full one), each split at least 4 tiles long."""
    sms = 8  # CPU tensors (Triton's interpreter): any count works
    if device.type == "cuda":
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    wanted = 2 * sms // programs_per_split
    return max(1, min(wanted, triton.cdiv(n_blocks, 4)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check(q_rope, q_latent, latent, k_rope, rope_heads):
    """Validate shapes, dtypes and devices; returns B, Hkv, G, T, R, DC, S, Hr."""
    named = {"q_rope": q_rope, "q_latent": q_latent, "latent": latent, "k_rope": k_rope}
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items())
    if q_rope.dim() != 5 or q_latent.dim() != 5 or latent.dim() != 4 or k_rope.dim() != 4:
        raise ValueError(
            "expected q_rope (B, Hkv, G, T, R), q_latent (B, Hkv, G, T, DC), latent (B, 1, S, DC), "
            f"k_rope (B, 1, S, Hr*R); got {shapes}"
        )
    B, Hkv, G, T, R = q_rope.shape
    DC, S = latent.shape[3], latent.shape[2]
    if DC == 0:
        raise ValueError(f"the latent width DC (latent's last dim) must be >= 1; got {shapes}")
    if tuple(q_latent.shape) != (B, Hkv, G, T, DC):
        raise ValueError(f"q_latent must be (B, Hkv, G, T, DC) = {(B, Hkv, G, T, DC)}; got {shapes}")
    if latent.shape[0] != B or latent.shape[1] != 1:
        raise ValueError(f"latent must be (B, 1, S, DC) with B = {B}; got {shapes}")
    if k_rope.shape[0] != B or k_rope.shape[1] != 1 or k_rope.shape[2] != S:
        raise ValueError(f"k_rope must be (B, 1, S, Hr*R) with B = {B}, S = {S}; got {shapes}")
    width = k_rope.shape[3]
    if rope_heads is None:
        rope_heads = width // R if R else 1
    if rope_heads not in (1, Hkv) or width != rope_heads * R:
        raise ValueError(
            f"k_rope's last dim ({width}) must be rope_heads * R with rope_heads 1 (shared RoPE key) or "
            f"Hkv = {Hkv} (one per KV head) and R = {R} (q_rope's last dim); got rope_heads={rope_heads}, "
            f"{shapes}"
        )
    if len({t.dtype for t in named.values()}) != 1 or latent.dtype not in _DTYPES:
        raise ValueError(
            f"q_rope, q_latent, latent, k_rope must share one dtype of {_DTYPES}; got "
            f"{q_rope.dtype}, {q_latent.dtype}, {latent.dtype}, {k_rope.dtype}: cast them to the cache dtype"
        )
    if len({t.device for t in named.values()}) != 1:
        raise ValueError(
            f"q_rope, q_latent, latent, k_rope must be on one device; latent is on {latent.device}"
        )
    return B, Hkv, G, T, R, DC, S, rope_heads


def _mask_args(mask, B, T, S, latent):
    """-> (kind 0 none / 1 bool / 2 additive, tensor argument, (b, t, s) element strides, drop threshold)."""
    if mask is None:
        return 0, latent, (0, 0, 0), 0.0
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise ValueError(f"mask must be bool (True = attend) or additive float, not {mask.dtype}")
    if mask.dim() > 4:
        raise ValueError(f"mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    if mask.device != latent.device:
        raise ValueError(f"mask is on {mask.device} but the cache is on {latent.device}; move it there")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (b, 1, t, s), a view
    b, h, t, s = mask.shape
    if b not in (1, B) or h != 1 or t not in (1, T) or s not in (1, S):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, 1, T, S) = ({B}, 1, {T}, {S}); "
            "give it shape (B, 1, T, S) (per-head masks are not supported: use the PyTorch path)"
        )
    mask = mask.expand(B, 1, T, S)[:, 0]  # (B, T, S), broadcast axes have stride 0
    if mask.dtype == torch.bool:
        return 1, mask.view(torch.uint8), mask.stride(), 0.0
    return 2, mask, mask.stride(), torch.finfo(mask.dtype).min / 2
