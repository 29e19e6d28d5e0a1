"""A reproducible noisy neighbour: CPU-bound processes beside a server, to measure how its
latency and throughput degrade when the machine does other work too.

    python scripts/noisy_neighbour.py                  # one busy loop at nice 19, until Ctrl-C
    python scripts/noisy_neighbour.py --procs 2 --nice 0 --seconds 120

Each process spins in pure Python (``while True: pass``, one core's worth of demand), the
simplest stand-in for a compiler or a batch job. They run at ``--nice`` (19: the lowest
priority, what a polite background job uses) and are ended by PID when the time is up or on
SIGINT/SIGTERM.

Linux's autogroup (``/proc/sys/kernel/sched_autogroup_enabled``, on in most distributions'
kernels) weighs sessions against each other first, and a nice value counts only inside its own
session. A ``nice -n 19`` job started from another terminal than the server's therefore
competes with the whole server as an equal: it takes one core of two. So each loop runs in a
session of its own whose autogroup nice is ``--session-nice`` (default: ``--nice``), and nice
19 means low priority whichever session the server runs in. ``--session-nice 0`` is the
equal-share case: what a nice'd job from another terminal gets.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BUSY = "while True: pass"


def start(procs: int, nice: int, session_nice: int | None = None) -> list[subprocess.Popen]:
    """Start ``procs`` busy loops at ``nice``, each in a session of its own whose autogroup nice
    is ``session_nice`` (default ``nice``)."""
    session_nice = nice if session_nice is None else session_nice

    def lower_priority() -> None:
        os.setsid()
        try:
            # Raising one's own autogroup nice needs no privilege (lowering it does).
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(session_nice))
        except OSError:
            pass  # no autogroup in this kernel: the task's own nice is all there is
        if nice:
            os.nice(nice)

    return [
        subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lower_priority)
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
    parser.add_argument(
        "--session-nice", type=int, help="their sessions' autogroup nice (default: --nice)"
    )
    parser.add_argument("--seconds", type=float, default=0, help="how long (0: until stopped)")
    args = parser.parse_args()
    session_nice = args.nice if args.session_nice is None else args.session_nice
    niceness_ok = 0 <= args.nice <= 19 and 0 <= session_nice <= 19
    if args.procs < 1 or not niceness_ok or args.seconds < 0:
        print(
            "noisy_neighbour: need --procs >= 1, --nice and --session-nice 0..19, --seconds >= 0",
            file=sys.stderr,
        )
        return 2
    children = start(args.procs, args.nice, session_nice)
    stopping = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    pids = [c.pid for c in children]
    print(f"{args.procs} busy loop(s), nice {args.nice}, session nice {session_nice}: pids {pids}")
    deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
    try:
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop(children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
