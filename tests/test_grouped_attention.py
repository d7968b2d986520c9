"""The `hf_attn_grouped` kernel alone, against an explicit float64 reference written here.

The reference repeats K/V per query head (head h reads KV head h // G), builds the combined causal + padding
(+ sliding window) mask by hand, position by position, and gives zeros for rows that see no key.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_attn.attention import grouped
from hf_attn.attention.grouped import grouped_attention, grouped_attention_forward, grouped_attention_mask

MASK_KINDS = ("none", "bool", "float", "per_head", "2d", "float_finite_min")


# --- reference ---
def hand_mask(B, T, S, *, causal, lengths=None, left=True, window=None):
    """keep[b, t, s] (True = attend), built position by position: query t is absolute position t + S - T."""
    keep = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        n = S if lengths is None else lengths[b]
        first_real = S - n if left else 0  # left padding: pads first; right padding: pads last
        for t in range(T):
            pos = t + S - T
            for s in range(S):
                ok = first_real <= s < first_real + n
                if causal:
                    ok = ok and s <= pos
                if window is not None:
                    ok = ok and pos - s < window
                keep[b, t, s] = ok
    return keep


def reference(query, key, value, keep, scale):
    """float64 attention with K/V repeated per query head. keep: (B, T, S) or (B, Hq, T, S) bool or None.

    Returns (B, T, Hq, Dv) float64; rows with no visible key are zero.
    """
    B, Hq, T, D = query.shape
    G = Hq // key.shape[1]
    q, k, v = query.double(), key.double(), value.double()
    out = torch.zeros(B, T, Hq, value.shape[-1], dtype=torch.float64)
    for h in range(Hq):
        kh, vh = k[:, h // G], v[:, h // G]  # (B, S, D), (B, S, Dv)
        scores = q[:, h] @ kh.transpose(-1, -2) * scale  # (B, T, S)
        if keep is not None:
            kp = keep[:, h] if keep.dim() == 4 else keep
            scores = scores.masked_fill(~kp, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(torch.isnan(probs), torch.zeros_like(probs), probs)  # rows with no key
        out[:, :, h] = probs @ vh
    return out


def random_qkv(B, Hq, Hkv, T, S, D, Dv, dtype=torch.float32, generator=None):
    q = torch.randn(B, Hq, T, D, generator=generator).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=generator).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=generator).to(dtype)
    return q, k, v


def as_kernel_mask(keep, kind, Hq):
    """The same keep pattern in the form a caller would pass it."""
    if kind in ("bool", "2d"):
        return keep[:, None] if kind == "bool" else keep[0]  # (B, 1, T, S) or (T, S)
    if kind == "per_head":
        return keep if keep.dim() == 4 else keep[:, None].expand(-1, Hq, -1, -1).clone()  # (B, Hq, T, S)
    if kind == "float":
        return torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, -math.inf)[:, None]
    raise AssertionError(kind)


# --- property test ---
@st.composite
def cases(draw):
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 7))
    S = draw(st.one_of(st.just(T), st.integers(1, 10)))  # S == T: prefill; S > T: decode against a cache
    D = draw(st.sampled_from([4, 8, 16]))
    Dv = draw(st.sampled_from([D, 4, 12]))
    kind = draw(st.sampled_from(MASK_KINDS[:5]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 4)))
    left = draw(st.booleans())
    lengths = [draw(st.integers(0, S)) for _ in range(B)]
    scaling = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    seed = draw(st.integers(0, 2**16))
    return dict(Hkv=Hkv, G=G, B=B, T=T, S=S, D=D, Dv=Dv, kind=kind, causal=causal, window=window, left=left,
                lengths=lengths, scaling=scaling, seed=seed)  # fmt: skip


def _backend(name):
    """ "enable_gqa" is the fused backend with packing switched off (the path taken for long queries)."""
    if name == "enable_gqa":
        return "fused", mock.patch.object(grouped, "_PACK_MAX_ROWS", 0)
    return name, contextlib.nullcontext()


@settings(max_examples=150, deadline=None)
@given(c=cases(), backend=st.sampled_from(["auto", "explicit", "fused", "enable_gqa"]))
def test_kernel_matches_reference(c, backend):
    assume(backend in ("auto", "explicit") or c["Dv"] == c["D"])  # torch's fused CPU kernel needs Dk == Dv
    backend, patch = _backend(backend)
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, S, Hq = c["B"], c["T"], c["S"], c["Hkv"] * c["G"]
    q, k, v = random_qkv(B, Hq, c["Hkv"], T, S, c["D"], c["Dv"], generator=gen)
    scale = c["D"] ** -0.5 if c["scaling"] is None else c["scaling"]
    if c["kind"] == "none":
        # No mask: causal (bottom-right) iff asked and T > 1, no padding.
        keep = hand_mask(B, T, S, causal=c["causal"] and T > 1) if c["causal"] else None
        mask = None
    else:
        lengths = c["lengths"] if c["kind"] != "2d" else None  # a 2-D mask is shared by the batch
        keep = hand_mask(B, T, S, causal=c["causal"], lengths=lengths, left=c["left"], window=c["window"])
        if c["kind"] == "per_head":  # a different pattern for every query head
            keep = keep[:, None] & (torch.rand(B, Hq, T, S, generator=gen) > 0.3)  # (B, Hq, T, S)
        mask = as_kernel_mask(keep, c["kind"], Hq)
    with patch:
        out = grouped_attention(q, k, v, mask, scaling=c["scaling"], is_causal=c["causal"], backend=backend)
    expected = reference(q, k, v, keep, scale)
    assert out.shape == (B, T, Hq, c["Dv"]) and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# --- named cases ---
@pytest.mark.parametrize("backend", ["auto", "explicit", "enable_gqa"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,T,S",
    [
        (2, 9, 3, 1, 40),  # single-token decode against a cache
        (2, 9, 3, 5, 40),  # multi-token decode against a cache
        (2, 9, 3, 24, 24),  # prefill (enable_gqa)
        (2, 6, 2, 8, 8),  # short prefill (group packed into the query axis)
        (1, 8, 1, 6, 30),  # MQA
        (1, 4, 4, 6, 30),  # MHA
    ],
)
def test_decode_shapes_with_padding(B, Hq, Hkv, T, S, backend):
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 16, 16)
    keep = hand_mask(B, T, S, causal=True, lengths=[S - 7, S][:B], left=True)
    backend, patch = _backend(backend)
    with patch:
        out = grouped_attention(q, k, v, keep[:, None], backend=backend)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep, 16**-0.5), atol=1e-5, rtol=1e-5)
    # No mask at all: bottom-right causal for T > 1, everything for T == 1.
    with patch:
        out = grouped_attention(q, k, v, None, is_causal=True, backend=backend)
    keep = hand_mask(B, T, S, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep, 16**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "explicit", "fused", "enable_gqa"])
@pytest.mark.parametrize("T", [1, 5])
def test_per_head_masks(T, backend):
    B, Hq, Hkv, S = 2, 6, 2, 11
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 8, 8)
    keep = hand_mask(B, T, S, causal=True, lengths=[8, 11])[:, None] & (torch.rand(B, Hq, T, S) > 0.3)
    backend, patch = _backend(backend)
    with patch:
        out = grouped_attention(q, k, v, keep, backend=backend)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep, 8**-0.5), atol=1e-5, rtol=1e-5)


def test_finite_min_additive_mask_matches_eager_semantics():
    """Additive masks using finfo.min (transformers' eager masks) behave like a large finite bias."""
    q, k, v = random_qkv(2, 6, 2, 4, 9, 8, 8)
    keep = hand_mask(2, 4, 9, causal=True, lengths=[5, 9])
    mask = torch.zeros(2, 1, 4, 9).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
    out = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep, 8**-0.5), atol=1e-5, rtol=1e-5)


# --- reduced precision ---
def _sdpa_same_dtype(q, k, v, keep, scale):
    """torch's SDPA in the input dtype, K/V repeated per query head: the yardstick for reduced precision."""
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q, kr, vr, attn_mask=keep[:, None], scale=scale).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hq,Hkv,T,S,D,Dv,masked",
    [
        (2, 9, 3, 1, 300, 64, 64, True),
        (2, 9, 3, 16, 300, 64, 64, True),
        (1, 8, 2, 64, 64, 64, 64, False),
        (2, 8, 1, 12, 200, 96, 64, True),  # Dk != Dv (MLA absorbed): explicit path
    ],
)
def test_reduced_precision_error_at_most_twice_sdpa(dtype, B, Hq, Hkv, T, S, D, Dv, masked):
    gen = torch.Generator().manual_seed(1)
    q32, k32, v32 = random_qkv(B, Hq, Hkv, T, S, D, Dv, generator=gen)
    q32 = q32 * 2.0  # sharper attention: rounding of the scores matters
    q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
    lengths = [S - 37, S][:B] if masked else None
    keep = hand_mask(B, T, S, causal=True, lengths=lengths)
    # The reference sees exactly the rounded inputs, so only the arithmetic is judged.
    expected = reference(q, k, v, keep, D**-0.5)
    ours = grouped_attention(q, k, v, keep[:, None] if masked else None, is_causal=True)
    theirs = _sdpa_same_dtype(q, k, v, keep, D**-0.5)
    assert ours.dtype == dtype
    err_ours = (ours.double() - expected).abs().max().item()
    err_sdpa = (theirs.double() - expected).abs().max().item()
    assert err_ours <= 2 * err_sdpa, (err_ours, err_sdpa)


# --- fully masked rows ---
@pytest.mark.parametrize("backend", ["auto", "explicit", "enable_gqa"])
@pytest.mark.parametrize("kind", ["bool", "float", "per_head", "causal_short_cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_are_zero(kind, backend, dtype):
    B, Hq, Hkv, T, S = 2, 6, 2, 5, 8
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 8, 8, dtype=dtype)
    if kind == "causal_short_cache":  # S < T with no mask: the first T - S' queries see no key
        k, v = k[:, :, :3], v[:, :, :3]
        mask, dead = None, [(b, t) for b in range(B) for t in range(2)]
    else:
        keep = hand_mask(B, T, S, causal=True, lengths=[S - 3, S], left=False)  # right padding
        keep[0, 1] = False  # a row with nothing visible
        keep[1, :] = False  # a whole sequence of padding
        mask = as_kernel_mask(keep, kind, Hq)
        dead = [(0, 1)] + [(1, t) for t in range(T)]
    backend, patch = _backend(backend)
    with patch:
        out = grouped_attention(q, k, v, mask, is_causal=True, backend=backend)
    assert torch.isfinite(out).all()
    for b, t in dead:
        assert (out[b, t] == 0).all(), (b, t)


@pytest.mark.parametrize("backend", ["auto", "explicit", "enable_gqa"])
def test_gradients_match_reference_and_stay_finite(backend):
    B, Hq, Hkv, T, S = 2, 6, 2, 4, 7
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 8, 8)
    keep = hand_mask(B, T, S, causal=True, lengths=[4, 7])
    keep[0, 0] = False  # a fully masked row must not poison the gradients
    w = torch.randn(B, T, Hq, 8)

    def grads(fn):
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        (fn(*leaves) * w).sum().backward()
        return [x.grad for x in leaves]

    backend, patch = _backend(backend)
    with patch:
        got = grads(
            lambda q, k, v: grouped_attention(q.float(), k.float(), v.float(), keep[:, None], backend=backend)
        )
    want = grads(lambda q, k, v: reference(q, k, v, keep, 8**-0.5))
    for g, r in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


# --- dropout ---
def test_dropout_only_in_training_and_unbiased():
    B, Hq, Hkv, T, S = 1, 4, 2, 3, 8
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 8, 8)
    keep = hand_mask(B, T, S, causal=True)
    expected = reference(q, k, v, keep, 8**-0.5)
    module = SimpleNamespace(is_causal=True, training=False)
    out, weights = grouped_attention_forward(module, q, k, v, keep[:, None], dropout=0.5)
    assert weights is None
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)  # eval: no dropout

    module.training = True
    assert (grouped_attention_forward(module, q, k, v, keep[:, None], dropout=1.0)[0] == 0).all()
    n = 1000
    runs = torch.stack(
        [grouped_attention_forward(module, q, k, v, keep[:, None], dropout=0.5)[0] for _ in range(n)]
    )
    assert not torch.allclose(runs[0], runs[1])
    # Inverted dropout keeps the expectation: the mean lies within 5 standard errors of the reference.
    runs = runs.double()
    assert ((runs.mean(0) - expected).abs() <= 5 * runs.std(0) / n**0.5 + 1e-6).all()


# --- the transformers adapter ---
def test_forward_adapter_contract():
    B, Hq, Hkv, T, S = 2, 6, 3, 4, 9
    q, k, v = random_qkv(B, Hq, Hkv, T, S, 8, 8)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the model's layout: (B, Hq, T, D) over (B, T, Hq, D)
    causal = SimpleNamespace(is_causal=True, training=False, num_key_value_groups=3)
    out, weights = grouped_attention_forward(causal, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (B, T, Hq, 8) and out.is_contiguous()
    expected = reference(q, k, v, hand_mask(B, T, S, causal=True), 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # A non-causal module (or is_causal=False passed by the model) attends everywhere.
    encoder = SimpleNamespace(is_causal=False, training=False)
    torch.testing.assert_close(grouped_attention_forward(encoder, q, k, v, None)[0].double(),
                               reference(q, k, v, None, 8**-0.5), atol=1e-5, rtol=1e-5)  # fmt: skip
    out = grouped_attention_forward(causal, q, k, v, None, is_causal=False)[0]
    torch.testing.assert_close(out.double(), reference(q, k, v, None, 8**-0.5), atol=1e-5, rtol=1e-5)


def test_mask_function_never_leaves_an_ambiguous_causal_mask():
    """Where top-left and bottom-right causal differ (T > 1, S != T) a mask is always built."""
    skip = grouped_attention_mask(batch_size=2, q_length=5, kv_length=5, q_offset=0)
    assert skip is None  # prefill without padding: T == S, both alignments agree
    assert grouped_attention_mask(batch_size=2, q_length=1, kv_length=9, q_offset=8) is None
    static_prefill = grouped_attention_mask(batch_size=1, q_length=4, kv_length=10, q_offset=0)
    assert static_prefill is not None
    torch.testing.assert_close(static_prefill[0, 0], hand_mask(1, 4, 10, causal=True)[0].tril(0))
    decode = grouped_attention_mask(batch_size=1, q_length=4, kv_length=10, q_offset=6)
    torch.testing.assert_close(decode[0, 0], hand_mask(1, 4, 10, causal=True)[0])


# --- user errors ---
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,needle",
    [
        ((2, 7, 4, 8), (2, 3, 9, 8), (2, 3, 9, 8), "multiple"),  # Hq % Hkv != 0
        ((2, 6, 4, 8), (3, 3, 9, 8), (3, 3, 9, 8), "batch"),
        ((2, 6, 4, 8), (2, 3, 9, 8), (2, 3, 8, 8), "length"),
        ((2, 6, 4, 8), (2, 3, 9, 16), (2, 3, 9, 8), "head dim"),
        ((2, 6, 4, 8), (2, 3, 9, 8), (2, 2, 9, 8), "heads"),
        ((6, 4, 8), (2, 3, 9, 8), (2, 3, 9, 8), "4-D"),
    ],
)
def test_bad_shapes_raise_value_error_naming_them(q_shape, k_shape, v_shape, needle):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(ValueError) as info:
        grouped_attention_forward(SimpleNamespace(is_causal=True, training=False), q, k, v, None)
    message = str(info.value)
    assert needle in message and str(tuple(q_shape)) in message and str(tuple(k_shape)) in message


@pytest.mark.parametrize(
    "mask,needle",
    [
        (torch.ones(2, 1, 4, 8, dtype=torch.bool), "(2, 1, 4, 8)"),  # S is 9
        (torch.ones(2, 3, 4, 9, dtype=torch.bool), "(2, 3, 4, 9)"),  # 3 heads: neither 1 nor Hq
        (torch.ones(2, 1, 4, 9, dtype=torch.long), "torch.int64"),
    ],
)
def test_bad_masks_raise_value_error(mask, needle):
    q, k, v = random_qkv(2, 6, 3, 4, 9, 8, 8)
    with pytest.raises(ValueError, match="attention_mask") as info:
        grouped_attention(q, k, v, mask)
    assert needle in str(info.value)
