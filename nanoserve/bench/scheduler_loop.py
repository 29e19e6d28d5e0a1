"""The scheduler's own cost with many requests running and no model: the time ``Engine.plan()``
takes to plan a step, and the CPU the scheduler process's loop spends per output token.

``time_plan`` drives an Engine (no sockets) in steady decode, each step answered at once with
one sample per sampling item. ``loop_cpu_per_token`` runs the real ``SchedulerProcess`` loop (its
sockets over ipc, routing, heartbeats, gauges) one ``turn`` at a time in this thread, which also
plays the worker (answering every step at once) and one frontend. Only the scheduler's turns are
timed, in thread CPU time: what the two stand-ins cost is left out, and so is the work of
ZeroMQ's I/O thread.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from protocol.addresses import Addresses
from protocol.channel import Channel
from protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    FrontendHello,
    Heartbeat,
    Outputs,
    RequestOutput,
    Sample,
    SamplingParams,
    SchedulerInfo,
    SchedulerToFrontend,
    SchedulerToWorker,
    StepInput,
    StepResult,
    WorkerReady,
)
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine

if TYPE_CHECKING:
    from scheduler.process import SchedulerProcess

BLOCK_SIZE = 16
PROMPT_LEN = 100  # tokens, plus 0..15 so that requests reach block boundaries on different steps
TOKEN_BUDGET = 2048  # as served by default (``nanoserve scheduler --token-budget``)
SAMPLED = 11  # every sample's token: no request stops on it (no EOS, ignore_eos)
PARAMS = SamplingParams(max_tokens=10_000, ignore_eos=True)  # 632 blocks at most


def bench_ready(num_requests: int) -> WorkerReady:
    """A worker's announcement with a slot for each request and room for each to grow."""
    return WorkerReady(
        protocol_version=PROTOCOL_VERSION,
        model_id="bench",
        num_blocks=max(1024, num_requests * 64),
        block_size=BLOCK_SIZE,
        num_slots=num_requests,
        max_model_len=1 << 16,
        eos_token_ids=[],
        vocab_size=1000,
    )


def bench_prompts(num_requests: int) -> list[list[int]]:
    """One prompt a request; requests ``i`` and ``i + 50`` share a prefix (prefix caching)."""
    return [[1 + i % 50] * (PROMPT_LEN + i % BLOCK_SIZE) for i in range(num_requests)]


def answer(step: StepInput) -> StepResult:
    """A worker's instant answer: one sample per item that samples."""
    samples = [Sample(request_id=i.request_id, token_id=SAMPLED) for i in step.items if i.sample]
    return StepResult(step_id=step.step_id, samples=samples)


def time_plan(num_requests: int, repeats: int) -> float:
    """Median seconds of one ``Engine.plan()`` (schedule() and its StepInput) in steady decode
    with ``num_requests`` running and a step in flight, as the process runs it."""
    engine = Engine(bench_ready(num_requests), SchedulerConfig(token_budget=TOKEN_BUDGET))
    for i, prompt in enumerate(bench_prompts(num_requests)):
        engine.add_request(f"r{i}", prompt, PARAMS)
    decoding: set[str] = set()
    while len(decoding) < num_requests:  # prefill, in chunks of the budget
        while engine.can_plan() and engine.plan() is not None:
            pass
        decoding.update(o.request_id for o in engine.apply(answer(engine.in_flight[0])))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step = engine.plan()
        times.append(time.perf_counter() - began)
        if step is None or len(step.items) != num_requests:
            raise RuntimeError("every request was meant to decode in every step")
        engine.apply(answer(engine.in_flight[0]))
    return statistics.median(times)


@dataclass(frozen=True)
class LoopCost:
    """What the scheduler's loop spent over the measured steps."""

    steps: int
    tokens: int  # output tokens the frontend received
    cpu_s: float  # the loop's thread CPU time

    @property
    def per_token_us(self) -> float:
        """Microseconds of CPU per output token."""
        return self.cpu_s / self.tokens * 1e6 if self.tokens else float("nan")


def loop_cpu_per_token(num_requests: int, steps: int, timeout_s: float = 120.0) -> LoopCost:
    """The scheduler loop's CPU per output token over ``steps`` steps in steady decode with
    ``num_requests`` running (after every request has its first token)."""
    from scheduler.process import SchedulerProcess  # zmq sockets: only when this runs

    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as directory:
        addresses = Addresses(frontend=f"ipc://{directory}/f", worker=f"ipc://{directory}/w")
        config = SchedulerConfig(token_budget=TOKEN_BUDGET)
        process = SchedulerProcess(config=config, addresses=addresses)
        context = zmq.Context()
        try:
            peers = _Peers(context, addresses)
            return peers.run(process, num_requests, steps, time.monotonic() + timeout_s)
        finally:
            context.destroy(linger=0)
            process.close()


class _Peers:
    """The worker and the frontend the scheduler talks to, both played by this thread."""

    def __init__(self, context: zmq.Context, addresses: Addresses) -> None:
        self.worker = Channel(_dealer(context, addresses.worker, b"w"), SchedulerToWorker)
        self.frontend = Channel(_dealer(context, addresses.frontend, b"f"), SchedulerToFrontend)
        self._beat_at = 0.0

    def run(
        self, process: SchedulerProcess, num_requests: int, steps: int, deadline: float
    ) -> LoopCost:
        """Announce the worker, add the requests, then turn the loop and play both peers."""
        poller = process.poller()
        self.frontend.send(FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id="bench"))
        self.worker.send(bench_ready(num_requests))
        while not self._ready():
            _check(deadline, "the scheduler never said the worker is ready")
            process.turn(poller)
        for i, prompt in enumerate(bench_prompts(num_requests)):
            add = AddRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=PARAMS)
            self.frontend.send(add)
        decoding: set[str] = set()
        answered = tokens = 0
        cpu = 0.0
        while answered < steps:
            _check(deadline, f"{answered} of {steps} steps in time")
            began = time.thread_time()
            process.turn(poller)
            spent = time.thread_time() - began
            measuring = len(decoding) == num_requests
            new_steps = self._answer_steps()
            outputs = self._outputs()
            if measuring:
                cpu += spent
                answered += new_steps
                tokens += sum(len(o.new_token_ids) for o in outputs)
            decoding.update(o.request_id for o in outputs)
        return LoopCost(steps=answered, tokens=tokens, cpu_s=cpu)

    def _ready(self) -> bool:
        for _, message in _received(self.frontend, 10):
            if isinstance(message, SchedulerInfo) and message.worker_ready:
                return True
        return False

    def _answer_steps(self) -> int:
        """Answer every step that came (waiting briefly for the first); how many."""
        n = 0
        for _, message in _received(self.worker, 100):
            if isinstance(message, StepInput):
                self.worker.send(answer(message))
                n += 1
        return n

    def _outputs(self) -> list[RequestOutput]:
        """Every output that came; a heartbeat each half second keeps the frontend alive."""
        now = time.monotonic()
        if now - self._beat_at >= 0.5:
            self._beat_at = now
            self.frontend.send(Heartbeat(sender="bench", time=time.time()))
        outputs = []
        for _, message in _received(self.frontend, 0):
            if isinstance(message, Outputs):
                outputs += message.outputs
        return outputs


def _dealer(context: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.connect(address)
    return socket


def _received(channel: Channel, wait_ms: int) -> list:
    """Every message queued on ``channel``, waiting up to ``wait_ms`` for the first."""
    if not channel.socket.poll(wait_ms):
        return []
    messages = []
    while channel.waiting():
        messages.append(channel.recv())
    return messages


def _check(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(f"the benchmark timed out: {what}")
