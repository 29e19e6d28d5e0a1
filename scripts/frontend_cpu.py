"""The API side's CPU per output token at many concurrent streams, with 1 and with N frontends
(``--api-servers``): what the frontends and the scheduler spend outside the worker.

    python scripts/frontend_cpu.py --api-servers 1 2 --concurrency 256

It serves a tiny random-weight Llama with SmolLM2's vocabulary and tokenizer
(``gpu_checkpoints.py``), so that the worker's steps cost little beside a real model's while
the API side detokenizes real text; ``--model`` serves another. Each run is ``nanoserve bench
serve`` (64-token prompts, 128 output tokens, ignore_eos, greedy, streamed), which reads the
CPU seconds of every frontend (``nanoserve:frontend_cpu_seconds_total``, summed over them) and
of the scheduler (``nanoserve:scheduler_cpu_seconds_total``) from /metrics before and after.
On a machine of few cores the worker competes with them for the CPU: the figure that carries
over is CPU seconds per token, not tokens a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from compare_servers import Server, free_port  # noqa: E402
from gpu_checkpoints import export_tokenizer, make_checkpoint  # noqa: E402


def serve(model: Path, frontends: int, slots: int, logs: Path) -> Server:
    """Scheduler, worker and ``frontends`` frontends on a free port, float32, no compiling."""
    server = Server(f"{frontends} frontends", free_port(), logs)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NANOSERVE_RUN_ID=f"fcpu{uuid.uuid4().hex[:8]}")
    env |= {"NANOSERVE_PORT": str(server.port), "NANOSERVE_MODEL": str(model)}
    env |= {"NANOSERVE_DTYPE": "float32", "NANOSERVE_COMPILE": "0"}
    env |= {"NANOSERVE_NUM_SLOTS": str(slots), "NANOSERVE_API_SERVERS": str(frontends)}
    env |= {"NANOSERVE_MAX_MODEL_LEN": "512", "NANOSERVE_SERVED_MODEL_NAME": "m"}
    for role in ("scheduler", "worker", "frontend"):
        server.spawn(role, [sys.executable, "-m", "nanoserve.cli", role], env)
    try:
        server.wait_ready("/health", 300)
    except BaseException:
        server.stop()
        raise
    return server


def bench(url: str, concurrency: int, requests: int) -> dict:
    """One ``bench serve`` run's figures (warmed up, then timed)."""
    from nanoserve.bench.serve import BenchServe, BenchServeConfig

    config = BenchServeConfig(
        base_url=url,
        model="m",
        num_prompts=requests,
        input_len=64,
        output_len=128,
        vocab_size=49152,
        max_concurrency=concurrency,
        num_warmups=8,
    )
    report = asyncio.run(BenchServe(config).run())
    keys = ("completed", "failed", "output_throughput", "frontend_cpu_us_per_token")
    keys += ("scheduler_cpu_us_per_token", "scheduler_ms_per_step", "worker_busy_ratio")
    found = {key: report.get(key) for key in keys}
    found["median_itl_ms"] = report["itl_ms"]["median"]
    found["per_frontend"] = report.get("per_frontend")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--model", type=Path, help="a model to serve instead of the tiny one")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="frontend-cpu-") as work:
        model = args.model
        if model is None:
            tokenizer = export_tokenizer(Path(work) / "tokenizer")
            model = Path(work) / "tiny"
            make_checkpoint(model, "tiny", "float32", "cpu", tokenizer)
        rows = []
        for frontends in args.api_servers:
            server = serve(model, frontends, args.concurrency, Path(work) / f"logs-{frontends}")
            try:
                rows.append(
                    {"api_servers": frontends, **bench(server.url, args.concurrency, args.requests)}
                )
            finally:
                server.stop(timeout=30)
            print(json.dumps(rows[-1]), flush=True)
    print(
        "| frontends | output tok/s | frontend CPU us/tok | scheduler CPU us/tok | median ITL ms |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['api_servers']} | {row['output_throughput']:,.0f} "
            f"| {row['frontend_cpu_us_per_token']:.0f} | {row['scheduler_cpu_us_per_token']:.0f} "
            f"| {row['median_itl_ms']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
