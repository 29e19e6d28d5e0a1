"""A reproducible noisy neighbour: CPU-bound processes beside a server, to measure how its
latency and throughput degrade when the machine does other work too.

    python scripts/noisy_neighbour.py                  # one busy loop at nice 19, until Ctrl-C
    python scripts/noisy_neighbour.py --procs 2 --nice 0 --seconds 120

Each process spins in pure Python (``while True: pass``, one core's worth of demand), the
simplest stand-in for a compiler or a batch job. They run at ``--nice`` (19: the lowest
priority, what a polite background job uses) and are ended by PID when the time is up or on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BUSY = "while True: pass"


def start(procs: int, nice: int) -> list[subprocess.Popen]:
    """Start ``procs`` busy loops at ``nice``."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", BUSY], preexec_fn=lambda: os.nice(nice) if nice else None
        )
        for _ in range(procs)
    ]


def stop(children: list[subprocess.Popen]) -> None:
    """End every busy loop by PID."""
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=1, help="busy processes")
    parser.add_argument("--nice", type=int, default=19, help="their nice level (0..19)")
    parser.add_argument("--seconds", type=float, default=0, help="how long (0: until stopped)")
    args = parser.parse_args()
    if args.procs < 1 or not 0 <= args.nice <= 19 or args.seconds < 0:
        print("noisy_neighbour: need --procs >= 1, --nice 0..19, --seconds >= 0", file=sys.stderr)
        return 2
    children = start(args.procs, args.nice)
    stopping = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    print(f"{args.procs} busy loop(s) at nice {args.nice}: pids {[c.pid for c in children]}")
    deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
    try:
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop(children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
