"""Property layer over the numeric options: for any value (NaN, infinities, negatives, zero, huge, wrong
types) each check either passes or raises UserError, never another exception, and it passes exactly when an
independent predicate written here says the value is valid."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import make_checkpoint

from hf_attn.conversion import gqa, mla
from hf_attn.conversion.checkpoint.io import AttentionGeometry
from hf_attn.conversion.gqa import expand
from hf_attn.conversion.refine import RefineSettings, check_settings
from hf_attn.conversion.specs import CalibrationSpec, MLASpec
from hf_attn.conversion.training.data import HealSettings
from hf_attn.eval import perplexity, study
from hf_attn.tooling.errors import UserError, check_number, user_input

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.sampled_from([0, 1, -1, 0.5, 1.0, 2, float("nan"), float("inf"), -float("inf"), 1e-300, 5e-324]),
)
ANY = st.one_of(NUMBERS, st.none(), st.booleans(), st.text(max_size=4))
GEOMETRY = AttentionGeometry(num_layers=2, hidden_size=36, num_heads=6, num_kv_heads=3, head_dim=6)


def finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def whole(x) -> bool:
    return finite_number(x) and float(x) == int(x)


@FAST
@given(value=ANY, minimum=st.sampled_from([0, 1, 2]), inclusive=st.booleans(), integer=st.booleans())
def test_check_number_passes_exactly_the_finite_numbers_in_range(value, minimum, inclusive, integer):
    valid = value is None or (
        finite_number(value)
        and (whole(value) or not integer)
        and (value >= minimum if inclusive else value > minimum)
    )
    try:
        assert check_number("--x", value, minimum=minimum, inclusive=inclusive, integer=integer) is value
        assert valid, value
    except UserError as err:
        assert not valid and str(err).startswith("--x must be a finite"), (value, err)


@FAST
@given(groups=st.integers(min_value=-5, max_value=12))
def test_gqa_groups(groups):
    valid = 1 <= groups <= 3 and 3 % groups == 0
    try:
        assert gqa.check_pooling(GEOMETRY, groups).num_groups == groups and valid
    except UserError:
        assert not valid


@FAST
@given(heads=st.one_of(st.none(), st.integers(min_value=-5, max_value=12)))
def test_expand_heads(heads):
    target = 6 if heads is None else heads
    valid = target in (3, 6)  # multiples of 3 KV heads that divide 6 query heads
    try:
        assert expand.check_expansion(GEOMETRY, heads) == target and valid
    except UserError:
        assert not valid


@FAST
@given(
    kv_budget=st.one_of(st.none(), NUMBERS),
    kv_lora_rank=st.one_of(st.none(), st.integers(min_value=-3, max_value=40)),
    rope_pairs=st.one_of(st.none(), st.integers(min_value=-2, max_value=5)),
    tokens=st.integers(min_value=-2, max_value=100),
    factorization=st.sampled_from(["weight-svd", "activation", "attention"]),
)
def test_mla_options(kv_budget, kv_lora_rank, rope_pairs, tokens, factorization):
    kwargs = dict(kv_lora_rank=kv_lora_rank, kv_budget=kv_budget, rope_pairs=rope_pairs)
    try:
        spec = MLASpec(**kwargs, rope_selection="high", factorization=factorization)
        shape = mla.check_spec(spec, CalibrationSpec(tokens=tokens), GEOMETRY)
    except UserError:
        return
    # passed: every value is in range (checked here independently) and the plan is valid
    assert kv_budget is None or (finite_number(kv_budget) and 0 < kv_budget <= 1)
    assert kv_lora_rank is None or kv_lora_rank >= 1
    assert rope_pairs is None or 0 <= rope_pairs <= 3
    assert tokens >= (33 if factorization == "attention" else 1)  # attention statistics: every 32nd query
    cached = shape.kv_lora_rank + 3 * 2 * shape.rope_pairs  # latent + one RoPE key per KV head
    assert shape.kv_lora_rank >= 1 and 0 <= shape.rope_pairs <= 3
    if kv_budget is not None:
        assert cached <= kv_budget * 2 * 18 + 1e-9


@FAST
@given(steps=NUMBERS, lr=st.one_of(st.none(), NUMBERS), relative_lr=NUMBERS, tokens=NUMBERS)
def test_refine_options(steps, lr, relative_lr, tokens):
    s = RefineSettings(
        model="m", output="o", steps=steps, lr=lr, relative_lr=relative_lr, calibration_tokens=tokens
    )
    valid = (
        whole(steps)
        and steps >= 1
        and (lr is None or (finite_number(lr) and lr > 0))
        and finite_number(relative_lr)
        and relative_lr > 0
        and whole(tokens)
        and tokens >= 1
    )
    try:
        check_settings(s)
        assert valid
    except UserError:
        assert not valid


@FAST
@given(lr=NUMBERS, seq_len=NUMBERS, max_minutes=st.one_of(st.none(), NUMBERS))
def test_heal_options(lr, seq_len, max_minutes):
    s = HealSettings(output="o", lr=lr, seq_len=seq_len, max_minutes=max_minutes)
    positive = lambda x: finite_number(x) and x > 0  # noqa: E731
    valid = positive(lr) and positive(seq_len) and (max_minutes is None or positive(max_minutes))
    try:
        with user_input():
            s.validate()
        assert valid
    except UserError:
        assert not valid


@FAST
@given(eval_tokens=NUMBERS, heal_lr=NUMBERS, refine_steps=NUMBERS)
def test_study_settings(eval_tokens, heal_lr, refine_steps):
    base, _ = study.load_config(study.DEFAULT_CONFIG, "quick")
    s = dataclasses.replace(base, eval_tokens=eval_tokens, heal_lr=heal_lr, refine_steps=refine_steps)
    valid = (
        whole(eval_tokens)
        and eval_tokens > 0
        and finite_number(heal_lr)
        and heal_lr > 0
        and whole(refine_steps)
        and refine_steps >= 0
    )
    try:
        study.check_settings(s, "the test")
        assert valid
    except UserError:
        assert not valid


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("props") / "tiny")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    context=st.integers(min_value=-2, max_value=600),
    stride=st.one_of(st.none(), st.integers(min_value=-2, max_value=600)),
    max_tokens=st.one_of(st.none(), st.integers(min_value=-2, max_value=10**6)),
    batch=st.integers(min_value=-2, max_value=4),
)
def test_perplexity_window_options(tiny, context, stride, max_tokens, batch):
    s = perplexity.PerplexitySettings(
        model=str(tiny), context_length=context, stride=stride, max_tokens=max_tokens, batch_size=batch
    )
    valid = (
        2 <= context <= 512  # the tiny model's positions
        and (stride is None or 1 <= stride <= context)
        and (max_tokens is None or max_tokens >= 2)
        and batch >= 1
    )
    try:
        perplexity.validate(s)
        assert valid
    except UserError:
        assert not valid
