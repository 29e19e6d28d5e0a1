"""check_params: SamplingParams' ranges on any instance, then a deployment's limits; each error
names its field."""

from __future__ import annotations

import math

import msgspec
import pytest

from protocol.params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    ParamError,
    RequestLimits,
    SamplingParams,
    check_params,
)

LIMITS = RequestLimits(vocab_size=100)
OUT_OF_RANGE = [
    ("max_tokens", 0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", 0),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("logit_bias", {1: 100.5}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("seed", 2**63),
    ("logprobs", 21),
    ("logprobs", -1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ("min_tokens", -1),
    ("grammar", ""),
    ("grammar", "x" * (MAX_GRAMMAR_CHARS + 1)),
]
FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty"]
FLOATS += ["presence_penalty", "frequency_penalty"]


def test_defaults_pass() -> None:
    check_params(SamplingParams(), [1, 2], LIMITS)


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_each_range_is_checked_on_an_instance_init_let_through(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # __init__ checks no Meta
    with pytest.raises(ParamError) as raised:
        check_params(params, [1], LIMITS)
    assert raised.value.param == field
    with pytest.raises(msgspec.ValidationError):  # and a decoder refuses the same message
        msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(ParamError, match=f"^{field} ") as raised:
        check_params(SamplingParams(**{field: value}), [1], LIMITS)
    assert raised.value.param == field


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_logit_bias_values_must_be_finite(value: float) -> None:
    with pytest.raises(ParamError) as raised:
        check_params(SamplingParams(logit_bias={1: value}), [1], LIMITS)
    assert raised.value.param == "logit_bias"


def test_a_long_grammar_is_measured_not_quoted() -> None:
    params = SamplingParams(grammar="start: " + "x" * MAX_GRAMMAR_CHARS)
    with pytest.raises(ParamError, match=f"^grammar must have 1 to {MAX_GRAMMAR_CHARS} char"):
        check_params(params, [1], LIMITS)
    check_params(SamplingParams(grammar='start: "yes"'), [1], LIMITS)


@pytest.mark.parametrize(
    ("params", "prompt", "field"),
    [
        (SamplingParams(), [100], "prompt_token_ids"),
        (SamplingParams(), [-1], "prompt_token_ids"),
        (SamplingParams(stop_token_ids=[100]), [1], "stop_token_ids"),
        (SamplingParams(logit_bias={100: 1.0}), [1], "logit_bias"),
        (SamplingParams(min_tokens=3, max_tokens=2), [1], "min_tokens"),
    ],
)
def test_token_ids_and_min_tokens(params: SamplingParams, prompt: list[int], field: str) -> None:
    with pytest.raises(ParamError) as raised:
        check_params(params, prompt, LIMITS)
    assert raised.value.param == field


def test_configured_limits_are_narrower_than_the_protocol() -> None:
    limits = RequestLimits(vocab_size=100, max_logprobs=5, max_stop_token_ids=2)
    check_params(SamplingParams(logprobs=5, stop_token_ids=[1, 2]), [1], limits)
    with pytest.raises(ParamError, match=r"logprobs must be in \[0, 5\], got 6"):
        check_params(SamplingParams(logprobs=6), [1], limits)
    with pytest.raises(ParamError, match="at most 2 stop token ids, got 3"):
        check_params(SamplingParams(stop_token_ids=[1, 2, 3]), [1], limits)
    with pytest.raises(ValueError, match="max_logprobs"):
        RequestLimits(vocab_size=100, max_logprobs=21)
