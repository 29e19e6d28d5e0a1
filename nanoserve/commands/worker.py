"""``nanoserve worker``: the worker process (model, KV cache, forward, sampling)."""

from __future__ import annotations

import argparse
import logging
import sys

from nanoserve.options import add_options, config_from, options_for


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``worker``: WorkerConfig's and ParallelConfig's options, and the sockets."""
    parser = sub.add_parser("worker", help="run the worker process")
    add_options(parser, options_for("worker"))
    parser.set_defaults(func=run)


def worker_config(args: argparse.Namespace):
    """The WorkerConfig the options describe."""
    from worker.config import WorkerConfig

    return config_from(WorkerConfig, args)


def parallel_config(args: argparse.Namespace):
    """The ParallelConfig the options describe."""
    from worker.parallel.config import ParallelConfig

    return config_from(ParallelConfig, args)


def check_group(config, parallel) -> None:
    """ValueError, in one line, for what a tensor-parallel group does not support: standby
    workers (a standby would have to be a whole group of ranks)."""
    if parallel.size > 1 and config.standby_workers:
        raise ValueError(
            "--standby-workers is not supported with --tensor-parallel-size > 1: a restarted "
            "group re-attaches to its ranks' pools without one (docs/kv_pool.md)"
        )


def run(args: argparse.Namespace) -> int:
    """Run the worker process until it is told to stop."""
    from nanoserve.launch import Running, Sockets
    from worker.process import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config, parallel = worker_config(args), parallel_config(args)
    check_group(config, parallel)
    sockets, running = config_from(Sockets, args), config_from(Running, args)

    def lead(group=None) -> int:
        return run_worker(
            config=config,
            addresses=sockets.addresses(),
            step_delay_s=running.debug_step_delay,
            group=group,
        )

    if parallel.size == 1:
        return lead()
    from nanoserve.options import child_environment
    from worker.parallel.ranks import run_ranks

    def child(rank: int, port: int) -> tuple[list[str], dict[str, str]]:
        env = child_environment(args)
        env.update(NANOSERVE_TP_RANKS=str(rank), NANOSERVE_TP_MASTER_PORT=str(port))
        return [sys.executable, "-m", "nanoserve.cli", "worker"], env

    return run_ranks(config, parallel, lead, child, holder=sockets.addresses().holder)
