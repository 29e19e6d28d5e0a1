"""``nanoserve worker``: the worker process (model, KV cache, forward, sampling)."""

from __future__ import annotations

import argparse
import logging

from nanoserve.options import add_address_args, add_model_arg, addresses_from, env


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``worker``."""
    parser = sub.add_parser("worker", help="run the worker process")
    add_model_arg(parser)
    add_address_args(parser)
    add_worker_args(parser)
    parser.set_defaults(func=run)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The worker's own options (also used by ``nanoserve serve``)."""
    group = parser.add_argument_group("worker")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default=env("dtype", "float32"))
    group.add_argument("--device", default=env("device", "auto"), help="auto, cpu or cuda")
    group.add_argument("--block-size", type=int, default=env("block_size", 16, int))
    group.add_argument("--num-blocks", type=int, default=env("num_blocks", None, int))
    group.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        default=env("kv_cache_memory", None, _bytes),
        help="KV pool budget, e.g. 2GiB or 512MiB (default: from free memory)",
    )
    group.add_argument("--num-slots", type=int, default=env("num_slots", 128, int))
    group.add_argument("--max-model-len", type=int, default=env("max_model_len", None, int))
    group.add_argument("--seed", type=int, default=env("seed", 0, int))
    group.add_argument("--threads", type=int, default=env("threads", None, int))
    group.add_argument(
        "--q4-max-tokens",
        type=int,
        default=env("q4_max_tokens", 8, int),
        help="CPU, bfloat16, Q4_0/Q4_1 GGUF: steps of at most this many tokens run on the "
        "file's own 4-bit weights (0: never; default 8)",
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=env("compile", False, bool),
        help="CPU: run decode steps of at most 32 rows as one torch.compile'd graph (the first "
        "start compiles for minutes; later starts read inductor's cache)",
    )
    group.add_argument(
        "--generic-path",
        action=argparse.BooleanOptionalAction,
        default=env("generic_path", False, bool),
        help="run on CPU exactly the code CUDA runs: torch attention, plain weights (no oneDNN "
        "packing, no 4-bit matrices), torch's argmax; none of nanoserve's own kernels",
    )
    group.add_argument(
        "--debug-step-delay",
        type=float,
        default=env("debug_step_delay", 0.0, float),
        help="sleep this many seconds in every step (testing only)",
    )


def _bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    return int(lowered)


def worker_config(args: argparse.Namespace):
    """The WorkerConfig the options describe."""
    from worker.config import WorkerConfig

    return WorkerConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        num_slots=args.num_slots,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.threads,
        q4_max_tokens=args.q4_max_tokens,
        compile=args.compile,
        generic_path=args.generic_path,
    )


def run(args: argparse.Namespace) -> int:
    """Run the worker process until it is told to stop."""
    from worker.process import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    return run_worker(
        config=worker_config(args),
        addresses=addresses_from(args),
        step_delay_s=args.debug_step_delay,
    )
