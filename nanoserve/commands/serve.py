"""``nanoserve serve``: start the scheduler, the worker and the frontend, for users without honcho.

The three processes are the same commands the Procfile runs: the scheduler and the worker under
``nanoserve supervise``, which restarts them when they die (with ``--shared-kv-pool``, a fourth:
the KV pool holder, supervised too). Options reach them as NANOSERVE_*
environment variables (exactly as honcho passes .env), so every process sees one configuration.
SIGINT or SIGTERM stops the frontend first (it drains), then the others, and serve exits 0. If
the frontend or a supervisor exits unexpectedly the others are stopped and serve exits 1.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from nanoserve.options import add_options, child_environment, config_from, options_for

ROLES = ("scheduler", "worker", "frontend")
SUPERVISED = ("kv-holder", "scheduler", "worker")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``: the options of all three processes."""
    parser = sub.add_parser("serve", help="start all three processes (like `honcho start`)")
    add_options(parser, options_for("serve"))
    parser.set_defaults(func=run)


def check(args: argparse.Namespace) -> None:
    """Build every process's config here, so that a bad value is one line (ValueError) before
    anything starts, not a child that fails and is restarted."""
    from frontend.config import FrontendConfig
    from nanoserve.commands.worker import check_group
    from nanoserve.fleet import Fleet
    from nanoserve.launch import Running, Sockets
    from scheduler.config import SchedulerConfig
    from worker.config import WorkerConfig
    from worker.parallel.config import ParallelConfig

    for cls in (WorkerConfig, ParallelConfig, SchedulerConfig, Running, Fleet):
        config_from(cls, args)
    check_group(config_from(WorkerConfig, args), config_from(ParallelConfig, args))
    addresses = config_from(Sockets, args).addresses()
    config_from(FrontendConfig, args, model=args.model, addresses=addresses)


def role_command(role: str) -> list[str]:
    """The command line of one role's process, under the supervisor where it restarts."""
    command = [sys.executable, "-m", "nanoserve.cli", role]
    if role in SUPERVISED:
        return [sys.executable, "-m", "nanoserve.cli", "supervise", "--", *command]
    return command


def run(args: argparse.Namespace) -> int:
    """Start the processes and wait; returns 0 after a clean stop."""
    from nanoserve.fleet import Fleet, run_fleet

    check(args)
    environment = child_environment(args)
    fleet = config_from(Fleet, args)
    if fleet.replicas > 1 or fleet.router != "none":
        return run_fleet(args, fleet, environment)  # several replicas, a router: nanoserve.fleet
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # With --shared-kv-pool, the pool holder first: the worker asks it for the pool.
    roles = ("kv-holder", *ROLES) if args.shared_kv_pool else ROLES
    for role in roles:
        children[role] = subprocess.Popen(role_command(role), env=environment)
    for index in range(args.standby_workers):  # each waits to take the pool over
        children[f"standby-{index}"] = subprocess.Popen(role_command("worker"), env=environment)
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
        stop_all(children)


def stop_all(children: dict[str, subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM the frontend first so it can drain, then the rest; SIGKILL what lingers."""
    standbys = [role for role in children if role.startswith("standby-")]
    for role in ("frontend", "scheduler", "worker", *standbys, "kv-holder"):
        child = children.get(role)
        if child is None or child.poll() is not None:
            continue
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout if role == "frontend" else 5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
