"""``nanoserve serve``: start the scheduler, the worker and the frontend, for users without honcho.

The three processes are the same commands the Procfile runs: the scheduler and the worker under
``nanoserve supervise``, which restarts them when they die. Options reach them as NANOSERVE_*
environment variables (exactly as honcho passes .env), so every process sees one configuration.
SIGINT or SIGTERM stops the frontend first (it drains), then the others, and serve exits 0. If
the frontend or a supervisor exits unexpectedly the others are stopped and serve exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from nanoserve.commands.frontend import add_structured_args
from nanoserve.commands.scheduler import add_scheduler_args
from nanoserve.commands.worker import add_worker_args
from nanoserve.options import add_address_args, add_model_arg, env

ROLES = ("scheduler", "worker", "frontend")
SUPERVISED = ("scheduler", "worker")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``."""
    parser = sub.add_parser("serve", help="start all three processes (like `honcho start`)")
    add_model_arg(parser)
    add_address_args(parser)
    add_worker_args(parser)
    add_scheduler_args(parser)
    group = parser.add_argument_group("frontend")
    group.add_argument("--host", default=env("host", "127.0.0.1"))
    group.add_argument("--port", type=int, default=env("port", 8000, int))
    group.add_argument(
        "--api-key",
        default=env("api_key"),
        help="require one of these Bearer tokens (comma-separated)",
    )
    add_structured_args(parser)
    parser.set_defaults(func=run)


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """The parent's environment plus one NANOSERVE_* variable per option that has a value
    (switches as 1 or 0, so an option that defaults to on can be turned off)."""
    environment = dict(os.environ)
    for name, value in vars(args).items():
        if name in ("func", "command") or value is None:
            continue
        text = "1" if value is True else "0" if value is False else str(value)
        environment[f"NANOSERVE_{name.upper()}"] = text
    return environment


def role_command(role: str) -> list[str]:
    """The command line of one role's process, under the supervisor where it restarts."""
    command = [sys.executable, "-m", "nanoserve.cli", role]
    if role in SUPERVISED:
        return [sys.executable, "-m", "nanoserve.cli", "supervise", "--", *command]
    return command


def run(args: argparse.Namespace) -> int:
    """Start the processes and wait; returns 0 after a clean stop."""
    environment = child_environment(args)
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for role in ROLES:
        children[role] = subprocess.Popen(role_command(role), env=environment)
    try:
        while not stopping:
            for role, child in children.items():
                if child.poll() is not None:
                    print(
                        f"nanoserve serve: {role} exited with {child.returncode}", file=sys.stderr
                    )
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(children)


def _stop_all(children: dict[str, subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM the frontend first so it can drain, then the rest; SIGKILL what lingers."""
    for role in ("frontend", "scheduler", "worker"):
        child = children.get(role)
        if child is None or child.poll() is not None:
            continue
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout if role == "frontend" else 5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
