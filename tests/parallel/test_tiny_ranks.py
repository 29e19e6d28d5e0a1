"""Tensor parallelism through the real processes: a scheduler, and a worker of 1, 2 or 4 ranks
(gloo on CPU) serving the seeded tiny Llama in float32. Greedy tokens at sizes 2 and 4 equal
size 1's, one request at a time and in a mixed batch with prefill chunks, prefix-cache hits and
preemptions. A raw DEALER stands in for the frontend (the tiny model has no tokenizer)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import zmq

from protocol.addresses import default_addresses
from protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    FrontendHello,
    Heartbeat,
    Outputs,
    SamplingParams,
    SchedulerInfo,
    SchedulerToFrontend,
)
from tests.faults.raw import ENCODE, dealer, received
from tests.servers import Server, start_server

BLOCK = 4
BUDGET = 8  # tokens per step: every prompt below is prefilled in chunks
SHARED = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks every pressure prompt begins with
CALM = [[3 + i, 40 + 7 * i, 90, 17 + i, 250 - i, 33, 64] for i in range(2)]
PRESSURE = [SHARED + [(13 * i + j) % 250 + 3 for j in range(4 + i)] for i in range(8)]
MAX_TOKENS = 20


def _serve(tiny_dir: Path, log_dir: Path, size: int) -> Server:
    """A scheduler and a worker of ``size`` ranks, on a pool too small for PRESSURE at once."""
    return start_server(
        log_dir,
        roles=("scheduler", "worker"),
        run_id=f"tp{size}-{uuid.uuid4().hex[:8]}",
        audit=1,
        token_budget=BUDGET,
        model=tiny_dir,
        dtype="float32",
        block_size=BLOCK,
        num_blocks=24,
        num_slots=4,
        max_model_len=64,
        threads=1,
        tensor_parallel_size=size,
    )


class RawFrontend:
    """Sends AddRequests and collects each request's tokens until it finishes."""

    def __init__(self, run_id: str) -> None:
        self.context = zmq.Context()
        self.socket = dealer(self.context, default_addresses(run_id).frontend)
        self.socket.send(ENCODE(FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id="t")))
        self.preemptions = 0
        self.cached_tokens = 0  # the most prompt tokens one admission found cached

    def beat(self) -> None:
        """A raw frontend must beat too, or the scheduler drops it as silent."""
        self.socket.send(ENCODE(Heartbeat(sender="t", time=time.time())))

    def wait_ready(self, server: Server, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.beat()
            server.check_alive()
            for message in received(self.socket, SchedulerToFrontend, 0.2):
                if isinstance(message, SchedulerInfo) and message.worker_ready:
                    return
        raise AssertionError(f"no worker ready\n{server.logs()}")

    def generate(self, server: Server, prompts: list[list[int]], timeout: float = 120.0):
        """Greedy tokens of every prompt, all submitted at once."""
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ids = [f"r{uuid.uuid4().hex[:6]}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.socket.send(
                ENCODE(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params))
            )
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        finished: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(finished) < len(ids):
            if time.monotonic() > deadline:
                raise AssertionError(f"requests unfinished after {timeout}s\n{server.logs()}")
            server.check_alive()
            self.beat()
            for message in received(self.socket, SchedulerToFrontend, 0.2):
                if not isinstance(message, Outputs):
                    continue
                if message.stats is not None:
                    self.preemptions = message.stats.num_preemptions_total
                for output in message.outputs:
                    assert output.error is None, output.error
                    tokens[output.request_id] += output.new_token_ids
                    self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
                    if output.finish_reason is not None:
                        finished.add(output.request_id)
        return [tokens[i] for i in ids]

    def close(self) -> None:
        self.context.destroy(linger=0)


def _run(tiny_dir: Path, log_dir: Path, size: int) -> dict:
    """CALM one request at a time, then PRESSURE all at once, on a fresh server of ``size``."""
    server = _serve(tiny_dir, log_dir, size)
    frontend = RawFrontend(server.run_id)
    try:
        frontend.wait_ready(server)
        calm = [frontend.generate(server, [prompt])[0] for prompt in CALM]
        before = frontend.preemptions
        pressure = frontend.generate(server, PRESSURE)
        return {
            "calm": calm,
            "pressure": pressure,
            "preemptions": frontend.preemptions - before,
            "cached": frontend.cached_tokens,
        }
    finally:
        frontend.close()
        server.stop()


@pytest.fixture(scope="module")
def solo(tiny_dir, tmp_path_factory) -> dict:
    return _run(tiny_dir, tmp_path_factory.mktemp("tp1"), 1)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_give_the_tokens_of_one(solo, tiny_dir, tmp_path, size):
    assert all(len(tokens) == MAX_TOKENS for tokens in solo["calm"] + solo["pressure"])
    assert solo["preemptions"] > 0 and solo["cached"] > 0
    assert all(len(p) > BUDGET for p in PRESSURE)
    split = _run(tiny_dir, tmp_path, size)
    assert split["calm"] == solo["calm"]
    assert split["pressure"] == solo["pressure"]
    assert split["preemptions"] > 0 and split["cached"] > 0
    log = (tmp_path / "scheduler.log").read_text()
    assert f"{size} ranks" in log
