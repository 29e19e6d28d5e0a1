"""``nanoserve bench serve``: load-test any OpenAI-compatible server (ours, llama.cpp's, vLLM's)
and print a vLLM-style table of throughput, TTFT/TPOT/ITL/E2EL, goodput and failures.

The work happens in ``nanoserve.bench.serve``; this module is flags, the table and ``--json``.
Torch-free, so it can run beside the server it measures without paying for a torch import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Coroutine

_WIDTH = 50
_SECTIONS = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` under the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description="Load-test an OpenAI-compatible server (nanoserve, llama.cpp, vLLM) with "
        "streaming requests; print throughput, TTFT/TPOT/ITL/E2EL, goodput and failures.",
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    srv.add_argument("--endpoint-type", choices=("completions", "chat"), default="completions")
    srv.add_argument("--model", help="model name to send (default: first of /v1/models)")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    srv.add_argument("--no-stream-usage", action="store_true", help="omit stream_options")
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    srv.add_argument("--ready-timeout", type=float, default=0.0, help="wait for /v1/models")
    work = p.add_argument_group("workload")
    work.add_argument(
        "--dataset",
        choices=("random", "shipped", "multi-turn", "repetitive"),
        default="random",
        help="multi-turn: chat conversations that resend their history (--endpoint-type chat); "
        "repetitive: return the prompt's paragraph or JSON with one change (for speculation)",
    )
    work.add_argument(
        "--random-prefix-len", type=int, default=0, help="one shared prefix before every prompt"
    )
    work.add_argument("--num-conversations", type=int, default=8, help="multi-turn, at once")
    work.add_argument("--turns", type=int, default=6, help="multi-turn: user messages each")
    work.add_argument(
        "--system-len",
        type=int,
        default=950,
        help="multi-turn: words of the system prompt (about 1,000 tokens)",
    )
    work.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        help="random prompts as token ids or words (default: ids; text for chat)",
    )
    work.add_argument("--num-prompts", type=int, default=100)
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens (words: text)")
    work.add_argument("--output-len", type=int, default=128, help="tokens, forced: ignore_eos")
    work.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by ±ratio")
    work.add_argument("--vocab-size", type=int, default=32000, help="random ids are below this")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    work.add_argument(
        "--extra-body", type=_json_object, default={}, help="JSON merged into each request"
    )
    work.add_argument(
        "--structured",
        choices=("json-schema",),
        help="run the load twice, unconstrained then every request under a JSON schema, and "
        "compare output tok/s (with the worker's mask time per token)",
    )
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")
    out = p.add_argument_group("report")
    out.add_argument(
        "--goodput", nargs="+", metavar="KEY:MS", default=[], help="SLOs: ttft, tpot, e2el"
    )
    out.add_argument("--json", metavar="PATH", help="write the result as JSON ('-': stdout)")
    p.set_defaults(func=run)


def parse_slos(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--goodput {item!r}: want KEY:MILLISECONDS, e.g. ttft:500")
    return slos


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("want a JSON object, e.g. '{\"cache_prompt\": false}'")
    return value


def config_from_args(args: argparse.Namespace) -> object:
    """The validated ``BenchServeConfig`` the flags describe."""
    from nanoserve.bench.serve import BenchServeConfig

    chat = args.endpoint_type == "chat"
    return BenchServeConfig(
        base_url=args.base_url,
        endpoint_type=args.endpoint_type,
        model=args.model,
        api_key=args.api_key,
        dataset=args.dataset,
        prompt_format=args.prompt_format or ("text" if chat else "ids"),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        vocab_size=args.vocab_size,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        num_warmups=args.num_warmups,
        goodput=parse_slos(args.goodput),
        temperature=args.temperature,
        extra_body=args.extra_body,
        stream_usage=not args.no_stream_usage,
        request_timeout=args.request_timeout,
        ready_timeout=args.ready_timeout,
        random_prefix_len=args.random_prefix_len,
        num_conversations=args.num_conversations,
        turns=args.turns,
        system_len=args.system_len,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON when asked. Exit 1 if all failed."""
    from nanoserve.bench.serve import BenchServe

    config = config_from_args(args)
    to_stdout = args.json == "-"
    table_out = sys.stderr if to_stdout else sys.stdout  # keep stdout pure JSON
    what = (
        f"{config.num_conversations} conversations of {config.turns} turns"
        if config.dataset == "multi-turn"
        else f"{config.num_prompts} requests"
    )
    print(f"bench serve: {what} to {config.endpoint_url}", file=table_out)
    if args.structured:
        return _run_structured(args, config, table_out)
    report = _run_async(BenchServe(config).run())
    print(format_table(report), file=table_out)
    if args.json:
        text = json.dumps(report, indent=2) + "\n"
        if to_stdout:
            sys.stdout.write(text)
        else:
            _write(args.json, text)
    return 0 if report["completed"] else 1


def _run_structured(args: argparse.Namespace, config: object, table_out) -> int:
    """``--structured``: both runs' tables, then the comparison (``nanoserve.bench.structured``)."""
    from nanoserve.bench.structured import compare, format_comparison

    result = _run_async(compare(config))
    for name in ("unconstrained", "json_schema"):
        print(f"--- {name} ---", file=table_out)
        print(format_table(result[name]), file=table_out)
    print(format_comparison(result), file=table_out)
    if args.json:
        text = json.dumps(result, indent=2) + "\n"
        sys.stdout.write(text) if args.json == "-" else _write(args.json, text)
    both = result["unconstrained"]["completed"] and result["json_schema"]["completed"]
    return 0 if both else 1


def _run_async(coro: Coroutine[object, object, dict]) -> dict:
    # uvloop, when installed, stamps chunk arrivals with less client overhead at high load.
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise ValueError(f"cannot write --json {path}: {exc.strerror}") from None


def format_table(report: dict) -> str:
    """The report as a fixed-width table in the style of ``vllm bench serve``."""
    rows = [
        ("Successful requests:", report["completed"]),
        ("Failed requests:", report["failed"]),
        ("Maximum request concurrency:", report["max_concurrency"] or "unlimited"),
        ("Request rate (req/s):", report["request_rate"] or "inf"),
        ("Benchmark duration (s):", report["duration_s"]),
        ("Total input tokens:", report["total_input_tokens"]),
        ("Total generated tokens:", report["total_output_tokens"]),
        ("Request throughput (req/s):", report["request_throughput"]),
        ("Request goodput (req/s):", report["request_goodput"]),
        ("Output token throughput (tok/s):", report["output_throughput"]),
        ("Total token throughput (tok/s):", report["total_token_throughput"]),
        ("Worker busy ratio:", report["worker_busy_ratio"]),
        ("Scheduler steps:", report.get("scheduler_steps")),
        ("Scheduler ms per step:", report.get("scheduler_ms_per_step")),
        ("Frontends (each scraped):", report.get("frontends")),
        ("Frontend CPU per token (us):", report.get("frontend_cpu_us_per_token")),
        ("Scheduler CPU per token (us):", report.get("scheduler_cpu_us_per_token")),
        ("Worker RSS at start (MiB):", report.get("worker_rss_mib_start")),
        ("Worker RSS at end (MiB):", report.get("worker_rss_mib_end")),
    ]
    if report.get("grammar_fill_us_per_token") is not None:
        rows.append(("Grammar mask fill (us/token):", report["grammar_fill_us_per_token"]))
        rows.append(("Grammar mask wait+apply (us/token):", report["grammar_apply_us_per_token"]))
    if report.get("spec_drafts"):
        rows.append(("Draft verifications:", int(report["spec_drafts"])))
        rows.append(("Draft tokens (accepted):", _accepted(report)))
        rows.append(("Mean acceptance length:", report["spec_acceptance_length"]))
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    lines += [_row(label, value) for label, value in rows]
    for key, short, title in _SECTIONS:
        lines.append(f" {title} ".center(_WIDTH, "-"))
        stats = report[key]
        lines.append(_row(f"Mean {short} (ms):", stats["mean"]))
        lines.append(_row(f"Median {short} (ms):", stats["median"]))
        lines.append(_row(f"P99 {short} (ms):", stats["p99"]))
    if report.get("per_turn"):
        lines += _turn_lines(report)
    if report["errors"]:
        lines.append(" Failures ".center(_WIDTH, "-"))
        lines += [f"{count:>6} x {error}" for error, count in list(report["errors"].items())[:5]]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _turn_lines(report: dict) -> list[str]:
    """The multi-turn section: TTFT by turn, with each turn's prompt and cached share."""
    later = report["ttft_later_turns_ms"]
    lines = [" Multi-turn: TTFT by turn ".center(_WIDTH, "-")]
    lines.append(_row("Conversations x turns:", f"{report['conversations']} x {report['turns']}"))
    lines.append(_row("Mean TTFT, turns 2+ (ms):", later["mean"]))
    lines.append(_row("Median TTFT, turns 2+ (ms):", later["median"]))
    lines.append("turn  done  prompt tok  cached  mean TTFT ms  median")
    for turn in report["per_turn"]:
        cached = turn["cached_share"]
        ttft = turn["ttft_ms"]
        lines.append(
            f"{turn['turn']:>4}  {turn['completed']:>4}  {turn['mean_prompt_tokens'] or 0:>10.0f}"
            f"  {'-' if cached is None else f'{cached:.0%}':>6}  {ttft['mean'] or 0:>12.0f}"
            f"  {ttft['median'] or 0:>6.0f}"
        )
    return lines


def _accepted(report: dict) -> str:
    drafted, accepted = report["spec_draft_tokens"] or 0, report["spec_accepted_tokens"] or 0
    return f"{drafted:.0f} ({accepted:.0f}, {accepted / drafted:.0%})" if drafted else "0"


def _row(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text}"
