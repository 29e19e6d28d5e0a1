"""``nanoserve frontend``: run the OpenAI-compatible API process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from nanoserve.options import (
    add_address_args,
    add_model_arg,
    add_pin_cpu_arg,
    addresses_from,
    env,
)

_ENV = "NANOSERVE_"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(_ENV + name, default)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``frontend`` and its flags (NANOSERVE_* environment variables set defaults)."""
    p = subparsers.add_parser("frontend", help="run the HTTP API process")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="bind address [%(default)s]")
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000")), help="[%(default)s]")
    add_model_arg(p)
    p.add_argument("--tokenizer", default=_env("TOKENIZER"), help="tokenizer model (--model)")
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"))
    add_address_args(p)
    add_pin_cpu_arg(p)
    p.add_argument(
        "--frontend-address",
        default=_env("FRONTEND_ADDRESS"),
        help="scheduler's frontend endpoint (overrides --run-id/--transport)",
    )
    p.add_argument(
        "--monitor-address",
        default=_env("MONITOR_ADDRESS"),
        help="scheduler's monitor feed for the web page (default: from --run-id/--transport; "
        "none with --frontend-address)",
    )
    p.add_argument(
        "--api-key",
        default=_env("API_KEY"),
        help="require one of these Bearer tokens on /v1/* (several: comma-separated); each key "
        "is a tenant of its own in the prefix cache",
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-stop-strings", type=int, default=16)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="cap for requests without max_tokens (default: fill the context)",
    )
    add_structured_args(p)
    p.add_argument("--drain-timeout", type=float, default=float(_env("DRAIN_TIMEOUT", "30")))
    p.add_argument("--scheduler-timeout", type=float, default=2.0)
    p.add_argument("--stall-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    p.set_defaults(func=_run)


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    """How JSON schemas compile (vLLM's switch names) and how long a grammar may take; the
    defaults are FrontendConfig's (frontend.json_schema says why)."""
    group = parser.add_argument_group("structured outputs")
    group.add_argument(
        "--disable-additional-properties",
        action=argparse.BooleanOptionalAction,
        default=env("disable_additional_properties", True, bool),
        help="close every JSON object that names its properties and does not set "
        "additionalProperties (default: on; --no-...: such objects are open, as JSON Schema "
        "reads them; a request may say otherwise in structured_outputs)",
    )
    group.add_argument(
        "--disable-any-whitespace",
        action=argparse.BooleanOptionalAction,
        default=env("disable_any_whitespace", True, bool),
        help="JSON without free whitespace between tokens (default: on; a request may say "
        "otherwise in structured_outputs)",
    )
    group.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=env("grammar_compile_timeout", 2.0, float),
        help="seconds a grammar may take to compile; a slower one gets a 400 [%(default)s]",
    )


def _run(args: argparse.Namespace) -> int:
    from frontend.config import FrontendConfig
    from frontend.process import run_frontend
    from nanoserve.cpus import pin_to_last_cpu
    from protocol.addresses import Addresses

    addresses = addresses_from(args)
    if args.frontend_address:
        addresses = Addresses(frontend=args.frontend_address, worker=addresses.worker)
    if args.monitor_address:
        addresses = dataclasses.replace(addresses, monitor=args.monitor_address)
    config = FrontendConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        addresses=addresses,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_stop_strings=args.max_stop_strings,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        default_max_tokens=args.default_max_tokens,
        disable_any_whitespace=args.disable_any_whitespace,
        disable_additional_properties=args.disable_additional_properties,
        grammar_compile_timeout=args.grammar_compile_timeout,
        drain_timeout=args.drain_timeout,
        scheduler_timeout=args.scheduler_timeout,
        stall_timeout=args.stall_timeout,
        log_level=args.log_level,
    )
    if args.pin_cpu:  # before the tokenizer's and ZeroMQ's threads start: they inherit it
        logging.basicConfig(level=config.log_level.upper())
        pin_to_last_cpu(logging.getLogger("nanoserve.frontend"))
    return run_frontend(config=config)
