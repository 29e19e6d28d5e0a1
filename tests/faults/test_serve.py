"""SIGTERM to the whole tree (``nanoserve serve``): the frontend drains, an in-flight stream
finishes, every process exits and serve exits 0. serve runs the scheduler and the worker under
the supervisor: a worker it restarts is seen by serve's own process tree."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from tests.faults.conftest import Stream, stream_completion, wait_until
from tests.servers import alive, children, new_server

pytestmark = pytest.mark.slow


def _tree(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *_tree(child)]
    return found


async def test_sigterm_to_serve_drains_and_exits_0(tmp_path):
    server = new_server(tmp_path)  # serve takes its port and run id from NANOSERVE_*
    serve = server.start("serve", "--threads", "1", "--audit")
    log = tmp_path / "serve.log"
    tree: list[int] = []
    try:
        await asyncio.to_thread(server.wait_healthy, 240.0)
        tree = _tree(serve.pid)
        assert len(tree) == 5  # frontend, two supervisors and their scheduler and worker
        async with aiohttp.ClientSession() as session:
            stream = Stream()
            body = {"prompt": "Count:", "max_tokens": 24, "ignore_eos": True}
            task = asyncio.create_task(stream_completion(session, server, body, stream))
            await wait_until(lambda: len(stream.times) >= 1, what="first token")
            serve.send_signal(signal.SIGTERM)
            await asyncio.wait_for(task, 60.0)
        assert stream.done and not stream.errors and stream.finish_reason == "length"
        assert await asyncio.to_thread(serve.wait, 60.0) == 0, log.read_text()[-3000:]
        assert not [pid for pid in tree if alive(pid)], log.read_text()[-3000:]
    finally:
        server.stop()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
