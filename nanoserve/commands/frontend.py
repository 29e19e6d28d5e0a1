"""``nanoserve frontend``: run the OpenAI-compatible API process, or ``--api-servers`` of them.

With ``--api-servers N`` above 1 this process manages N frontend children on one port
(``nanoserve.api_servers``); each child is this same command, told its index by
``NANOSERVE_API_SERVER_INDEX``.
"""

from __future__ import annotations

import argparse
import logging
import os

from nanoserve.options import add_options, child_environment, config_from, options_for


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``frontend``: FrontendConfig's options, the model, the sockets, CPU pinning."""
    p = subparsers.add_parser("frontend", help="run the HTTP API process (or several)")
    add_options(p, options_for("frontend"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from frontend.config import FrontendConfig
    from nanoserve.api_servers import INDEX_VARIABLE, ApiServers
    from nanoserve.launch import Running, Sockets

    addresses = config_from(Sockets, args).addresses()
    index = os.environ.get(INDEX_VARIABLE)
    config = config_from(
        FrontendConfig,
        args,
        model=args.model,
        addresses=addresses,
        api_server_index=_index(index) if index is not None else 0,
    )
    running = config_from(Running, args)
    if config.api_servers > 1 and index is None:
        manager = ApiServers(config.api_servers, child_environment(args))
        manager.install_signal_handlers()
        return manager.run()
    return _serve(config, running.pin_cpu)


def _index(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"NANOSERVE_API_SERVER_INDEX={text!r}: not a number") from None


def _serve(config, pin_cpu: bool) -> int:
    """Run one frontend process (on its own CPU when pinned)."""
    from frontend.process import run_frontend
    from nanoserve.cpus import frontend_offset, pin_to_last_cpu

    if pin_cpu:  # before the tokenizer's and ZeroMQ's threads start: they inherit it
        logging.basicConfig(level=config.log_level.upper())
        offset = frontend_offset(config.api_server_index, config.api_servers, _cpu_count())
        pin_to_last_cpu(logging.getLogger("nanoserve.frontend"), from_last=offset)
    return run_frontend(config=config)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform: pinning does nothing there
        return 1
