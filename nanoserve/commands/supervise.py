"""``nanoserve supervise -- COMMAND...``: restart a process that dies, with backoff.

The Procfile runs the worker and the scheduler under it, because honcho stops every process as
soon as one exits. See nanoserve/supervisor.py for the rules.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``supervise``."""
    parser = sub.add_parser(
        "supervise",
        help="run a command, restarting it with backoff when it dies",
        usage="nanoserve supervise [options] -- COMMAND [ARGS...]",
    )
    parser.add_argument("--initial-backoff", type=float, default=0.5, help="seconds [0.5]")
    parser.add_argument("--max-backoff", type=float, default=30.0, help="seconds [30]")
    parser.add_argument(
        "--healthy-after",
        type=float,
        default=30.0,
        help="a run this long resets the backoff [30 s]",
    )
    parser.add_argument(
        "--pid-file",
        type=Path,
        default=None,
        help="write the current child's PID here at every start",
    )
    parser.add_argument("child", nargs=argparse.REMAINDER, help="-- then the command to run")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Supervise the command until it exits 0 or a signal stops it."""
    from nanoserve.supervisor import Supervisor, SupervisorConfig

    command = args.child[1:] if args.child[:1] == ["--"] else args.child
    config = SupervisorConfig(
        command=tuple(command),
        initial_backoff=args.initial_backoff,
        max_backoff=args.max_backoff,
        healthy_after=args.healthy_after,
        pid_file=args.pid_file,
    )
    supervisor = Supervisor(config)
    supervisor.install_signal_handlers()
    return supervisor.run()
