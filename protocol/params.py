"""SamplingParams, and check_params: the one place a request's parameters are checked.

SamplingParams' fields carry the fixed ranges (msgspec ``Meta``); ``RequestLimits`` holds what
a deployment sets: its vocabulary, and at most how many logprobs and stop ids it serves. The
frontend checks every request with ``check_params`` before sending one, and the scheduler checks
every AddRequest with it before queuing one, so a raw peer meets the same rules as an HTTP
client.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each token
MAX_STOP_TOKEN_IDS = 1024  # the most stop token ids one request may give
MAX_LOGIT_BIAS = 1024  # the most tokens one request's logit_bias may bias
# The longest grammar one request may carry. A JSON schema of a few hundred properties is tens of
# KiB; the bound keeps a raw peer from sending the worker a grammar that compiles for seconds.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_SPECULATIVE_TOKENS = 16  # the most draft tokens one request may verify in a step

_FLOAT_MAX = sys.float_info.max  # as an upper bound it rejects only infinity (and, like any, NaN)

TokenId = Annotated[int, Meta(ge=0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]


class SamplingParams(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """How one request chooses its tokens, and when it stops.

    ``temperature == 0`` means greedy. ``top_k is None`` and ``top_p == 1`` and ``min_p == 0``
    switch those filters off. ``logprobs is None`` returns no logprobs; ``0`` returns the
    sampled token's logprob only; ``N`` adds the top N alternatives.
    ``seed is None`` draws from the worker's own seeded generator.
    ``grammar`` (None: unconstrained) is an llguidance grammar, the JSON text
    ``llguidance.grammar_from`` makes (or Lark text): the worker lets through only the tokens
    it allows, and once it is complete only EOS, which then ends the request even before
    ``min_tokens``.
    ``num_speculative_tokens`` (None: the server's ``--num-speculative-tokens``; 0: off) is how
    many draft tokens the scheduler may verify for it in one step (``scheduler.drafter``).

    Each field carries its range (every float finite): a decoder enforces them, so a message
    that breaks one never decodes; ``__init__`` does not, and ``protocol.params.check_params``
    checks any instance against them and against a deployment's limits.
    """

    max_tokens: Annotated[int, Meta(ge=1)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=_FLOAT_MAX)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    num_speculative_tokens: Annotated[int, Meta(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None


@dataclass(frozen=True)
class RequestLimits:
    """The configurable bounds on one request, each within the protocol's own."""

    vocab_size: int
    max_logprobs: int = MAX_LOGPROBS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}"
            )
        if not 0 <= self.max_stop_token_ids <= MAX_STOP_TOKEN_IDS:
            limit = MAX_STOP_TOKEN_IDS
            raise ValueError(f"max_stop_token_ids must be in [0, {limit}]")


class ParamError(ValueError):
    """A request parameter out of bounds; ``param`` names the SamplingParams field, or
    ``prompt_token_ids``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_params(params: SamplingParams, prompt_ids: Sequence[int], limits: RequestLimits) -> None:
    """Raise ParamError unless ``params`` keep SamplingParams' ranges and ``limits``, every
    token id (prompt, stop ids, logit_bias keys) is in the vocabulary, and ``min_tokens`` does
    not exceed ``max_tokens``."""
    _check_ranges(params)
    vocab = limits.vocab_size
    _check_vocab("prompt_token_ids", "prompt", prompt_ids, vocab)
    _check_vocab("stop_token_ids", "stop", params.stop_token_ids, vocab)
    _check_vocab("logit_bias", "logit_bias", params.logit_bias or {}, vocab)
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        message = f"logprobs must be in [0, {limits.max_logprobs}], got {params.logprobs}"
        raise ParamError("logprobs", message)
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        message = f"at most {limits.max_stop_token_ids} stop token ids"
        raise ParamError("stop_token_ids", f"{message}, got {len(params.stop_token_ids)}")
    if params.min_tokens > params.max_tokens:
        message = f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})"
        raise ParamError("min_tokens", message)


_INDEX = re.compile(r"\$\[(\d+)\]")  # an array_like struct's field, by position


def _check_ranges(params: SamplingParams) -> None:
    """SamplingParams' ``Meta`` ranges on any instance: ``__init__`` does not check them, so
    the instance goes through the same conversion a decoder applies."""
    try:
        msgspec.convert(msgspec.to_builtins(params), SamplingParams)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _INDEX.search(text)
        if found is None:
            raise ParamError("params", f"invalid sampling parameters: {text}") from None
        name = SamplingParams.__struct_fields__[int(found.group(1))]
        value = getattr(params, name)
        if name == "grammar":  # too long to quote
            message = f"grammar must have 1 to {MAX_GRAMMAR_CHARS} characters, got {len(value)}"
            raise ParamError(name, message) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ParamError(name, f"{name} must be a finite number, got {value}") from None
        detail = text.split(" - at ")[0]
        raise ParamError(name, f"{name} out of range ({detail}), got {value!r}") from None


def _check_vocab(param: str, what: str, ids: Iterable[int], vocab_size: int) -> None:
    for token in ids:
        if not 0 <= token < vocab_size:
            message = f"{what} token ids must be in the vocabulary [0, {vocab_size}), got {token}"
            raise ParamError(param, message)
