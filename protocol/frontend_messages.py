"""The messages between a frontend and the scheduler (conventions: ``protocol.messages``, which
re-exports them)."""

from __future__ import annotations

import msgspec

from protocol.base import Heartbeat, Message
from protocol.params import SamplingParams
from protocol.stats import EngineStats

# ---------------------------------------------------------------------------------------------
# Frontend -> scheduler


class FrontendHello(Message):
    """A frontend introduces itself; the scheduler answers with SchedulerInfo."""

    protocol_version: int
    frontend_id: str


class AddRequest(Message):
    """A new request, already tokenized and validated by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # requests share cached blocks only with equal salts


class Abort(Message):
    """Drop a request wherever it is; everything it holds returns to the pools."""

    request_id: str


FrontendToScheduler = AddRequest | Abort | FrontendHello | Heartbeat


# ---------------------------------------------------------------------------------------------
# Scheduler -> frontend


class RequestOutput(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """What one request gained in one step.

    ``new_token_ids`` includes a stop or EOS token when that is what finished the request (as
    transformers' generate does); the frontend leaves it out of the text. ``finish_reason`` is
    None while the request runs, then one of "stop", "length", "abort", "error".
    ``logprobs`` and ``top_logprobs`` run parallel to ``new_token_ids`` when asked for.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache


class Outputs(Message):
    """Every output one step produced for one frontend. ``stats``: the scheduler's gauges when
    one of the outputs ends its request (else None; they ride the Heartbeat), so a client that
    reads /metrics right after its reply finds its request's end counted."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class SchedulerInfo(Message):
    """The scheduler's answer to FrontendHello, and its notice when a worker comes or goes."""

    protocol_version: int
    worker_ready: bool
    model_id: str = ""
    max_model_len: int = 0
    num_blocks: int = 0
    block_size: int = 0
    reason: str = ""  # why no worker is ready (empty while one is)
    worker_plan: dict[str, str] = {}  # WorkerReady.plan of the ready worker ({} while none is)


SchedulerToFrontend = Outputs | SchedulerInfo | Heartbeat
