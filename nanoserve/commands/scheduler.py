"""``nanoserve scheduler``: the scheduler process (ledgers, planning, audit)."""

from __future__ import annotations

import argparse
import logging

from nanoserve.options import add_address_args, add_pin_cpu_arg, addresses_from, env


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``scheduler``."""
    parser = sub.add_parser("scheduler", help="run the scheduler process")
    add_address_args(parser)
    add_scheduler_args(parser)
    add_pin_cpu_arg(parser)
    parser.set_defaults(func=run)


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler's own options (also used by ``nanoserve serve``)."""
    group = parser.add_argument_group("scheduler")
    group.add_argument(
        "--token-budget",
        type=int,
        default=env("token_budget", 2048, int),
        help="tokens computed per iteration at most (chunked prefill beyond it)",
    )
    group.add_argument(
        "--watermark-blocks",
        type=int,
        default=env("watermark_blocks", None, int),
        help="blocks held back at admission (default 1%% of the pool)",
    )
    group.add_argument(
        "--audit",
        action="store_true",
        default=env("audit", False, bool),
        help="check every ledger invariant between iterations",
    )
    group.add_argument(
        "--disable-overlap",
        action="store_true",
        default=env("disable_overlap", False, bool),
        help="wait for each step's result before planning the next (default: plan step N+1 "
        "while the worker computes step N)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=env("enable_prefix_caching", True, bool),
        help="share the K/V of full blocks between requests with a common prefix (default: on)",
    )
    group.add_argument(
        "--worker-timeout",
        type=float,
        default=env("worker_timeout", 60.0, float),
        help="seconds requests wait for a lost worker to come back before they fail",
    )


def run(args: argparse.Namespace) -> int:
    """Run the scheduler process until interrupted."""
    from nanoserve.cpus import pin_to_last_cpu
    from scheduler.config import SchedulerConfig
    from scheduler.process import run_scheduler

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s"
    )
    config = SchedulerConfig(
        token_budget=args.token_budget,
        watermark_blocks=args.watermark_blocks,
        audit=args.audit,
        overlap=not args.disable_overlap,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    if args.worker_timeout <= 0:
        raise ValueError(f"--worker-timeout must be > 0, got {args.worker_timeout}")
    if args.pin_cpu:
        pin_to_last_cpu(logging.getLogger("nanoserve.scheduler"))
    return run_scheduler(
        config=config, addresses=addresses_from(args), worker_timeout=args.worker_timeout
    )
