"""Pages that connect and vanish, or stall, for minutes: the frontend's memory must stay flat and
every stream must be let go. Prints the frontend's resident memory and its open page streams.

    python scripts/page_clients_rss.py                    # its own server, 10 minutes
    python scripts/page_clients_rss.py --minutes 1 --every 10
    python scripts/page_clients_rss.py --url http://127.0.0.1:8000 --frontend-pid 1234

Clients, all at once, until the time is up: one page that reads the whole time; pages that read
a frame or two and drop the connection (half of them with a reset); pages that never read with
a tiny receive buffer and hang up after ``--stall-s`` (the frontend should drop them first, once
its buffers are full: a write waits at most 10 s); requests cut off in the middle of their
headers. A light generation load
keeps the snapshots busy. Every connection is to 127.0.0.1 and every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from compare_servers import start_nanoserve  # noqa: E402 - after the path setup above


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


class Crowd:
    """The clients; ``counts`` says how many of each kind ran."""

    def __init__(self, url: str, key: str | None, stall_s: float) -> None:
        self.url, self.stall_s = url, stall_s
        self.host, self.port = "127.0.0.1", int(url.rsplit(":", 1)[1])
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.request = f"GET /page/stream HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
        self.counts = dict.fromkeys(("vanished", "reset", "stalled", "cut", "frames", "errors"), 0)
        self.counts["dropped by the frontend"] = 0

    async def _open(self, rcvbuf: int | None = None):
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        return sock

    async def vanish(self) -> None:
        sock = await self._open()
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, self.request)
            for _ in range(random.randint(1, 3)):
                await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            if random.random() < 0.5:  # a reset, not a goodbye
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.counts["reset"] += 1
            else:
                self.counts["vanished"] += 1
        finally:
            sock.close()

    async def stall(self) -> None:
        sock = await self._open(rcvbuf=4096)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, self.request)
            self.counts["stalled"] += 1
            await asyncio.sleep(self.stall_s)
            # Did the frontend give up on us first? Its abort is a reset, or an end of stream
            # once what it had sent is read; a page it still serves keeps sending: read for a
            # few seconds at most to tell which.
            deadline = loop.time() + 5
            try:
                while chunk := await asyncio.wait_for(
                    loop.sock_recv(sock, 65536), deadline - loop.time()
                ):
                    del chunk
                self.counts["dropped by the frontend"] += 1
            except ConnectionResetError:
                self.counts["dropped by the frontend"] += 1
            except TimeoutError:
                pass  # still served: the socket buffers had room for everything sent so far
        finally:
            sock.close()

    async def cut(self) -> None:
        sock = await self._open()
        try:
            await asyncio.get_running_loop().sock_sendall(sock, self.request[:20])
            self.counts["cut"] += 1
        finally:
            sock.close()

    async def reader(self, session: aiohttp.ClientSession, key: str | None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with session.get(self.url + "/page/stream", headers=headers) as response:
            async for _ in response.content.iter_chunked(65536):
                self.counts["frames"] += 1


async def load(session: aiohttp.ClientSession, url: str, key: str | None, until: float) -> None:
    """A light generation load: one short completion after another."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "", "prompt": "Count to twenty:", "max_tokens": 64, "ignore_eos": True}
    async with session.get(url + "/v1/models", headers=headers) as response:
        body["model"] = (await response.json())["data"][0]["id"]
    while time.monotonic() < until:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            await response.read()


async def run(url: str, pid: int, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    crowd = Crowd(url, args.api_key, args.stall_s)
    started = time.monotonic()
    until = started + args.minutes * 60
    samples: list[tuple[float, float, float]] = []
    tasks: set[asyncio.Task] = set()

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        # A refused or reset client is part of the crowd, not a failure of the run: count it.
        if not task.cancelled() and task.exception() is not None:
            crowd.counts["errors"] += 1

    def spawn(coroutine) -> None:
        task = asyncio.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(done)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        spawn(crowd.reader(session, args.api_key))
        for _ in range(2):
            spawn(load(session, url, args.api_key, until))
        next_sample, next_stall = started, started
        while (now := time.monotonic()) < until:
            if now >= next_sample:
                streams = metric(url, "nanoserve:web_page_streams")
                samples.append((now - started, rss_mib(pid), streams))
                print(
                    f"{now - started:6.0f} s  frontend RSS {samples[-1][1]:7.1f} MiB  "
                    f"open page streams {streams:3.0f}  clients {crowd.counts}",
                    flush=True,
                )
                next_sample += args.every
            if now >= next_stall:
                spawn(crowd.stall())
                next_stall += args.stall_every
            spawn(crowd.vanish() if random.random() < 0.85 else crowd.cut())
            await asyncio.sleep(1 / args.rate)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(2)
    end = time.monotonic() - started
    samples.append((end, rss_mib(pid), metric(url, "nanoserve:web_page_streams")))
    print(
        f"{end:6.0f} s  frontend RSS {samples[-1][1]:7.1f} MiB  open page streams "
        f"{samples[-1][2]:3.0f}  (every client gone)  dropped frames "
        f"{metric(url, 'nanoserve:web_page_frames_dropped_total'):.0f}",
        flush=True,
    )
    return samples


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running nanoserve (default: start one)")
    parser.add_argument("--frontend-pid", type=int, help="with --url: the frontend's PID")
    parser.add_argument("--api-key")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--rate", type=float, default=10.0, help="new short clients a second")
    # Long enough for a stalled page to fill the socket buffers, so the frontend's 10 s write
    # timeout is what ends it.
    parser.add_argument("--stall-s", type=float, default=90.0)
    parser.add_argument("--stall-every", type=float, default=6.0)
    parser.add_argument(
        "--max-growth-mib", type=float, default=8.0, help="fail on more growth after 1 minute"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.url and args.frontend_pid is None:
        raise SystemExit("--url needs --frontend-pid")
    with tempfile.TemporaryDirectory(prefix="page-clients-") as tmp:
        server = None if args.url else start_nanoserve("bfloat16", Path(tmp) / "logs", None)
        url = args.url or server.url
        pid = args.frontend_pid or server.processes[-1].pid  # started last (compare_servers)
        try:
            samples = asyncio.run(run(url, pid, args))
        finally:
            if server is not None:
                server.stop()
    # The first minute warms caches and allocator arenas; flat means no growth after it.
    settled = [rss for t, rss, _ in samples if t >= min(60.0, samples[-1][0] / 2)]
    growth = samples[-1][1] - settled[0]
    print(
        f"frontend RSS after the first minute: {min(settled):.1f}-{max(settled):.1f} MiB "
        f"(growth {growth:+.1f} MiB); at the end {samples[-1][1]:.1f} MiB with "
        f"{samples[-1][2]:.0f} page streams open"
    )
    flat = growth <= args.max_growth_mib
    return 0 if samples[-1][2] == 0 and flat else 1


if __name__ == "__main__":
    raise SystemExit(main())
