"""``nanoserve kv-holder``: the process that owns the shared K/V pool (CPU or CUDA) (``holder/``).

``nanoserve serve --shared-kv-pool`` starts it under the supervisor, beside the worker; with
honcho, add ``kv_holder: nanoserve supervise -- nanoserve kv-holder`` to the Procfile.
"""

from __future__ import annotations

import argparse
import logging

from nanoserve.options import add_options, all_options, config_from


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kv-holder``: the sockets' options (it binds the run's holder endpoint)."""
    from nanoserve.launch import Sockets

    parser = sub.add_parser("kv-holder", help="run the KV pool holder process")
    add_options(parser, [o for o in all_options() if o.owner is Sockets and o.serve])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Hold the pool until interrupted."""
    from holder.process import run_holder
    from nanoserve.launch import Sockets

    logging.basicConfig(level=logging.INFO, format="%(asctime)s holder %(levelname)s %(message)s")
    sockets = config_from(Sockets, args)
    return run_holder(address=sockets.addresses().holder, run_id=sockets.run_id)
