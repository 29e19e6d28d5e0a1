"""Two replicas behind a router people already run (the SGLang Model Gateway, ``sglang-router``,
from its PyPI wheel) on loopback, on bench serve's multi-turn workload (16 conversations):

- the prefix-cache hit rate (each replica's /metrics) and the mean TTFT of later turns, one
  replica alone against round-robin and cache-aware routing: cache-aware keeps at least 90% of
  one replica's hit rate;
- one replica's worker SIGKILLed mid-run: no request fails, the requests on that replica resume
  there, and the router keeps routing to both.

The default model on this 2-core machine: the figures show correctness, not speed. Each run
uses conversations of its own (another seed, another system prompt), so no run finds another's
prefix cached. The figures are printed and written to the log directory as routers.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from nanoserve.bench.chat import MultiTurn, build_conversations
from nanoserve.bench.serve import BenchServeConfig
from nanoserve.fleet import router_command
from tests.servers import free_port, start_server

ROUTER = shutil.which("sglang-router") or os.path.join(
    os.path.dirname(sys.executable), "sglang-router"
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(ROUTER), reason="pip install sglang-router"),
]
MODEL = "SmolLM2-135M-Instruct"
HITS, QUERIES = "nanoserve:prefix_cache_hits_total", "nanoserve:prefix_cache_queries_total"
FIGURES: dict[str, dict] = {}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("routers")
    started = []
    try:
        for name in ("a", "b"):
            options = dict(audit=1, threads=1, num_slots=32)
            started.append(start_server(log_dir / name, supervised=("worker",), **options))
        yield started
    finally:
        for server in started:
            server.stop()
        print("\nrouters:", json.dumps(FIGURES, indent=1))
        (log_dir / "routers.json").write_text(json.dumps(FIGURES, indent=1))


class Router:
    """sglang-router in front of ``urls``, ended by PID."""

    def __init__(self, policy: str, urls: list[str], log_path) -> None:
        port = free_port()
        while _busy(port + 1):  # its Prometheus port
            port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        command = router_command("sglang-router", policy, urls, "127.0.0.1", port)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as response:
                    if json.loads(response.read()).get("data"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("sglang-router not ready in 60 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _busy(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _counters(servers) -> list[tuple[float, float]]:
    return [(m[HITS], m[QUERIES]) for m in (s.metrics() for s in servers)]


async def _multi_turn(url: str, seed: int, turns: int = 3) -> dict:
    config = BenchServeConfig(
        base_url=url, endpoint_type="chat", dataset="multi-turn", prompt_format="text",
        output_len=8, request_timeout=300,
    )  # fmt: skip
    conversations = build_conversations(16, turns, system_len=150, turn_len=20, seed=seed)
    async with aiohttp.ClientSession() as session:
        return await MultiTurn(config, conversations).run(session, MODEL)


def _run(name: str, url: str, servers, seed: int) -> dict:
    before = _counters(servers)
    report = asyncio.run(_multi_turn(url, seed))
    after = _counters(servers)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    figures = {
        "failed": report["failed"],
        "completed": report["completed"],
        "hit_rate": hits / sum(queries),
        "mean_ttft_later_turns_ms": report["ttft_later_turns_ms"]["mean"],
        "prompt_tokens_per_replica": queries,
    }
    FIGURES[name] = figures
    return figures


def test_cache_aware_routing_keeps_one_replicas_hit_rate(replicas, tmp_path) -> None:
    alone = _run("one replica", replicas[0].url, replicas, seed=11)
    urls = [server.url for server in replicas]
    for policy, seed in (("round_robin", 12), ("cache_aware", 13)):
        router = Router(policy, urls, tmp_path / f"{policy}.log")
        try:
            _run(policy, router.url, replicas, seed)
        finally:
            router.stop()
    for name in ("one replica", "round_robin", "cache_aware"):
        assert FIGURES[name]["failed"] == 0 and FIGURES[name]["completed"] == 48, name
    assert FIGURES["round_robin"]["prompt_tokens_per_replica"][1] > 0  # both replicas served
    assert FIGURES["cache_aware"]["hit_rate"] >= 0.9 * alone["hit_rate"], FIGURES


def test_a_killed_worker_costs_no_request_and_the_router_keeps_routing(replicas, tmp_path) -> None:
    a, b = replicas
    router = Router("round_robin", [a.url, b.url], tmp_path / "kill.log")
    try:

        async def run_and_kill() -> tuple[dict, int]:
            load = asyncio.create_task(_multi_turn(router.url, seed=21, turns=4))
            start = a.metrics()[QUERIES]
            deadline = time.monotonic() + 60
            while a.metrics()[QUERIES] == start:  # a request reached replica a
                if time.monotonic() > deadline:
                    raise AssertionError("no request reached replica a")
                await asyncio.sleep(0.05)
            victim = a.child_pid("worker")
            os.kill(victim, signal.SIGKILL)
            return await load, victim

        before = _counters(replicas)
        report, victim = asyncio.run(run_and_kill())
        after = _counters(replicas)
    finally:
        router.stop()
    FIGURES["worker killed"] = {"failed": report["failed"], "completed": report["completed"]}
    assert report["failed"] == 0 and report["completed"] == 64, report["errors"]
    assert a.child_pid("worker", other_than=victim) != victim  # restarted by its supervisor
    # Both replicas served after the kill: a's requests resumed on its new worker.
    assert after[0][1] > before[0][1] and after[1][1] > before[1][1]
    assert a.metrics()["nanoserve:scheduler_workers_lost_total"] >= 1
