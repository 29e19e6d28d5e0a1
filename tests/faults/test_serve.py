"""SIGTERM to the whole tree (``nanoserve serve``): the frontend drains, an in-flight stream
finishes, every process exits and serve exits 0. serve runs the scheduler and the worker under
the supervisor: a worker it restarts is seen by serve's own process tree."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from tests.faults.conftest import Stream, stream_completion, wait_until
from tests.servers import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _tree(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_tree(child)]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited {process.returncode}\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"serve not healthy after {timeout}s\n{log.read_text()[-3000:]}")


async def test_sigterm_to_serve_drains_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", str(port)]
    command += ["--run-id", f"s{uuid.uuid4().hex[:8]}", "--threads", "1", "--audit"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    tree: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(_wait_healthy, url, serve, log, 240.0)
        tree = _tree(serve.pid)
        assert len(tree) == 5  # frontend, two supervisors and their scheduler and worker
        server = SimpleNamespace(url=url)
        async with aiohttp.ClientSession() as session:
            stream = Stream()
            body = {"prompt": "Count:", "max_tokens": 24, "ignore_eos": True}
            task = asyncio.create_task(stream_completion(session, server, body, stream))
            await wait_until(lambda: len(stream.times) >= 1, what="first token")
            serve.send_signal(signal.SIGTERM)
            await asyncio.wait_for(task, 60.0)
        assert stream.done and not stream.errors and stream.finish_reason == "length"
        assert await asyncio.to_thread(serve.wait, 60.0) == 0, log.read_text()[-3000:]
        assert not [pid for pid in tree if _alive(pid)], log.read_text()[-3000:]
    finally:
        if serve.poll() is None:
            os.kill(serve.pid, signal.SIGKILL)
            serve.wait()
        for pid in tree:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
