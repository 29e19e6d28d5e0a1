"""``nanoserve serve --replicas N --router R``: what each replica's processes are given, and the
router's command line (no process is started here; tests/faults/test_routers.py runs them)."""

from __future__ import annotations

import pytest

from nanoserve.fleet import Fleet, offset_endpoint, replica_environment, router_command


def test_each_replica_gets_its_own_run_id_ports_and_event_endpoints() -> None:
    base = {
        "NANOSERVE_RUN_ID": "prod",
        "NANOSERVE_PORT": "8000",
        "NANOSERVE_BASE_PORT": "5610",
        "NANOSERVE_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:5557",
        "NANOSERVE_KV_EVENTS_REPLAY_ENDPOINT": "ipc:///run/kv-replay",
        "NANOSERVE_THREADS": "2",
    }
    second = replica_environment(base, 1)
    assert second["NANOSERVE_RUN_ID"] == "prod-1" and second["NANOSERVE_PORT"] == "8001"
    assert second["NANOSERVE_BASE_PORT"] == "5613"  # the scheduler's three tcp ports each
    assert second["NANOSERVE_KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:5558"
    assert second["NANOSERVE_KV_EVENTS_REPLAY_ENDPOINT"] == "ipc:///run/kv-replay-1"
    assert second["NANOSERVE_THREADS"] == "2" and base["NANOSERVE_PORT"] == "8000"
    assert replica_environment(base, 0)["NANOSERVE_KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:5557"


def test_kv_aware_routing_asks_for_tagged_map_events() -> None:
    base = {"NANOSERVE_ROUTER_POLICY": "kv_aware"}
    assert replica_environment(base, 0)["NANOSERVE_KV_EVENTS_FORMAT"] == "map"
    assert "NANOSERVE_KV_EVENTS_FORMAT" not in replica_environment({}, 0)


def test_an_endpoint_without_a_port_cannot_be_offset() -> None:
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    with pytest.raises(ValueError, match="want tcp://HOST:PORT"):
        offset_endpoint("tcp://collector", 1)


@pytest.mark.parametrize("router", ["sglang-router", "vllm-router"])
def test_the_router_command_lines(router: str) -> None:
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    command = router_command(router, "cache_aware", urls, "127.0.0.1", 30000)
    start = command.index("--host")
    assert command[1:start] == (["launch"] if router == "sglang-router" else [])
    assert command[start:] == [
        "--host", "127.0.0.1", "--port", "30000", "--worker-urls", *urls,
        "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", "30001",
    ]  # fmt: skip


def test_kv_aware_names_each_replicas_event_source() -> None:
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    kv = ["tcp://*:5557", "tcp://*:5558"]
    command = router_command("vllm-router", "kv_aware", urls, kv_events=kv, model="m")
    tail = command[command.index("--kv-event-source") :]
    assert tail == [
        "--kv-event-source", "http://127.0.0.1:8000=tcp://127.0.0.1:5557",
        "--kv-event-source", "http://127.0.0.1:8001=tcp://127.0.0.1:5558",
        "--kv-event-model", "m", "--kv-event-block-size", "16",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="kv-events-endpoint"):
        router_command("vllm-router", "kv_aware", urls)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"router": "nginx"}, "unknown"),
        ({"router": "sglang-router", "router_policy": "kv_aware"}, "vllm-router's policy"),
        ({"router_port": 0}, "router_port must be"),
    ],
)
def test_each_refusal_of_a_fleet_fires(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fleet(**fields)
