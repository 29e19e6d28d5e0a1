"""Command-line options shared by the process commands, each defaulting to a NANOSERVE_* variable.

honcho reads .env into the environment, so the Procfile's lines stay short; a flag given on the
command line always wins over the environment.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from protocol.addresses import Addresses, default_addresses


def env(name: str, default: Any = None, kind: type = str) -> Any:
    """The value of NANOSERVE_<NAME>, converted with ``kind``, or ``default``."""
    raw = os.environ.get(f"NANOSERVE_{name.upper()}")
    if raw is None or raw == "":
        return default
    if kind is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)


def add_address_args(parser: argparse.ArgumentParser) -> None:
    """--run-id, --transport, --base-port: where the scheduler's sockets live."""
    group = parser.add_argument_group("sockets")
    group.add_argument("--run-id", default=env("run_id", "default"), help="socket name suffix")
    group.add_argument(
        "--transport",
        choices=["ipc", "tcp"],
        default=env("transport", "ipc"),
        help="ipc (private 0700 directory, default) or tcp on 127.0.0.1",
    )
    group.add_argument(
        "--base-port",
        type=int,
        default=env("base_port", 5610, int),
        help="first of three tcp ports (tcp transport only)",
    )


def addresses_from(args: argparse.Namespace) -> Addresses:
    """The Addresses the socket options name."""
    return default_addresses(args.run_id, args.transport, args.base_port)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """--model: a .gguf file or Hugging Face directory; the default model when absent."""
    parser.add_argument(
        "--model", default=env("model"), help="GGUF file or model directory (default: SmolLM2-135M)"
    )


def add_pin_cpu_arg(parser: argparse.ArgumentParser) -> None:
    """--pin-cpu: the frontend and the scheduler run on the last CPU they may use."""
    parser.add_argument(
        "--pin-cpu",
        action=argparse.BooleanOptionalAction,
        default=env("pin_cpu", True, bool),
        help="run on the last CPU this process may use, where the worker's steps meet it "
        "least (default: on; nanoserve/cpus.py)",
    )
