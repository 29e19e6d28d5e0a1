"""``nanoserve frontend``: run the OpenAI-compatible API process."""

from __future__ import annotations

import argparse
import logging

from nanoserve.options import add_options, config_from, options_for


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``frontend``: FrontendConfig's options, the model, the sockets, CPU pinning."""
    p = subparsers.add_parser("frontend", help="run the HTTP API process")
    add_options(p, options_for("frontend"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from frontend.config import FrontendConfig
    from frontend.process import run_frontend
    from nanoserve.cpus import pin_to_last_cpu
    from nanoserve.launch import Running, Sockets

    addresses = config_from(Sockets, args).addresses()
    config = config_from(FrontendConfig, args, model=args.model, addresses=addresses)
    running = config_from(Running, args)
    if running.pin_cpu:  # before the tokenizer's and ZeroMQ's threads start: they inherit it
        logging.basicConfig(level=config.log_level.upper())
        pin_to_last_cpu(logging.getLogger("nanoserve.frontend"))
    return run_frontend(config=config)
