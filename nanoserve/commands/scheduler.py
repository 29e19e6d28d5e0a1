"""``nanoserve scheduler``: the scheduler process (ledgers, planning, audit)."""

from __future__ import annotations

import argparse
import logging

from nanoserve.options import add_options, config_from, options_for


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``scheduler``: SchedulerConfig's options, the sockets and how it runs."""
    parser = sub.add_parser("scheduler", help="run the scheduler process")
    add_options(parser, options_for("scheduler"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the scheduler process until interrupted."""
    from nanoserve.cpus import pin_to_last_cpu
    from nanoserve.launch import Running, Sockets
    from scheduler.config import SchedulerConfig
    from scheduler.process import run_scheduler

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s"
    )
    config, running = config_from(SchedulerConfig, args), config_from(Running, args)
    addresses = config_from(Sockets, args).addresses()
    if running.pin_cpu:
        pin_to_last_cpu(logging.getLogger("nanoserve.scheduler"))
    return run_scheduler(config=config, addresses=addresses, worker_timeout=running.worker_timeout)
