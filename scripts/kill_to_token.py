"""Time from a worker's SIGKILL to the next token of every stream: 8 streams of about 1,500-token
contexts, the default model, with the shared KV pool and without, with a standby and without.

    python scripts/kill_to_token.py [--dtype bfloat16] [--streams 8]

Prints one line per case (docs/kv_pool.md has the figures). The processes are started and ended
by PID with the test suite's helpers (tests/servers.py); nothing is asserted here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults.conftest import start_streams  # noqa: E402
from tests.faults.test_shared_pool import body, long_prompt  # noqa: E402
from tests.servers import ROLES, start_server  # noqa: E402

CASES = (
    ("recompute (no shared pool)", {}),
    ("shared pool, no standby", {"shared_kv_pool": 1}),
    ("shared pool, 1 standby", {"shared_kv_pool": 1, "standby_workers": 1}),
)


async def measure(server, streams: int) -> tuple[list[float], float]:
    """Kill the worker once every stream has 3 tokens; each stream's wait for its next token,
    and the tokens recomputed."""
    prompts = [long_prompt(i) for i in range(streams)]
    async with aiohttp.ClientSession() as session:
        running, tasks = start_streams(session, server, [body(p, "k", 48) for p in prompts])
        while not all(len(s.times) >= 3 for s in running):
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a stream ended early\n{server.logs()}")
            await asyncio.sleep(0.01)
        pid = server.child_pid("worker")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        counts = [len(s.times) for s in running]
        await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
    gaps = [s.times[c] - killed for s, c in zip(running, counts, strict=True)]
    recomputed = server.metrics()["nanoserve:worker_restart_tokens_recomputed_last"]
    return gaps, recomputed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    for name, options in CASES:
        roles = ("kv-holder", *ROLES) if options else ROLES
        log_dir = Path(tempfile.mkdtemp(prefix="kill-to-token-"))
        server = start_server(
            log_dir,
            roles=roles,
            supervised=("kv-holder", "scheduler", "worker"),
            dtype=args.dtype,
            num_blocks=1024,
            num_slots=16,
            **options,
        )
        try:
            if options.get("standby_workers"):
                server.start("worker", supervised=True, name="standby")
                server.wait_log("standby", "waiting to take the KV pool over", timeout=300.0)
            gaps, recomputed = asyncio.run(measure(server, args.streams))
        finally:
            server.stop()
        print(
            f"{args.dtype}, {name}: SIGKILL to the next token of {len(gaps)} streams: "
            f"min {min(gaps):.2f} s, median {statistics.median(gaps):.2f} s, "
            f"max {max(gaps):.2f} s; {recomputed:.0f} tokens recomputed",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
