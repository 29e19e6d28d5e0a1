"""Fleet: ``nanoserve serve --replicas N``, several replicas on one host behind a router.

Each replica is the three processes ``nanoserve serve`` starts for one, with its own run id
(``<run-id>-<i>``: its own ipc sockets), HTTP port (``--port`` + i), tcp ports (``--base-port``
+ 3i) and, when KV events are on, its own event endpoints (the port + i, or ``-<i>`` after an
ipc path: vLLM offsets a data-parallel rank's the same way). With ``--router`` one of the routers
people already run starts in front of them on ``--router-port``: the SGLang Model Gateway
(``sglang-router``) or ``vllm-router``, from their PyPI wheels, with ``--router-policy``. We write
no router: these speak to each replica over its OpenAI API, poll its ``/health``, and with
``kv_aware`` (vllm-router) read its KV events.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROUTERS = ("none", "sglang-router", "vllm-router")
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "kv_aware")


@dataclass(frozen=True)
class Fleet:
    """How many replicas ``serve`` starts, and the router in front of them."""

    replicas: int = field(
        default=1,
        metadata={
            "help": "replicas to start, each a frontend, scheduler and worker, on --port + i",
            "processes": ("serve",),
        },
    )
    router: str = field(
        default="none",
        metadata={
            "help": "start this router in front of the replicas (pip install it first)",
            "choices": ROUTERS,
            "processes": ("serve",),
        },
    )
    router_port: int = field(
        default=30000, metadata={"help": "the router's HTTP port", "processes": ("serve",)}
    )
    router_policy: str = field(
        default="cache_aware",
        metadata={
            "help": "the router's policy (kv_aware: vllm-router on our KV events)",
            "choices": POLICIES,
            "processes": ("serve",),
        },
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS or self.router_policy not in POLICIES:
            raise ValueError(f"router {self.router!r} / policy {self.router_policy!r} unknown")
        if self.router_policy == "kv_aware" and self.router == "sglang-router":
            raise ValueError("kv_aware is vllm-router's policy: use --router vllm-router")
        if not 1 <= self.router_port <= 65535:
            raise ValueError(f"router_port must be in [1, 65535], got {self.router_port}")


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    """Replica ``index``'s copy of a ZeroMQ endpoint: a tcp port plus ``index``, an ipc path
    with ``-<index>`` after it (replica 0 keeps it as given)."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{index}"
    found = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if found is None:
        raise ValueError(f"cannot give each replica its own {endpoint!r}: want tcp://HOST:PORT")
    return f"{found[1]}:{int(found[2]) + index}"


def replica_environment(base: dict[str, str], index: int) -> dict[str, str]:
    """Replica ``index``'s processes' environment, from ``serve``'s (``child_environment``).
    Under vllm-router's ``kv_aware`` its KV events are tagged maps, the only form it reads."""
    environment = dict(base)
    if base.get("NANOSERVE_ROUTER_POLICY") == "kv_aware":
        environment["NANOSERVE_KV_EVENTS_FORMAT"] = "map"
    environment["NANOSERVE_RUN_ID"] = f"{base.get('NANOSERVE_RUN_ID', 'default')}-{index}"
    environment["NANOSERVE_PORT"] = str(int(base.get("NANOSERVE_PORT", "8000")) + index)
    environment["NANOSERVE_BASE_PORT"] = str(
        int(base.get("NANOSERVE_BASE_PORT", "5610")) + 3 * index
    )
    for name in ("NANOSERVE_KV_EVENTS_ENDPOINT", "NANOSERVE_KV_EVENTS_REPLAY_ENDPOINT"):
        if base.get(name):
            environment[name] = offset_endpoint(base[name], index) or ""
    return environment


def replica_urls(host: str, port: int, replicas: int) -> list[str]:
    """The replicas' base URLs, as a router on this host reaches them."""
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return [f"http://{reach}:{port + i}" for i in range(replicas)]


def router_command(
    router: str,
    policy: str,
    urls: list[str],
    host: str = "127.0.0.1",
    port: int = 30000,
    kv_events: list[str] | None = None,
    model: str = "",
    block_size: int = 16,
) -> list[str]:
    """The command line that starts ``router`` in front of ``urls``. Both bind their own
    Prometheus endpoint too: on ``host``, at ``port`` + 1. ``kv_events``: each replica's KV
    events endpoint, for vllm-router's ``kv_aware`` (with the served ``model``'s name and the
    replicas' ``block_size``)."""
    executable = shutil.which(router) or os.path.join(os.path.dirname(sys.executable), router)
    if not os.path.exists(executable):
        raise FileNotFoundError(f"{router} is not installed: pip install {router}")
    command = [executable, *(["launch"] if router == "sglang-router" else [])]
    command += ["--host", host, "--port", str(port), "--worker-urls", *urls, "--policy", policy]
    command += ["--prometheus-host", host, "--prometheus-port", str(port + 1)]
    if policy == "kv_aware":
        if not kv_events or len(kv_events) != len(urls):
            raise ValueError("kv_aware needs each replica's --kv-events-endpoint")
        for url, endpoint in zip(urls, kv_events, strict=True):
            command += ["--kv-event-source", f"{url}={endpoint.replace('*', '127.0.0.1')}"]
        command += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
    return command


def run_fleet(args: argparse.Namespace, fleet: Fleet, environment: dict[str, str]) -> int:
    """Start every replica's processes, then the router; wait as ``serve`` does for one.
    SIGINT or SIGTERM stops the router, then each replica (its frontend first, to drain)."""
    from models.files import resolve_model
    from nanoserve.commands.serve import ROLES, role_command, stop_all

    replicas: list[dict[str, subprocess.Popen]] = []
    router: subprocess.Popen | None = None
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    environments = [replica_environment(environment, i) for i in range(fleet.replicas)]
    taken = set(range(args.port, args.port + fleet.replicas))
    if fleet.router != "none" and taken & {fleet.router_port, fleet.router_port + 1}:
        raise ValueError(
            f"--router-port {fleet.router_port} and its metrics port {fleet.router_port + 1} "
            f"must be outside the replicas' {args.port}..{args.port + fleet.replicas - 1}"
        )
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for env in environments:
            replicas.append({role: subprocess.Popen(role_command(role), env=env) for role in ROLES})
        if fleet.router != "none":
            urls = replica_urls(args.host, args.port, fleet.replicas)
            endpoint = args.kv_events_endpoint
            kv = [offset_endpoint(endpoint, i) for i in range(fleet.replicas)] if endpoint else None
            model = args.served_model_name or resolve_model(args.model).model_id
            command = router_command(
                fleet.router, fleet.router_policy, urls, args.host, fleet.router_port, kv, model,
                args.block_size,
            )  # fmt: skip
            router = subprocess.Popen(command, env=environment)
        while not stopping:
            for index, children in enumerate(replicas):
                for role, child in children.items():
                    if child.poll() is not None:
                        print(f"nanoserve serve: replica {index}'s {role} exited", file=sys.stderr)
                        return 1
            if router is not None and router.poll() is not None:
                print(f"nanoserve serve: {fleet.router} exited", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for children in replicas:
            stop_all(children)
