"""Two frontends on one port (``--api-servers 2``) in front of one scheduler, real processes:
the seeded tiny Llama with a byte tokenizer, float32, audited. Many concurrent requests over
real HTTP (aiohttp, and the official openai client) all get the text of the same prompt sent
alone; both frontends serve, and each one's /metrics and web page speak for that process. A
SIGKILLed frontend's streams fail, the other's finish with their undisturbed text, the
scheduler aborts only the dead one's requests, and the manager restarts it.

A connection stays with the frontend that accepted it, so a test that needs to know which
frontend serves a stream opens a one-connection session, asks that connection's /metrics who
answers (``nanoserve:frontend_info``), then streams on the same kept-alive connection.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.faults.conftest import Stream, assert_pool_empty, stream_completion, wait_until
from tests.servers import Server, free_port, start_server
from tests.tiny_model import make_tiny_llama, write_byte_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = [f"Prompt {i}: say something about {word}." for i, word in enumerate("abcdefgh")]
MAX_TOKENS = 24
NAME = "tiny"  # the served model name
INFO = re.compile(r"^nanoserve:frontend_info\{(.*)\} 1\.0$", re.MULTILINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """Scheduler, worker and a frontend manager of two frontends, on the tiny model."""
    model = write_byte_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("tiny")))
    running = start_server(
        tmp_path_factory.mktemp("api-servers"),
        model=model,
        api_servers=2,
        served_model_name=NAME,
        audit=1,
        num_slots=32,
        threads=1,  # other test processes share the cores
    )
    try:
        asyncio.run(_both_answer(running))
        yield running
    finally:
        running.stop()


def _labels(metrics_text: str) -> dict[str, str]:
    """The labels of ``nanoserve:frontend_info``: which frontend answered."""
    found = INFO.search(metrics_text)
    assert found, "no nanoserve:frontend_info in /metrics"
    return dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))


async def _scrape(url: str) -> tuple[dict[str, str], str]:
    """/metrics on a fresh connection: (who answered, the text)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    return _labels(text), text


async def _each_frontend(url: str, want: int = 2, tries: int = 80) -> dict[str, str]:
    """/metrics of every frontend, by index: fresh connections until each has answered
    (the kernel picks the frontend per connection, so this is bounded, not exact)."""
    seen: dict[str, str] = {}
    for _ in range(tries):
        labels, text = await _scrape(url)
        seen[labels["index"]] = text
        if len(seen) == want:
            return seen
    raise AssertionError(f"only frontends {sorted(seen)} answered {tries} connections")


async def _both_answer(server: Server, timeout: float = 60.0) -> None:
    """Wait (bounded) until both frontends answer /health with 200."""
    deadline = time.monotonic() + timeout
    healthy: set[str] = set()
    while len(healthy) < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"healthy frontends: {healthy}\n{server.logs()}")
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                async with session.get(server.url + "/metrics") as response:
                    labels = _labels(await response.text())
                async with session.get(server.url + "/health") as response:
                    if response.status == 200:
                        healthy.add(labels["index"])
            except aiohttp.ClientError:
                pass  # a frontend restarting
        await asyncio.sleep(0.05)


def _value(metrics_text: str, series: str) -> float:
    """One sample of the text's series (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body | extra) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["text"]


async def _alone(url: str, prompts: list[str], **extra) -> dict[str, str]:
    """Each prompt's text, sent one at a time."""
    async with aiohttp.ClientSession() as session:
        return {p: await _complete(session, url, p, **extra) for p in prompts}


async def test_many_concurrent_requests_over_both_frontends_get_their_own_text(server):
    expected = await _alone(server.url, PROMPTS)
    assert len(set(expected.values())) == len(PROMPTS)  # distinct: a crossed reply would show
    success = 'nanoserve:request_success_total{finished_reason="length"}'
    before = {i: _value(t, success) for i, t in (await _each_frontend(server.url)).items()}

    async def by_aiohttp(prompt: str) -> tuple[str, str]:
        connector = aiohttp.TCPConnector(force_close=True)  # a connection, a kernel's pick
        async with aiohttp.ClientSession(connector=connector) as session:
            return prompt, await _complete(session, server.url, prompt)

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def by_openai(prompt: str) -> tuple[str, str]:
        reply = await client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return prompt, reply.choices[0].text

    sends = [by_aiohttp(PROMPTS[i % 8]) for i in range(40)]
    sends += [by_openai(PROMPTS[i % 8]) for i in range(24)]
    replies = await asyncio.gather(*sends)
    await client.close()
    assert [text for prompt, text in replies] == [expected[prompt] for prompt, _ in replies]

    after = {i: _value(t, success) for i, t in (await _each_frontend(server.url)).items()}
    served = {i: after[i] - before[i] for i in after}
    assert sum(served.values()) == 64  # each counts its own: together, every request
    assert all(count > 0 for count in served.values()), served  # both frontends served
    server.check_alive()


async def test_each_frontends_page_and_metrics_name_it(server):
    pages: dict[str, dict] = {}
    for _ in range(80):
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(server.url + "/metrics") as response:
                labels = _labels(await response.text())
            async with session.get(server.url + "/page/stream") as response:
                frame = await response.content.readuntil(b"\n\n")
        assert frame.startswith(b"event: hello\ndata: ")
        pages[labels["index"]] = {"labels": labels, "hello": frame}
        if len(pages) == 2:
            break
    assert sorted(pages) == ["0", "1"]
    for index, page in pages.items():
        assert page["labels"]["count"] == "2"
        assert f'"frontend":"{int(index) + 1} of 2"'.encode() in page["hello"]
    assert pages["0"]["labels"]["pid"] != pages["1"]["labels"]["pid"]


async def _pinned(url: str, want: int, tries: int = 120) -> dict[str, list]:
    """``want`` one-connection sessions on each frontend: index -> [(session, labels)]."""
    found: dict[str, list] = {"0": [], "1": []}
    for _ in range(tries):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with session.get(url + "/metrics") as response:
            labels = _labels(await response.text())
        if len(found[labels["index"]]) < want:
            found[labels["index"]].append((session, labels))
        else:
            await session.close()
        if all(len(sessions) == want for sessions in found.values()):
            return found
    for sessions in found.values():
        for session, _ in sessions:
            await session.close()
    raise AssertionError(f"could not pin {want} connections on each frontend")


async def test_a_sigkilled_frontend_fails_only_its_own_streams(server):
    long = {"model": NAME, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    pinned = await _pinned(server.url, want=3)
    victim_pid = int(pinned["0"][0][1]["pid"])
    streams = {index: [Stream() for _ in sessions] for index, sessions in pinned.items()}
    target = type("Target", (), {"url": server.url})
    tasks = {
        index: [
            asyncio.create_task(
                stream_completion(session, target, {"prompt": PROMPTS[n]} | long, stream)
            )
            for n, ((session, _), stream) in enumerate(
                zip(pinned[index], streams[index], strict=True)
            )
        ]
        for index in pinned
    }
    try:
        every = [s for ss in streams.values() for s in ss]
        await wait_until(lambda: all(s.times for s in every), 60.0, "first tokens")
        mark = server.log_size("scheduler")
        os.kill(victim_pid, signal.SIGKILL)
        killed = await asyncio.gather(*tasks["0"], return_exceptions=True)
        survived = await asyncio.gather(*tasks["1"], return_exceptions=True)
    finally:
        for sessions in pinned.values():
            for session, _ in sessions:
                await session.close()
    # The dead frontend's streams end without their last event; the other's are whole.
    assert all(
        isinstance(r, Exception) or not s.done for r, s in zip(killed, streams["0"], strict=True)
    )
    assert not [r for r in survived if isinstance(r, Exception)], survived
    for stream in streams["1"]:
        assert stream.done and not stream.errors and stream.finish_reason == "length"
    expected = await _alone(server.url, PROMPTS[:3], max_tokens=300)
    assert [s.text for s in streams["1"]] == [expected[p] for p in PROMPTS[:3]]
    # The scheduler aborted the dead one's three and no other; the manager restarted it.
    pattern = r"frontend .* lost \(.*\): aborted its 3 requests"
    await asyncio.to_thread(server.wait_log, "scheduler", pattern, mark, 10.0)
    await _both_answer(server)
    restarted = await _each_frontend(server.url)
    assert int(_labels(restarted["0"])["pid"]) != victim_pid
    await assert_pool_empty(server)  # every block back; the audited scheduler still up


def _tree(pid: int) -> list[int]:
    """Every descendant of ``pid`` (its children's children too), whichever of its threads
    started them (the frontends' manager starts each from a thread of its own)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except FileNotFoundError:
            continue
    return [pid for child in children for pid in (child, *_tree(child))]


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


async def test_serve_starts_the_frontends_it_is_asked_for_and_stops_them_all(tmp_path):
    model = write_byte_tokenizer(make_tiny_llama(tmp_path / "tiny"))
    port = free_port()
    command = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", str(port)]
    command += ["--model", str(model), "--api-servers", "2", "--threads", "1"]
    command += ["--run-id", f"serve{uuid.uuid4().hex[:8]}"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    tree: list[int] = []
    try:
        running = Server(port=port, run_id="", log_dir=tmp_path, env={})
        running.processes["serve"] = serve
        await _both_answer(running, timeout=120.0)
        tree = _tree(serve.pid)
        frontends = [p for p in tree if _command_of(p).endswith("nanoserve.cli frontend ")]
        assert len(frontends) == 3, [_command_of(p) for p in tree]  # the manager and its two
        serve.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(serve.wait, 60.0) == 0, log.read_text()[-3000:]
        assert not [pid for pid in tree if _alive(pid)]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for pid in tree:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
