"""The side-by-side benchmark: nanoserve against llama.cpp's server and transformers' static
batching, on the same model file and the same work, printed as one table.

    python scripts/compare.py                          # nanoserve, float32 and bfloat16
    python scripts/compare.py --with-llamacpp --with-transformers
    python scripts/compare.py --dtypes bfloat16 --compile     # also with small steps compiled
    python scripts/compare.py --workload multi-turn --with-llamacpp  # chat histories

Every server runs the same ``nanoserve bench serve`` load (128 prompt tokens, 128 output tokens
with ignore_eos, greedy, streaming) at each ``--concurrency``, one server at a time. llama.cpp's
``llama-server`` is built from the llama-cpp-python sdist on PyPI the first time it is asked for
(7 minutes on two busy cores; kept in ``--llama-cache``), or taken from ``--llama-server``.

``--workload multi-turn`` runs ``bench serve --dataset multi-turn`` instead (conversations that
resend their whole history each turn, a shared system prompt, the server's replies fed back),
against nanoserve with prefix caching on and off and against llama-server with its default
prompt cache, and prints TTFT for turns 2 and later.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from compare_servers import (  # noqa: E402 - after the path setup above
    build_llama_server,
    start_llama_server,
    start_nanoserve,
)

COLUMNS = (
    ("server", "server", "{}"),
    ("dtype", "dtype", "{}"),
    ("conc.", "concurrency", "{}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("median TTFT ms", "ttft_median", "{:.0f}"),
    ("median ITL ms", "itl_median", "{:.1f}"),
    ("p99 ITL ms", "itl_p99", "{:.1f}"),
    ("median TPOT ms", "tpot_median", "{:.1f}"),
    ("worker busy", "worker_busy_ratio", "{:.0%}"),
    ("sched. ms/step", "scheduler_ms_per_step", "{:.2f}"),
    ("worker RSS MiB start", "worker_rss_mib_start", "{:.0f}"),
    ("end", "worker_rss_mib_end", "{:.0f}"),
    ("failed", "failed", "{}"),
)


MULTI_TURN_COLUMNS = (
    ("server", "server", "{}"),
    ("prefix cache", "caching", "{}"),
    ("conversations x turns", "shape", "{}"),
    ("mean TTFT turns 2+ ms", "ttft_later_mean", "{:.0f}"),
    ("median TTFT turns 2+ ms", "ttft_later_median", "{:.0f}"),
    ("mean TTFT turn 1 ms", "ttft_first_mean", "{:.0f}"),
    ("duration s", "duration_s", "{:.1f}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("failed", "failed", "{}"),
)


def bench_multi_turn(url: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``bench serve --dataset multi-turn`` run; its report, flattened for the table."""
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
    command += ["--endpoint-type", "chat", "--dataset", "multi-turn", "--num-warmups", "1"]
    command += ["--num-conversations", str(args.conversations), "--turns", str(args.turns)]
    command += ["--system-len", str(args.system_len), "--input-len", str(args.turn_len)]
    command += ["--output-len", str(args.reply_len), "--json", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    report = json.loads(out.read_text())
    report["shape"] = f"{report['conversations']} x {report['turns']}"
    report["ttft_later_mean"] = report["ttft_later_turns_ms"]["mean"]
    report["ttft_later_median"] = report["ttft_later_turns_ms"]["median"]
    report["ttft_first_mean"] = report["per_turn"][0]["ttft_ms"]["mean"]
    return report


def multi_turn_rows(args: argparse.Namespace, work: Path, logs: Path) -> list[dict]:
    """nanoserve with prefix caching on and off, then llama-server, on the same conversations."""
    rows = []
    if not args.skip_nanoserve:
        for caching in (True, False):
            label = "on" if caching else "off"
            env = {"NANOSERVE_ENABLE_PREFIX_CACHING": "1" if caching else "0"}
            for dtype in args.dtypes:
                server = start_nanoserve(
                    dtype, logs / f"nanoserve-{dtype}-cache-{label}", args.threads, False, env
                )
                try:
                    report = bench_multi_turn(server.url, args, work / f"mt-{dtype}-{label}.json")
                finally:
                    server.stop()
                rows.append({**report, "server": f"nanoserve {dtype}", "caching": label})
                print(format_table(rows[-1:], MULTI_TURN_COLUMNS), flush=True)
    if args.with_llamacpp:
        server = _llama_server(args, logs, slot_context=4096)
        try:
            report = bench_multi_turn(server.url, args, work / "mt-llama.json")
        finally:
            server.stop()
        rows.append({**report, "server": "llama.cpp", "caching": "cache_prompt"})
        print(format_table(rows[-1:], MULTI_TURN_COLUMNS), flush=True)
    return rows


def _llama_server(args: argparse.Namespace, logs: Path, slot_context: int = 512):
    from protocol.model_files import resolve_model

    binary, built_s = args.llama_server, 0.0
    if binary is None:
        binary, built_s = build_llama_server(args.llama_cache)
    if built_s:
        print(f"built llama-server in {built_s:.0f} s", flush=True)
    gguf = resolve_model(None).source
    threads = os.cpu_count() or 1
    return start_llama_server(
        binary, gguf, logs / "llama.cpp", args.llama_slots, threads, slot_context
    )


def bench(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    """One ``nanoserve bench serve`` run; its JSON report, flattened for the table."""
    prompts = max(concurrency * args.waves, args.min_prompts)
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
    command += ["--max-concurrency", str(concurrency), "--num-prompts", str(prompts)]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    command += ["--num-warmups", "2", "--json", str(out)]
    with open(out.with_suffix(".log"), "w") as log:  # the full vLLM-style report, kept aside
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    report = json.loads(out.read_text())
    for key in ("ttft", "itl", "tpot"):
        report[f"{key}_median"] = report[f"{key}_ms"]["median"]
        report[f"{key}_p99"] = report[f"{key}_ms"]["p99"]
    return report


def run_server(name, dtype, server, args, work: Path) -> list[dict]:
    """Bench a started server at every concurrency, then stop it."""
    rows = []
    try:
        for concurrency in args.concurrency:
            out = work / f"{name}-{dtype}-c{concurrency}.json".replace(" ", "_")
            report = bench(server.url, concurrency, args, out)
            rows.append({**report, "server": name, "dtype": dtype, "concurrency": concurrency})
            print(format_table(rows[-1:]), flush=True)
    finally:
        server.stop()
    return rows


def transformers_rows(args: argparse.Namespace) -> list[dict]:
    """Static batching at batch 32 in each dtype, each in a fresh process."""
    rows = []
    for dtype in args.dtypes:
        command = [sys.executable, str(HERE / "compare_hf.py"), "--dtype", dtype]
        command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(format_table(rows[-1:]), flush=True)
    return rows


def format_table(rows: list[dict], columns: tuple = COLUMNS) -> str:
    """A Markdown table; cells a server does not report read ``-``."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        choices=("throughput", "multi-turn"),
        default="throughput",
        help="throughput: random prompts at --concurrency; multi-turn: chat conversations",
    )
    parser.add_argument("--conversations", type=int, default=8, help="multi-turn, at once")
    parser.add_argument("--turns", type=int, default=6, help="multi-turn: turns each")
    parser.add_argument(
        "--system-len", type=int, default=950, help="multi-turn: words (~1,000 tokens)"
    )
    parser.add_argument("--turn-len", type=int, default=38, help="multi-turn: user words")
    parser.add_argument("--reply-len", type=int, default=64, help="multi-turn: reply tokens")
    parser.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    parser.add_argument(
        "--concurrency", default="32,1", type=lambda s: [int(c) for c in s.split(",")]
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="prompts per concurrent client")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="worker threads (nanoserve)")
    parser.add_argument(
        "--compile", action="store_true", help="also bench nanoserve with --compile, each dtype"
    )
    parser.add_argument("--with-llamacpp", action="store_true", help="also bench llama-server")
    parser.add_argument("--llama-server", type=Path, help="a built llama-server binary")
    parser.add_argument(
        "--llama-cache", type=Path, default=Path.home() / ".cache" / "nanoserve" / "llama.cpp"
    )
    parser.add_argument("--llama-slots", type=int, default=8)
    parser.add_argument("--with-transformers", action="store_true", help="static batching too")
    parser.add_argument("--skip-nanoserve", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: tmp)")
    parser.add_argument("--json", type=Path, help="write every row as JSON here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="nanoserve-compare-"))
    logs = args.log_dir or work / "logs"
    if args.workload == "multi-turn":
        rows = multi_turn_rows(args, work, logs)
        print()
        print(format_table(rows, MULTI_TURN_COLUMNS))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    rows: list[dict] = []
    if not args.skip_nanoserve:
        for dtype in args.dtypes:
            for compile in (False, True) if args.compile else (False,):
                label = f"{dtype} compiled" if compile else dtype
                log_dir = logs / f"nanoserve-{label}".replace(" ", "-")
                server = start_nanoserve(dtype, log_dir, args.threads, compile)
                rows += run_server("nanoserve", label, server, args, work)
    if args.with_llamacpp:
        from protocol.model_files import resolve_model

        server = _llama_server(args, logs)
        rows += run_server("llama.cpp", resolve_model(None).source.name, server, args, work)
    if args.with_transformers:
        rows += transformers_rows(args)
    print()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
