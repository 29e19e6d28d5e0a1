"""Generation: one HTTP request's life against the scheduler, as a stream of choice updates.

It fans the request out into ``n`` scheduler requests that share one queue, detokenizes each
choice, applies stop strings (aborting the scheduler request when one matches), records the
latency metrics, and aborts whatever is still running when the HTTP request goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from frontend.client import Delivery, SchedulerClient, SchedulerLost
from frontend.detokenizer import Detokenizer
from frontend.errors import ApiError
from frontend.metrics import Metrics
from frontend.request_parser import GenerationRequest
from models.tokenizer import ChatTokenizer
from protocol.messages import RequestOutput


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its best alternatives ``[(token_id, logprob)]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class ChoiceUpdate:
    """What one choice gained from one scheduler output."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


@dataclass
class _Choice:
    detokenizer: Detokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


class Generation:
    """Runs one validated request; iterate ``updates()`` once."""

    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        client: SchedulerClient,
        tokenizer: ChatTokenizer,
        metrics: Metrics,
    ) -> None:
        self.request = request
        self.request_id = request_id
        self._client = client
        self._metrics = metrics
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._choices = [
            _Choice(Detokenizer(tokenizer.tokenizer, request.stop)) for _ in range(request.n)
        ]
        self._arrival = time.monotonic()
        self._started = False
        self.cached_tokens = 0  # prompt tokens the prefix cache held (the first choice's)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length (counted once, however many choices)."""
        return len(self.request.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices, a final stop or EOS token included."""
        return sum(choice.num_tokens for choice in self._choices)

    def finish_reason(self, index: int) -> str | None:
        """How choice ``index`` ended (None while it runs)."""
        return self._choices[index].finish_reason

    def _sub_id(self, index: int) -> str:
        return self.request_id if self.request.n == 1 else f"{self.request_id}-{index}"

    def start(self) -> None:
        """Send every choice to the scheduler; ApiError 503 when it is not there."""
        try:
            for index in range(self.request.n):
                params = self.request.params_for(index)
                sub_id = self._sub_id(index)
                self._client.add(
                    sub_id,
                    index,
                    self.request.prompt_ids,
                    params,
                    self._queue,
                    self.request.cache_salt,
                )
        except SchedulerLost as exc:
            self.close()
            raise _unavailable(exc) from None
        self._metrics.in_flight.inc()
        self._started = True

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yield updates until every choice has finished; ApiError 503 if the scheduler goes."""
        try:
            while any(choice.finish_reason is None for choice in self._choices):
                delivery = await self._queue.get()
                if isinstance(delivery, SchedulerLost):
                    raise delivery
                for update in self._apply(*delivery):
                    yield update
        except SchedulerLost as exc:
            self._metrics.rejected.labels("503").inc()
            raise _unavailable(exc) from None

    def close(self) -> None:
        """Abort every choice still running (the client left, or an error); idempotent."""
        for index, choice in enumerate(self._choices):
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self._client.abort(self._sub_id(index))
        if self._started:
            self._started = False
            self._metrics.in_flight.dec()

    def _apply(self, index: int, output: RequestOutput) -> list[ChoiceUpdate]:
        """One update per shown token, the last one carrying the finish reason. A step that
        verified drafts delivers several tokens at once; like llama.cpp's server (and OpenAI's
        API) every token still reaches the client as its own chunk."""
        choice = self._choices[index]
        tokens = output.new_token_ids
        if index == 0 and choice.num_tokens == 0:
            self.cached_tokens = output.num_cached_tokens
        # The stop or EOS token that ended the request is counted but never shown.
        shown = len(tokens) - 1 if output.finish_reason == "stop" and tokens else len(tokens)
        updates: list[ChoiceUpdate] = []
        stopped = False
        for position, token in enumerate(tokens):
            choice.num_tokens += 1
            if position >= shown:
                break
            logprobs: list[TokenLogprob] = []
            if output.logprobs is not None and position < len(output.logprobs):
                top = output.top_logprobs[position] if output.top_logprobs else []
                logprobs.append(TokenLogprob(token, output.logprobs[position], list(top)))
            stopped = choice.detokenizer.add(token)
            text = "" if stopped else choice.detokenizer.pop_text()
            updates.append(ChoiceUpdate(index, text, logprobs, None))
            if stopped:
                break
        self._observe_tokens(choice, len(tokens))
        finish = "stop" if stopped else output.finish_reason
        if output.finish_reason == "error":
            raise SchedulerLost(output.error or "the request failed in the engine")
        if stopped and output.finish_reason is None:
            self._client.abort(self._sub_id(index))  # a stop string ended it here
        tail = choice.detokenizer.pop_text(final=finish is not None)
        if finish is not None:
            self._finish(choice, finish)
        if not updates:
            return [ChoiceUpdate(index, tail, [], finish)]
        last = updates[-1]
        updates[-1] = ChoiceUpdate(index, last.text + tail, last.logprobs, finish)
        return updates

    def _observe_tokens(self, choice: _Choice, count: int) -> None:
        if count == 0:
            return
        now = time.monotonic()
        self._metrics.generation_tokens.inc(count)
        if choice.first_token_time is None:
            choice.first_token_time = now
            self._metrics.observe_ttft(now - self._arrival)
            self._metrics.prompt_tokens.inc(self.prompt_tokens)
        elif choice.last_token_time is not None:
            self._metrics.observe_itl((now - choice.last_token_time) / count, count)
        choice.last_token_time = now

    def _finish(self, choice: _Choice, reason: str) -> None:
        choice.finish_reason = reason
        self._metrics.finished.labels(reason).inc()
        self._metrics.e2e.observe(time.monotonic() - self._arrival)


def _unavailable(exc: Exception) -> ApiError:
    return ApiError(503, f"scheduler unavailable: {exc}", code="scheduler_unavailable")
