"""FakeScheduler: a scripted ROUTER that stands in for the scheduler in frontend tests.

It answers FrontendHello with SchedulerInfo and each AddRequest with the tokens of a fixed reply
(one token per Outputs message), finishing with "length" at max_tokens or with an EOS token and
"stop". As the real scheduler does, it sends its gauges on every heartbeat and with the output
that ends a request. It records every message it receives, so tests can assert on adds and
aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio

from protocol.channel import BadMessage, Channel
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineStats,
    FrontendHello,
    FrontendToScheduler,
    Heartbeat,
    Outputs,
    RequestOutput,
    SchedulerInfo,
)

EOS = 2


class FakeScheduler:
    """Scripted scheduler. ``reply(request) -> token ids`` decides each request's tokens."""

    def __init__(
        self,
        address: str,
        reply: Callable[[AddRequest], list[int]],
        *,
        max_model_len: int = 2048,
        num_blocks: int = 256,
        block_size: int = 16,
        worker_ready: bool = True,
        token_delay: float = 0.0,
        protocol_version: int = PROTOCOL_VERSION,
        worker_plan: dict[str, str] | None = None,
        heartbeat_s: float = 0.1,
        beat_stats: bool = True,
        tokens_per_step: int = 1,
    ) -> None:
        self.address = address
        self.reply = reply
        self.geometry = dict(
            max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size
        )
        self.worker_ready = worker_ready
        self.token_delay = token_delay
        self.protocol_version = protocol_version
        self.worker_plan = worker_plan or {}
        self.heartbeat_s = heartbeat_s
        self.beat_stats = beat_stats  # False: gauges come only with the outputs that end
        self.tokens_per_step = tokens_per_step  # >1: one output carries several (drafts verified)
        self.num_waiting = 0  # what the gauges report as waiting (tests set it)
        self.adds: list[AddRequest] = []
        self.aborts: list[str] = []
        self.aborted = asyncio.Event()
        self.hello = asyncio.Event()
        self.peers: set[bytes] = set()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._channel: Channel[FrontendToScheduler] = Channel(self._socket, FrontendToScheduler)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._main: list[asyncio.Task[None]] = []
        self.steps = 0
        self.cached_tokens = 0  # what each output reports as prompt tokens found cached

    def start(self) -> None:
        """Start receiving and heartbeating."""
        loop = asyncio.get_running_loop()
        self._main = [loop.create_task(self._serve()), loop.create_task(self._heartbeat())]

    async def close(self) -> None:
        """Stop everything and unbind."""
        for task in [*self._main, *self._tasks.values()]:
            task.cancel()
        await asyncio.gather(*self._main, *self._tasks.values(), return_exceptions=True)
        self._context.destroy(linger=0)

    def info(self) -> SchedulerInfo:
        """The SchedulerInfo this fake answers with."""
        return SchedulerInfo(
            protocol_version=self.protocol_version,
            worker_ready=self.worker_ready,
            model_id="fake",
            **self.geometry,
            worker_plan=self.worker_plan,
        )

    async def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames to every known frontend (garbage tests)."""
        for peer in self.peers:
            await self._socket.send_multipart([peer, *frames])

    async def _serve(self) -> None:
        while True:
            try:
                peer, message = await self._channel.arecv()
            except BadMessage:
                continue
            if peer is None:
                continue
            match message:
                case FrontendHello():
                    self.peers.add(peer)
                    self.hello.set()
                    await self._channel.asend(self.info(), peer)
                case AddRequest():
                    self.adds.append(message)
                    task = asyncio.get_running_loop().create_task(self._generate(peer, message))
                    self._tasks[message.request_id] = task
                case Abort():
                    self.aborts.append(message.request_id)
                    self.aborted.set()
                    task = self._tasks.pop(message.request_id, None)
                    if task is not None:
                        task.cancel()
                case Heartbeat():
                    pass

    async def _heartbeat(self) -> None:
        while True:
            stats = self.stats() if self.beat_stats else None
            beat = Heartbeat(sender="fake", time=0.0, stats=stats)
            for peer in list(self.peers):
                await self._channel.asend(beat, peer)
            await asyncio.sleep(self.heartbeat_s)

    async def _generate(self, peer: bytes, request: AddRequest) -> None:
        tokens = self.reply(request)
        params = request.params
        step: list[int] = []
        for position in range(params.max_tokens):
            token = tokens[position] if position < len(tokens) else EOS
            step.append(token)
            finish = None
            if token == EOS or token in params.stop_token_ids:
                finish = "stop"
            elif position + 1 == params.max_tokens:
                finish = "length"
            if finish is None and len(step) < self.tokens_per_step:
                continue
            await asyncio.sleep(self.token_delay)
            self.steps += 1
            if finish is not None:  # its gauges count it ended, as the scheduler's do
                self._tasks.pop(request.request_id, None)
            await self._channel.asend(self._outputs(request, step, finish), peer)
            step = []
            if finish is not None:
                return
        self._tasks.pop(request.request_id, None)

    def _outputs(self, request: AddRequest, step: list[int], finish: str | None) -> Outputs:
        logprobs = top = None
        if request.params.logprobs is not None:
            logprobs = [-0.5] * len(step)
            top = [[(t, -0.5), (t + 1, -1.5)][: request.params.logprobs] for t in step]
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=step,
            finish_reason=finish,
            num_prompt_tokens=len(request.prompt_token_ids),
            logprobs=logprobs,
            top_logprobs=top,
            num_cached_tokens=self.cached_tokens,
        )
        return Outputs(outputs=[output], stats=self.stats() if finish is not None else None)

    def stats(self) -> EngineStats:
        """The gauges, as of now."""
        return EngineStats(
            num_running=len(self._tasks),
            num_waiting=self.num_waiting,
            kv_blocks_total=self.geometry["num_blocks"],
            kv_blocks_used=len(self._tasks),
            num_steps_total=self.steps,
            worker_ready=self.worker_ready,
        )
