"""``nanoserve worker``: the worker process (model, KV cache, forward, sampling)."""

from __future__ import annotations

import argparse
import logging
import sys

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
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=env("dtype", "auto"),
        help="auto: bfloat16 where the device computes it natively (CUDA, AVX512-BF16, AMX)",
    )
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
        "--adapt-threads",
        action=argparse.BooleanOptionalAction,
        default=env("adapt_threads", True, bool),
        help="CPU: drop to one thread while another process holds a core (a step's threads "
        "wait for each other at every barrier), and probe for the cores coming back (default on)",
    )
    group.add_argument(
        "--q4-max-tokens",
        type=int,
        default=env("q4_max_tokens", 8, int),
        help="CPU, bfloat16, Q4_0/Q4_1 GGUF: steps of at most this many tokens run on the "
        "file's own 4-bit weights (0: never; default 8)",
    )
    group.add_argument(
        "--w4a8",
        action=argparse.BooleanOptionalAction,
        default=env("w4a8", True, bool),
        help="there, where the CPU has AVX512-VNNI: the MLP's bigger steps multiply the same "
        "4-bit weights by activations quantized to 8 bits in groups of 32, as llama.cpp does "
        "(default on; --no-w4a8: bfloat16 matrices)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=env("kv_cache_dtype", "auto"),
        help="the K/V pool's dtype. auto: float16 under auto's float32 on a CPU (as llama.cpp's "
        "f16 K/V: half the bytes a decode reads), else the model's dtype",
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=env("compile", None, bool),
        help="CPU: decode steps of at most 32 rows as one torch.compile'd graph (default: on "
        "where it pays). The worker serves eagerly while the graphs are built in the "
        "background (minutes the first time, seconds from the cache), then switches",
    )
    group.add_argument(
        "--generic-path",
        action=argparse.BooleanOptionalAction,
        default=env("generic_path", False, bool),
        help="run on CPU exactly the code CUDA runs: torch attention, plain weights (no oneDNN "
        "packing, no 4-bit matrices), torch's argmax; none of nanoserve's own kernels",
    )
    add_parallel_args(parser)
    group.add_argument(
        "--debug-step-delay",
        type=float,
        default=env("debug_step_delay", 0.0, float),
        help="sleep this many seconds in every step (testing only)",
    )


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism: how many ranks, which run here, and where they meet."""
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=env("tensor_parallel_size", 1, int),
        help="ranks the worker is split across (each holds a share of every layer's heads)",
    )
    group.add_argument(
        "--tp-ranks",
        default=env("tp_ranks", ""),
        help="the ranks this host runs, e.g. 0 or 2-3 (default: all); this process runs the "
        "first and starts the others",
    )
    group.add_argument(
        "--tp-master-addr",
        default=env("tp_master_addr", "127.0.0.1"),
        help="rank 0's host, where its TCP store listens (default 127.0.0.1)",
    )
    group.add_argument(
        "--tp-master-port",
        type=int,
        default=env("tp_master_port", 0, int),
        help="the TCP store's port (default 0: any free port; ranks on several hosts need one)",
    )
    group.add_argument(
        "--tp-timeout",
        type=float,
        default=env("tp_timeout", 3.0, float),
        help="seconds a rank may be silent before the whole worker stops (default 3)",
    )
    group.add_argument(
        "--tp-connect-timeout",
        type=float,
        default=env("tp_connect_timeout", 60.0, float),
        help="seconds to wait for rank 0's store at start (default 60)",
    )


def parallel_config(args: argparse.Namespace):
    """The ParallelConfig the options describe."""
    from worker.parallel.ranks import ParallelConfig

    return ParallelConfig(
        size=args.tensor_parallel_size,
        ranks=_ranks(args.tp_ranks),
        master_addr=args.tp_master_addr,
        master_port=args.tp_master_port,
        timeout_s=args.tp_timeout,
        connect_timeout_s=args.tp_connect_timeout,
    )


def _ranks(text: str) -> tuple[int, ...]:
    """``"0,2"`` or ``"2-3"`` -> the ranks; ``""`` -> () (all)."""
    ranks: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            ranks.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"bad tensor parallel ranks {text!r} (want e.g. 0 or 2-3)") from None
    return tuple(ranks)


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
        w4a8=args.w4a8,
        kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile,
        generic_path=args.generic_path,
        adapt_threads=args.adapt_threads,
    )


def run(args: argparse.Namespace) -> int:
    """Run the worker process until it is told to stop."""
    from worker.process import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config, parallel = worker_config(args), parallel_config(args)

    def lead(group=None) -> int:
        return run_worker(
            config=config,
            addresses=addresses_from(args),
            step_delay_s=args.debug_step_delay,
            group=group,
        )

    if parallel.size == 1:
        return lead()
    from nanoserve.commands.serve import child_environment
    from worker.parallel.ranks import run_ranks

    def child(rank: int, port: int) -> tuple[list[str], dict[str, str]]:
        env = child_environment(args)
        env.update(NANOSERVE_TP_RANKS=str(rank), NANOSERVE_TP_MASTER_PORT=str(port))
        return [sys.executable, "-m", "nanoserve.cli", "worker"], env

    return run_ranks(config, parallel, lead, child)
