"""Each thread of a process over a window: the share of a second it ran, and the share it
waited for a core while runnable (``/proc/PID/task/*/schedstat``), the signal the worker's
ThreadGovernor reads (worker/cpu/threads.py).

    python scripts/thread_wait.py $(pgrep -f "nanoserve worker") 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def read(pid: int) -> dict[str, tuple[str, int, int]]:
    """{thread id: (name, ns on a CPU, ns waiting for one)}."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as handle:
                run, wait = handle.read().split()[:2]
            with open(f"/proc/{pid}/task/{task}/comm") as handle:
                name = handle.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        found[task] = (name, int(run), int(wait))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("seconds", type=float, nargs="?", default=5.0)
    args = parser.parse_args()
    try:
        before = read(args.pid)
        time.sleep(args.seconds)
        after = read(args.pid)
    except OSError as exc:
        print(f"thread_wait: {exc}", file=sys.stderr)
        return 2
    for task, (name, run, wait) in sorted(after.items()):
        _, run0, wait0 = before.get(task, (name, 0, 0))
        ran, waited = (run - run0) / 1e9 / args.seconds, (wait - wait0) / 1e9 / args.seconds
        if ran or waited:
            share = waited / (ran + waited)
            print(f"{task:>8} {name:16s} ran {ran:6.3f}  waited {waited:6.3f}  ({share:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
