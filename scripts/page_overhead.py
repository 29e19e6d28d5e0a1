"""What the live web page costs the server: the scheduler's time per iteration and the output
throughput with no page open, one page and ten pages, under the same ``nanoserve bench serve``
load (concurrency 32 by default).

    python scripts/page_overhead.py                       # starts its own server (bfloat16)
    python scripts/page_overhead.py --url http://127.0.0.1:8000 --rounds 5

A page here is a client of ``/page/stream`` that reads and parses every frame, as the browser
does (the browser's own drawing runs on the viewer's machine, not the server's). The modes
alternate within each round, so a machine that gets busier affects them alike. The scheduler's
time per iteration is ``nanoserve:scheduler_busy_seconds_total`` (CPU time planning and applying
steps) plus the time the scheduler spent on snapshots (``monitor_s_total`` in the stream), per
step of ``nanoserve:num_steps``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


def scrape(url: str) -> dict[str, float]:
    """The two counters the per-iteration time comes from."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        body = response.read().decode()
    wanted = {"nanoserve:scheduler_busy_seconds_total": "busy", "nanoserve:num_steps": "steps"}
    found = {}
    for line in body.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


class Pages:
    """``count`` open pages, each reading every frame of /page/stream."""

    def __init__(self, url: str, count: int, key: str | None) -> None:
        self.url, self.count, self.key = url, count, key
        self.monitor_s: float | None = None  # the scheduler's snapshot time, latest seen
        self.frames = 0
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Pages:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._tasks = [asyncio.create_task(self._read()) for _ in range(self.count)]
        deadline = time.monotonic() + 10
        while self.count and self.monitor_s is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    async def _read(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        async with self._session.get(self.url + "/page/stream", headers=headers) as response:
            response.raise_for_status()
            while True:
                block = await response.content.readuntil(b"\n\n")
                kind, _, data = block.partition(b"\ndata: ")
                frame = json.loads(data)
                self.frames += 1
                if kind == b"event: snapshot" and frame.get("health"):
                    self.monitor_s = frame["health"]["monitor_s_total"]


async def one_run(url: str, pages: int, args: argparse.Namespace, out: Path) -> dict:
    """One bench serve run with ``pages`` pages open; its figures."""
    async with Pages(url, pages, args.api_key) as open_pages:
        await asyncio.sleep(1.0)  # let the subscription settle
        before, monitor_before = scrape(url), open_pages.monitor_s or 0.0
        command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
        command += ["--max-concurrency", str(args.concurrency)]
        command += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
        command += ["--output-len", str(args.output_len), "--seed", "0", "--json", str(out)]
        if args.api_key:
            command += ["--api-key", args.api_key]
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        if await process.wait() != 0:
            raise RuntimeError(f"bench serve failed: {' '.join(command)}")
        after, monitor_after = scrape(url), open_pages.monitor_s or 0.0
        frames = open_pages.frames
    report = json.loads(out.read_text())
    steps = after["steps"] - before["steps"]
    busy = after["busy"] - before["busy"]
    snapshots = monitor_after - monitor_before
    return {
        "pages": pages,
        "tok_s": report["output_throughput"],
        "plan_ms": busy * 1000 / steps,
        "snapshot_ms": snapshots * 1000 / steps,
        "total_ms": (busy + snapshots) * 1000 / steps,
        "frames": frames,
    }


def table(results: list[dict], modes: list[int]) -> str:
    """Medians over the rounds, each mode against no page."""
    base = {
        k: statistics.median(r[k] for r in results if r["pages"] == 0)
        for k in ("tok_s", "total_ms")
    }
    lines = [
        "pages | output tok/s (vs none) | scheduler ms/iteration: plan+apply + snapshots = total "
        "(vs none) | frames read",
    ]
    for mode in modes:
        rows = [r for r in results if r["pages"] == mode]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "pages"}
        lines.append(
            f"{mode:>5} | {med['tok_s']:8.1f} ({med['tok_s'] / base['tok_s'] - 1:+.1%}) | "
            f"{med['plan_ms']:.3f} + {med['snapshot_ms']:.3f} = {med['total_ms']:.3f} "
            f"({med['total_ms'] / base['total_ms'] - 1:+.1%}) | {med['frames']:.0f}"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running nanoserve (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--dtype", default="bfloat16", help="for the server this starts")
    parser.add_argument("--threads", type=int, default=None, help="worker threads (its start)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, nargs="+", default=[0, 1, 10])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    return parser.parse_args()


async def measure(url: str, args: argparse.Namespace, work: Path) -> list[dict]:
    await one_run(url, 0, args, work / "warmup.json")  # a fresh worker's first run is slower
    results = []
    for round_ in range(args.rounds):
        modes = args.pages if round_ % 2 == 0 else args.pages[::-1]
        for pages in modes:
            result = await one_run(url, pages, args, work / f"r{round_}-p{pages}.json")
            print(json.dumps({"round": round_, **result}), flush=True)
            results.append(result)
    return results


def main() -> int:
    args = parse_args()
    if 0 not in args.pages:
        raise SystemExit("--pages must include 0, the run the others are compared with")
    with tempfile.TemporaryDirectory(prefix="page-overhead-") as tmp:
        work = Path(tmp)
        server = None if args.url else start_nanoserve(args.dtype, work / "logs", args.threads)
        url = args.url or server.url
        try:
            results = asyncio.run(measure(url, args, work))
        finally:
            if server is not None:
                server.stop()
    print(table(results, args.pages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
