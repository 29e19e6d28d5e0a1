"""Fleet simulation: a multi-turn trace through a real router in front of N simulated replicas.

Each simulated replica is the real scheduler (``Engine``: admission, the prefix cache, evictions,
preemption) over the model-free ``SimWorker``, behind an OpenAI chat endpoint on loopback: the
real tokenizer renders each conversation, and every step sleeps for what a step of its shape
would cost on the modelled device (``StepCost``: a fixed cost plus a cost per computed token),
so a prefix-cache hit saves modelled time exactly where it would save real time. All replicas
share one process and one event loop; the router (``sglang-router``) is the real one, in its own
process. bench serve's multi-turn client plays the conversations through the router.

What it predicts, for round-robin against cache-aware routing at 2, 4 and 8 replicas: the hit
rate (prompt tokens found cached, over all replicas) and the TTFT of later turns (mean and p99),
in the modelled time plus this machine's own overheads (HTTP, the router, the tokenizer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import subprocess
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from models.files import resolve_model
from models.tokenizer import ChatTokenizer, load_tokenizer
from nanoserve.bench.chat import MultiTurn, build_conversations
from nanoserve.bench.serve import BenchServeConfig
from nanoserve.fleet import router_command
from protocol.messages import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sim_worker import SimWorker


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds of one step: ``fixed`` plus ``per_token`` for each token it computes."""

    fixed: float = 0.004
    per_token: float = 0.00005

    def seconds(self, tokens: int) -> float:
        """The modelled time of a step that computes ``tokens`` tokens."""
        return self.fixed + self.per_token * tokens


class SimReplica:
    """One simulated replica: an OpenAI chat endpoint over an Engine on a SimWorker."""

    def __init__(self, tokenizer: ChatTokenizer, cost: StepCost, num_blocks: int = 2048) -> None:
        worker = SimWorker(num_blocks, 16, 64, max_model_len=8192, vocab_size=tokenizer.vocab_size)
        self.engine = Engine.for_worker(worker, SchedulerConfig(token_budget=2048))
        self.tokenizer, self.cost = tokenizer, cost
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()

    @property
    def hits(self) -> tuple[int, int]:
        """Prompt tokens found cached, and prompt tokens looked up."""
        cache = self.engine.scheduler.cache
        return cache.hits, cache.queries

    def app(self) -> web.Application:
        """The endpoints a router needs: health, models, streamed chat completions."""
        models = {"object": "list", "data": [{"id": "sim", "object": "model"}]}

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def listed(_: web.Request) -> web.Response:
            return web.json_response(models)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", listed)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def run(self) -> None:
        """Step the engine while it has work, each step taking its modelled time."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_unfinished():
                step = self.engine.in_flight[0] if self.engine.num_in_flight else None
                outputs = self.engine.step()
                computed = sum(len(item.token_ids) for item in step.items) if step else 0
                await asyncio.sleep(self.cost.seconds(computed or 1))
                for output in outputs:
                    self._queues[output.request_id].put_nowait(output)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = self.tokenizer.apply_chat_template(body["messages"])
        request_id = f"r{next(self._ids)}"
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), ignore_eos=True)
        self._queues[request_id] = queue = asyncio.Queue()
        self.engine.add_request(request_id, prompt, params)
        self._wake.set()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                output = await queue.get()
                text = "".join(f" w{token % 1000}" for token in output.new_token_ids)
                await _send(response, {"choices": [{"index": 0, "delta": {"content": text}}]})
                if output.finish_reason is not None:
                    break
            usage = {"prompt_tokens": len(prompt), "completion_tokens": params.max_tokens}
            usage["prompt_tokens_details"] = {"cached_tokens": output.num_cached_tokens}
            await _send(response, {"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
        finally:
            del self._queues[request_id]
        return response


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


async def start_replicas(
    replicas: list[SimReplica], ports: list[int]
) -> tuple[list[web.AppRunner], list[asyncio.Task]]:
    """Serve each replica on 127.0.0.1 at its port; returns the runners and step loops."""
    runners, loops = [], []
    for replica, port in zip(replicas, ports, strict=True):
        runner = web.AppRunner(replica.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        loops.append(asyncio.create_task(replica.run()))
    return runners, loops


async def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until ``url``/v1/models answers 200 (a router that sees its replicas)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/v1/models") as response:
                    if response.status == 200 and (await response.json(content_type=None)).get(
                        "data"
                    ):
                        return
            except aiohttp.ClientError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout} s")
            await asyncio.sleep(0.2)


@dataclass(frozen=True)
class FleetTrace:
    """The multi-turn trace every configuration replays (the same seed: the same trace)."""

    conversations: int = 32
    turns: int = 4
    system_len: int = 300  # words of the shared system prompt
    turn_len: int = 40  # words of each user message
    output_len: int = 16
    seed: int = 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (and, for the router's metrics, nor
    on the one after it)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port + 1)) != 0:
                return port


async def simulate(
    num_replicas: int, policy: str, trace: FleetTrace, cost: StepCost, router: str, log=None
) -> dict[str, object]:
    """One configuration: fresh replicas, the router in front, the trace through it (the
    router's output to ``log``, a file, or nowhere)."""
    log = log or subprocess.DEVNULL
    # The router probes each replica for gRPC first: aiohttp logs each probe as a bad request.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    tokenizer = load_tokenizer(resolve_model(None))
    replicas = [SimReplica(tokenizer, cost) for _ in range(num_replicas)]
    ports = [free_port() for _ in replicas]
    runners, loops = await start_replicas(replicas, ports)
    port = free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    command = router_command(router, policy, urls, "127.0.0.1", port)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_ready(f"http://127.0.0.1:{port}")
        config = BenchServeConfig(
            base_url=f"http://127.0.0.1:{port}", endpoint_type="chat", dataset="multi-turn",
            prompt_format="text", output_len=trace.output_len, request_timeout=300,
        )  # fmt: skip
        conversations = build_conversations(
            trace.conversations, trace.turns, trace.system_len, trace.turn_len, trace.seed
        )
        async with aiohttp.ClientSession() as session:
            report = await MultiTurn(config, conversations).run(session, "sim")
    finally:
        process.terminate()
        process.wait(10)
        for task in loops:
            task.cancel()
        for runner in runners:
            await runner.cleanup()
    hits = sum(r.hits[0] for r in replicas)
    queries = sum(r.hits[1] for r in replicas)
    later = report["ttft_later_turns_ms"]
    return {
        "replicas": num_replicas,
        "policy": policy,
        "failed": report["failed"],
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_later_mean_ms": later["mean"],
        "ttft_p99_ms": report["ttft_ms"]["p99"],
        "busiest_share": max(r.hits[1] for r in replicas) / queries if queries else 0.0,
    }


def format_rows(rows: list[dict[str, object]]) -> str:
    """The round-robin against cache-aware table."""
    lines = [
        "replicas  policy        hit rate  TTFT later turns mean (ms)  TTFT p99 (ms)  busiest",
    ]
    for row in rows:
        lines.append(
            f"{row['replicas']:>8}  {row['policy']:<12}  {row['hit_rate']:>8.1%}"
            f"  {row['ttft_later_mean_ms'] or 0:>26.0f}  {row['ttft_p99_ms'] or 0:>13.0f}"
            f"  {row['busiest_share']:>7.0%}"
        )
    return "\n".join(lines)
