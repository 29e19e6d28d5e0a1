"""What one ``Scheduler.schedule()`` decides (a chunk of work per request, and the slots to empty
first), and the messages made from it: a StepItem per chunk for the worker, a RequestOutput per
applied sample for the frontends."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import RequestOutput, Rewind, Sample, StepItem
from scheduler.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """One request's work in one iteration: ``num_tokens`` tokens from position ``start``."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    new_blocks: list[int]  # appended to the worker's row (the whole table when fresh)
    epoch: int = 0  # the request's epoch when scheduled: a preemption since makes it stale
    fresh: bool = False  # begins the request's row; positions below start are cache hits
    drafts: tuple[int, ...] = ()  # draft tokens after its last token, verified by this step
    attached: bool = False  # fresh, on K/V a lost worker wrote below start (Request.rollback)


@dataclass
class Batch:
    """What ``schedule()`` decided: the chunks to compute, the slots to empty first and the
    rows to cut back then."""

    chunks: list[ScheduledChunk]
    released_slots: list[int]
    rewinds: list[Rewind] = field(default_factory=list)


def step_item(chunk: ScheduledChunk) -> StepItem:
    """The StepItem that tells the worker to compute ``chunk``."""
    request, start = chunk.request, chunk.start
    token_ids = request.token_slice(start, start + chunk.num_tokens)
    if chunk.drafts:
        return StepItem(
            request_id=request.request_id,
            slot=request.slot,
            new_blocks=chunk.new_blocks,
            token_ids=token_ids + list(chunk.drafts),
            start=start,
            num_draft=len(chunk.drafts),
        )
    if not chunk.fresh:  # most items: the defaults spare a decode step its keyword arguments
        return StepItem(
            request_id=request.request_id,
            slot=request.slot,
            new_blocks=chunk.new_blocks,
            token_ids=token_ids,
            start=start,
            sample=chunk.sample,
        )
    return StepItem(
        request_id=request.request_id,
        slot=request.slot,
        new_blocks=chunk.new_blocks,
        token_ids=token_ids,
        start=start,
        sample=chunk.sample,
        params=request.params,
        prompt_len=request.num_prompt_tokens,
        fresh=True,
        cached_token_ids=request.token_slice(0, start),
        attached=chunk.attached,
    )


def request_output(
    request: Request, sample: Sample, reason: str | None, tokens: list[int] | None = None
) -> RequestOutput:
    """What a frontend hears of one applied sample (``tokens``: what a verification of
    drafts gained instead, which never asks for logprobs)."""
    if tokens is not None:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
    logprobs = None if request.params.logprobs is None else [sample.logprob or 0.0]
    tops = None if not request.params.logprobs else [sample.top_logprobs or []]
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[sample.token_id],
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        logprobs=logprobs,
        top_logprobs=tops,
        num_cached_tokens=request.num_cached_tokens or 0,
    )


def merge_outputs(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs, step by step, as one: every token, logprob and the finish."""
    tokens = [t for o in outputs for t in o.new_token_ids]
    logprobs = (
        None
        if not outputs or outputs[0].logprobs is None
        else [lp for o in outputs for lp in o.logprobs or []]
    )
    top = (
        None
        if not outputs or outputs[0].top_logprobs is None
        else [alternatives for o in outputs for alternatives in o.top_logprobs or []]
    )
    return RequestOutput(
        request_id=request_id,
        new_token_ids=tokens,
        finish_reason=outputs[-1].finish_reason if outputs else None,
        num_prompt_tokens=outputs[0].num_prompt_tokens if outputs else 0,
        logprobs=logprobs,
        top_logprobs=top,
        num_cached_tokens=outputs[0].num_cached_tokens if outputs else 0,
    )
