"""What the live web page costs the server: the scheduler's time per iteration and the output
throughput with no page open, one page and ten pages, under the same ``nanoserve bench serve``
load (concurrency 32 by default).

    python scripts/page_overhead.py                       # starts its own server (bfloat16)
    python scripts/page_overhead.py --url http://127.0.0.1:8000 --rounds 6
    python scripts/page_overhead.py --rounds 20 --parse   # the pages parse here too

One load runs throughout; the figures come from phases of ``--phase-s`` seconds within it, each
with 0, 1 or 10 pages open, the modes alternating within each round (0, 1, 10, then 10, 1, 0).
Whole runs, one per mode, were no use: this machine's speed wanders by 10% over minutes, more
than the effect measured. Each mode is compared with the closed phase of its own round, and the
table gives the median of those ratios, and their mean with its standard error.

A page here is a client of ``/page/stream`` that reads every frame the server sends, the
server's whole share of a page. A browser then parses and draws each frame on the viewer's
machine; ``--parse`` parses them here as well, where ten parsing clients become a neighbour
on the server's own two cores (at 20 rounds: 10 pages -6.0% ± 2.3% output tok/s, and the
worker's thread governor once dropped to one thread). The scheduler's
time per iteration is ``nanoserve:scheduler_busy_seconds_total`` (CPU time planning and applying
steps) plus the time the scheduler spent on snapshots (``monitor_s_total`` in the stream), per
step of ``nanoserve:num_steps``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
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

MONITOR_S = re.compile(rb'"monitor_s_total":([0-9.eE+-]+)')


def scrape(url: str) -> dict[str, float]:
    """The two counters the per-iteration time comes from."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        body = response.read().decode()
    wanted = {
        "nanoserve:scheduler_busy_seconds_total": "busy",
        "nanoserve:num_steps": "steps",
        "nanoserve:worker_thread_switches_total": "switches",
        "nanoserve:generation_tokens_total": "tokens",
    }
    found = {}
    for line in body.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


class Pages:
    """``count`` open pages, each reading every frame of /page/stream."""

    def __init__(self, url: str, count: int, key: str | None, parse: bool = False) -> None:
        self.url, self.count, self.key, self.parse = url, count, key, parse
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
                self.frames += 1
                if self.parse:
                    json.loads(data)  # a browser's parse, here on the server's own cores
                if kind == b"event: snapshot":
                    found = MONITOR_S.search(data)
                    if found:
                        self.monitor_s = float(found[1])


async def one_run(url: str, args: argparse.Namespace, out: Path, num_prompts: int) -> None:
    """One ``nanoserve bench serve`` run to its end (the warm-up)."""
    process = await start_load(url, args, out, num_prompts)
    if await process.wait() != 0:
        raise RuntimeError("bench serve failed")


async def start_load(
    url: str, args: argparse.Namespace, out: Path, num_prompts: int
) -> asyncio.subprocess.Process:
    """``nanoserve bench serve`` at ``args.concurrency``, running in the background."""
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
    command += ["--max-concurrency", str(args.concurrency)]
    command += ["--num-prompts", str(num_prompts), "--input-len", str(args.input_len)]
    command += ["--output-len", str(args.output_len), "--seed", "0", "--json", str(out)]
    command += ["--range-ratio", str(args.range_ratio)]
    if args.api_key:
        command += ["--api-key", args.api_key]
    return await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


async def one_phase(url: str, pages: int, args: argparse.Namespace) -> dict:
    """``args.phase_s`` seconds of the running load with ``pages`` pages open; its figures."""
    async with Pages(url, pages, args.api_key, args.parse) as open_pages:
        await asyncio.sleep(args.settle_s)  # the subscription settles, the first frames are read
        started, before = time.monotonic(), scrape(url)
        monitor_before, frames_before = open_pages.monitor_s or 0.0, open_pages.frames
        await asyncio.sleep(args.phase_s)
        ended, after = time.monotonic(), scrape(url)
        monitor_after, frames = open_pages.monitor_s or 0.0, open_pages.frames - frames_before
    steps = after["steps"] - before["steps"]
    busy = after["busy"] - before["busy"]
    snapshots = monitor_after - monitor_before
    return {
        "pages": pages,
        "tok_s": (after["tokens"] - before["tokens"]) / (ended - started),
        "plan_ms": busy * 1000 / steps,
        "snapshot_ms": snapshots * 1000 / steps,
        "total_ms": (busy + snapshots) * 1000 / steps,
        "frames": frames,
        # the worker's thread governor changing its count mid-phase moves throughput on its own
        "thread_switches": after["switches"] - before["switches"],
    }


def table(results: list[dict], modes: list[int]) -> str:
    """Medians over the rounds. Against no page: each round's ratio to the closed phase of the
    same round, so drift between rounds (this machine's speed wanders by 10% over minutes)
    cancels; their median, and their mean with its standard error (phases alone spread by
    7-12% here, so a 5% effect needs about 10 rounds to show)."""
    rounds: dict[int, dict[int, dict]] = {}
    for r in results:
        rounds.setdefault(r["round"], {})[r["pages"]] = r
    lines = [
        "pages | output tok/s, vs none: median; mean ± s.e. | scheduler ms/iteration: "
        "plan+apply + snapshots = total, vs none: median; mean ± s.e. | frames a phase | "
        "thread switches",
    ]
    for mode in modes:
        rows = [r for r in results if r["pages"] == mode]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "pages"}
        vs = {
            k: _versus([by[mode][k] / by[0][k] - 1 for by in rounds.values()])
            for k in ("tok_s", "total_ms")
        }
        lines.append(
            f"{mode:>5} | {med['tok_s']:8.1f} ({vs['tok_s']}) | "
            f"{med['plan_ms']:.3f} + {med['snapshot_ms']:.3f} = {med['total_ms']:.3f} "
            f"({vs['total_ms']}) | {med['frames']:.0f} | "
            f"{sum(r['thread_switches'] for r in rows):.0f}"
        )
    return "\n".join(lines)


def _versus(ratios: list[float]) -> str:
    mean = statistics.mean(ratios)
    error = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return f"{statistics.median(ratios):+.1%}; {mean:+.1%} ± {error:.1%}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running nanoserve (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--dtype", default="bfloat16", help="for the server this starts")
    parser.add_argument("--threads", type=int, default=None, help="worker threads (its start)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--parse",
        action="store_true",
        help="pages also parse every frame's JSON here, on the server's cores (a browser parses "
        "on the viewer's machine; ten parsing clients here are a neighbour of their own)",
    )
    parser.add_argument("--pages", type=int, nargs="+", default=[0, 1, 10])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--phase-s", type=float, default=8.0, help="one measured phase")
    parser.add_argument("--settle-s", type=float, default=1.0, help="before each phase")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="lengths vary by this share, so the requests fall out of step: a load whose 32 "
        "requests prefill together and decode together swings by 3x between phases",
    )
    parser.add_argument("--ramp-s", type=float, default=30.0, help="load before the phases")
    return parser.parse_args()


async def measure(url: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """Phases of one long load, each with 0, 1 or 10 pages open, the modes alternating within
    each round: slow drift of the machine's speed touches every mode alike."""
    await one_run(url, args, work / "warmup.json", 2 * args.concurrency)  # a fresh worker
    phases_s = args.rounds * len(args.pages) * (args.phase_s + args.settle_s) + args.ramp_s
    # enough prompts to outlast the phases at 20 requests a second (it serves about 5)
    load = await start_load(url, args, work / "load.json", int(phases_s * 20) + 100)
    try:
        await asyncio.sleep(args.ramp_s)  # the requests fall out of step before the phases
        results = []
        for round_ in range(args.rounds):
            modes = args.pages if round_ % 2 == 0 else args.pages[::-1]
            for pages in modes:
                if load.returncode is not None:
                    raise RuntimeError("the load ended before the phases did")
                result = {"round": round_, **await one_phase(url, pages, args)}
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        if load.returncode is None:
            load.kill()
        await load.wait()
    return results


def main() -> int:
    args = parse_args()
    # SIGTERM as an exception, so the ``finally`` below still ends the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
