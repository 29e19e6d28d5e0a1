"""Security defaults, checked on real processes: ipc sockets in a private 0700 directory, HTTP on
127.0.0.1 only, --api-key / NANOSERVE_API_KEY required as a Bearer token on /v1/*, and no pickle
anywhere a message is decoded."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path

import aiohttp
import pytest

from protocol.addresses import default_addresses
from tests.faults.conftest import MODEL, assert_pool_empty

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_ipc_sockets_live_in_a_private_directory(server):
    addresses = default_addresses(server.run_id)
    for address in (addresses.frontend, addresses.worker, addresses.monitor):
        path = Path(address.removeprefix("ipc://"))
        assert stat.S_ISSOCK(path.stat().st_mode), path
        info = path.parent.stat()
        assert info.st_uid == os.getuid()
        assert stat.S_IMODE(info.st_mode) == 0o700, oct(info.st_mode)


def test_tcp_transport_binds_loopback_only():
    addresses = default_addresses("x", transport="tcp", port=6000)
    assert addresses.frontend.startswith("tcp://127.0.0.1:")
    assert addresses.worker.startswith("tcp://127.0.0.1:")
    assert addresses.monitor == "tcp://127.0.0.1:6002"


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as the kernel writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_http_listens_on_loopback_by_default(server):
    assert _listeners(server.port) == ["0100007F"]  # 127.0.0.1, and nothing else


def test_no_pickle_between_processes():
    pattern = re.compile(r"^\s*(import pickle|from pickle|import cPickle)|pickle\.loads", re.M)
    for package in ("protocol", "scheduler", "worker", "frontend", "nanoserve"):
        for path in (ROOT / package).rglob("*.py"):
            assert not pattern.search(path.read_text()), path


async def test_api_key_is_required_on_v1(server, tmp_path):
    guarded = server.join(tmp_path, api_key="s3cret-key")
    guarded.start("frontend")  # a second frontend on the same scheduler
    try:
        await asyncio.to_thread(guarded.wait_healthy, 60.0)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                            {"Authorization": "Bearer s3cret-key-and-more"}):  # fmt: skip
                async with session.get(guarded.url + "/v1/models", headers=headers) as response:
                    assert response.status == 401, headers
                    assert (await response.json())["error"]["code"] == "invalid_api_key"
                async with session.post(
                    guarded.url + "/v1/completions", json=body, headers=headers
                ) as response:
                    assert response.status == 401
            good = {"Authorization": "Bearer s3cret-key"}
            async with session.post(
                guarded.url + "/v1/completions", json=body, headers=good
            ) as response:
                assert response.status == 200
            async with session.get(guarded.url + "/health") as response:
                assert response.status == 200  # health and metrics stay open to probes
        guarded.check_alive()
    finally:
        guarded.stop()
    assert guarded.processes["frontend"].returncode == 0
    await assert_pool_empty(server)


async def test_api_keys_never_share_cached_blocks(server, tmp_path):
    """Two keys, one prompt: each key hits only the blocks its own requests computed."""
    tenants = server.join(tmp_path, api_key="key-a,key-b")
    tenants.start("frontend")
    prompt = " ".join(f"isolation{i}" for i in range(60))  # well over a few 16-token blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    try:
        await asyncio.to_thread(tenants.wait_healthy, 60.0)
        cached = []
        async with aiohttp.ClientSession() as session:
            for key in ("key-a", "key-b", "key-a", "key-b", None):
                url, headers = tenants.url, {"Authorization": f"Bearer {key}"}
                if key is None:  # the unsalted frontend: no tenant at all
                    url, headers = server.url, {}
                async with session.post(
                    url + "/v1/completions", json=body, headers=headers
                ) as response:
                    assert response.status == 200
                    usage = (await response.json())["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        first_a, first_b, again_a, again_b, unsalted = cached
        assert first_a == first_b == unsalted == 0, cached
        assert again_a >= usage["prompt_tokens"] - 16 and again_b == again_a, cached
    finally:
        tenants.stop()
    await assert_pool_empty(server)
