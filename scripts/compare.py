"""The side-by-side benchmark: nanoserve against llama.cpp's server and transformers' static
batching, on the same model file and the same work, printed as one table.

    python scripts/compare.py                          # nanoserve, float32 and bfloat16
    python scripts/compare.py --with-llamacpp --with-transformers
    python scripts/compare.py --dtypes bfloat16 --compile     # also with small steps compiled
    python scripts/compare.py --workload multi-turn --with-llamacpp  # chat histories
    python scripts/compare.py --as-readme --runs 3 --noisy-neighbour 1 --with-llamacpp

``--as-readme`` starts nanoserve exactly as the README does (``make serve`` in this checkout: no
flags, the committed ``.env``, port 8000) and prints, for each start, the seconds until
/health answers, until the first chat reply, and until the worker's decode steps run compiled
(read from /metrics, the compiled path engages without a restart); then the same load, and
with ``--noisy-neighbour N`` the same load again beside N busy loops at nice 19
(``scripts/noisy_neighbour.py``), and with ``--with-llamacpp`` a start of llama-server right
after each of nanoserve's start is timed, benched the same way (a run's pair shares the
machine's phase). Both stay up while concurrency 1 runs on them in ``--c1-rounds`` alternating
rounds, since a concurrency-1 run lasts only seconds; nanoserve's noisy-neighbour runs follow,
then llama-server's (first run only). Every
server and every loop runs in a session of its own, as if each were started from its own
terminal; the loops' sessions are at nice 19 too, since Linux's autogroup counts a nice value
only inside its session. ``--equal-share`` adds, for the first start of each server, a run
beside loops whose session is at nice 0: what a nice'd job from another terminal gets, one core
of two.

Every server runs the same ``nanoserve bench serve`` load (128 prompt tokens, 128 output tokens
with ignore_eos, greedy, streaming) at each ``--concurrency``, one server at a time. llama.cpp's
``llama-server`` is built from the llama-cpp-python sdist on PyPI the first time it is asked for
(7 minutes on two busy cores; kept in ``--llama-cache``), or taken from ``--llama-server``.

``--workload repetitive`` runs concurrency 1 on ``bench serve --dataset repetitive``, nanoserve
without and with ``--speculative ngram`` and llama-server without drafts and with each
``--llama-spec-types`` n-gram kind, over ``--runs`` starts (``scripts/compare_repetitive.py``).

``--workload overhead`` benches unrelated prompts (the shipped set, chat, and random ids) at
each ``--concurrency`` on nanoserve without and with ``--speculative ngram``, both up at once,
in alternating rounds (``scripts/compare_overhead.py``).

``--workload multi-turn`` runs ``bench serve --dataset multi-turn`` instead (conversations that
resend their whole history each turn, a shared system prompt, the server's replies fed back),
against nanoserve with prefix caching on and off and against llama-server with its default
prompt cache, and prints TTFT for turns 2 and later.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import compare_overhead  # noqa: E402 - after the path setup above
import compare_repetitive  # noqa: E402
import noisy_neighbour  # noqa: E402
from compare_servers import (  # noqa: E402
    bench_serve,
    build_llama_server,
    markdown_table,
    start_as_readme,
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
    # CPU a token outside the worker: the frontend's and the scheduler's processes.
    ("frontend CPU us/tok", "frontend_cpu_us_per_token", "{:.0f}"),
    ("sched. CPU us/tok", "scheduler_cpu_us_per_token", "{:.0f}"),
    ("worker RSS MiB start", "worker_rss_mib_start", "{:.0f}"),
    ("end", "worker_rss_mib_end", "{:.0f}"),
    ("failed", "failed", "{}"),
)


START_COLUMNS = (
    ("start", "start", "{}"),
    ("/health s", "health_s", "{:.1f}"),
    ("first reply s", "first_reply_s", "{:.1f}"),
    ("compiled s", "compiled_s", "{:.1f}"),
    ("decode path", "decode_path", "{}"),
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


def _llama_server(
    args: argparse.Namespace, logs: Path, slot_context: int = 512, extra: tuple[str, ...] = ()
):
    from models.files import resolve_model

    binary, built_s = args.llama_server, 0.0
    if binary is None:
        binary, built_s = build_llama_server(args.llama_cache)
    if built_s:
        print(f"built llama-server in {built_s:.0f} s", flush=True)
    gguf = resolve_model(None).source
    threads = os.cpu_count() or 1
    return start_llama_server(
        binary, gguf, logs / "llama.cpp", args.llama_slots, threads, slot_context, extra
    )


DECODE_PATH = re.compile(r'worker_decode_path\{[^}]*="(\w+)"\} 1\.0')


def decode_path(url: str) -> str:
    """What the worker's decode steps run on, as /metrics says ("unknown" before a step)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        found = DECODE_PATH.search(response.read().decode())
    return found.group(1) if found else "unknown"


def chat(url: str, max_tokens: int = 8) -> None:
    """One short chat completion, as a user's first message."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens}
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        json.loads(response.read())


def await_decode_path(server, wait: float) -> str:
    """The worker's decode path once it is final (compiled, eager, graphs or failed; a
    compiled worker first serves eagerly while its graphs load): a short request every 2 s
    keeps steps, and so the worker's report, coming. At most ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while (path := decode_path(server.url)) not in ("compiled", "failed", "eager", "graphs"):
        if time.monotonic() > deadline:
            break
        chat(server.url, max_tokens=2)
        time.sleep(2)
    return path


def time_readme_start(server, label: str, compile_wait: float) -> dict:
    """Seconds from ``make serve`` to /health, to the first chat reply, and to compiled decode
    steps (a short request every 2 s keeps steps, and so the worker's report, coming)."""
    began = time.monotonic()
    row = {"start": label}
    deadline = began + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if any(p.poll() is not None for p in server.processes):
            raise RuntimeError(f"make serve exited; see {server.log_dir}")
        time.sleep(0.1)
    row["health_s"] = time.monotonic() - began
    chat(server.url)
    row["first_reply_s"] = time.monotonic() - began
    row["decode_path"] = path = await_decode_path(server, compile_wait)
    if path == "compiled":
        row["compiled_s"] = time.monotonic() - began
    print(format_table([row], START_COLUMNS), flush=True)
    return row


def bench_noisy(
    name: str, label: str, server, args, work: Path, session_nice: int = 19
) -> list[dict]:
    """``bench_all`` beside ``args.noisy_neighbour`` busy loops at nice 19, their sessions at
    ``session_nice``, ended by PID."""
    children = noisy_neighbour.start(args.noisy_neighbour, 19, session_nice)
    suffix = "+ noise" if session_nice == 19 else "+ equal-share noise"
    try:
        # Other prompts than the quiet run's: the same ones would be prefix-cache hits (nanoserve
        # and llama.cpp's slots alike), and the noisy run would skip most of its prefill. Seed 2
        # for the equal-share run, after the nice-19 run's seed 1.
        seed = 1 if session_nice == 19 else 2
        return bench_all(name, f"{label} {suffix}", server, args, work, seed=seed)
    finally:
        noisy_neighbour.stop(children)


def readme_rows(args: argparse.Namespace, work: Path, logs: Path) -> tuple[list, list]:
    """``--runs`` starts of the README's server, each timed and benched (and again beside the
    noisy neighbour), each followed at once by a start of llama-server benched the same way;
    with ``--c1-rounds``, both up for concurrency 1 (``paired_c1``).

    A run's two servers go back to back because their bars compare them run by run, and this
    machine's speed drifts by tens of percent over minutes (docs/performance.md): all of
    nanoserve's starts and then all of llama-server's would compare phases, not servers.
    """
    rows, starts = [], []
    if args.with_llamacpp and args.llama_server is None:  # built before anything is timed
        args.llama_server, built_s = build_llama_server(args.llama_cache)
        print(f"built llama-server in {built_s:.0f} s", flush=True)
    paired = args.with_llamacpp and args.c1_rounds > 0 and 1 in args.concurrency
    alone = [c for c in args.concurrency if not (paired and c == 1)]
    for run in range(1, args.runs + 1):
        server, llama = start_as_readme(logs / f"readme-{run}"), None
        try:
            starts.append(time_readme_start(server, f"run {run}", args.compile_wait))
            rows += bench_all("nanoserve", f"README run {run}", server, args, work, alone)
            if paired:  # llama-server started after nanoserve's start is timed
                llama = _llama_server(args, logs)
                rows += bench_all("llama.cpp", f"run {run}", llama, args, work, alone)
                rows += paired_c1(server, llama, run, args, work)
            if args.noisy_neighbour:
                rows += bench_noisy("nanoserve", f"README run {run}", server, args, work)
                if args.equal_share and run == 1:
                    rows += bench_noisy("nanoserve", "README run 1", server, args, work, 0)
        except BaseException:
            if llama is not None:
                llama.stop()
            raise
        finally:
            server.stop()
        if args.with_llamacpp:
            rows += llama_run(args, work, logs, run, llama)
    if args.with_transformers:
        rows += transformers_rows(args)
    return starts, rows


def llama_run(
    args: argparse.Namespace, work: Path, logs: Path, run: int, server=None
) -> list[dict]:
    """One start of llama-server, benched quiet (and, in the first run, beside the noisy
    neighbour), then ended; ``server``: one already started and benched quiet (paired with
    nanoserve's start), benched only beside the neighbour."""
    rows = []
    quiet = server is None
    if quiet:
        server = _llama_server(args, logs)
    try:
        if quiet:
            rows += bench_all("llama.cpp", f"run {run}", server, args, work)
        if args.noisy_neighbour and run == 1:  # once: it may collapse (--timeout)
            rows += bench_noisy("llama.cpp", f"run {run}", server, args, work)
            if args.equal_share:
                rows += bench_noisy("llama.cpp", "run 1", server, args, work, 0)
    finally:
        server.stop()
    return rows


def readme_verdicts(rows: list[dict]) -> list[str]:
    """Issue 16's bars, run by run: concurrency 32 against transformers, llama.cpp and 600
    tok/s; concurrency 1 against llama.cpp's ITL and 100 ms TTFT; the noisy neighbour's cost."""

    def find(server: str, label: str, concurrency: int) -> dict | None:
        for row in rows:
            if (row.get("server"), row.get("dtype"), row.get("concurrency")) == (
                server,
                label,
                concurrency,
            ) and "output_throughput" in row:
                return row
        return None

    def rounds(row: dict) -> str:  # paired_c1's rounds, in the order they ran
        if not row.get("itl_rounds"):
            return ""
        return " (rounds " + " / ".join(f"{itl:.1f}" for itl in row["itl_rounds"]) + ")"

    hf = next((r for r in rows if r.get("server", "").startswith("transformers")), None)
    lines, run = [], 1
    while (c32 := find("nanoserve", f"README run {run}", 32)) is not None:
        c1 = find("nanoserve", f"README run {run}", 1)
        llama32 = find("llama.cpp", f"run {run}", 32)
        llama1 = find("llama.cpp", f"run {run}", 1)
        tok = c32["output_throughput"]
        parts = [f"run {run}: c32 {tok:.1f} tok/s (bar 600)"]
        if hf:
            parts.append(f"{tok / hf['output_throughput']:.2f}x transformers (bar 2x)")
        if llama32:
            parts.append(f"{tok / llama32['output_throughput']:.2f}x llama.cpp (bar 4x)")
        if c1:
            parts.append(f"c1 ITL {c1['itl_median']:.1f} ms{rounds(c1)}")
            if llama1:
                parts.append(f"llama.cpp {llama1['itl_median']:.1f} ms{rounds(llama1)}")
            parts.append(f"c1 TTFT {c1['ttft_median']:.0f} ms (bar 100)")
        noisy32 = find("nanoserve", f"README run {run} + noise", 32)
        noisy1 = find("nanoserve", f"README run {run} + noise", 1)
        if noisy32:
            parts.append(f"noisy c32 {noisy32['output_throughput'] / tok:.0%} of quiet (bar 50%)")
        if noisy1 and c1:
            parts.append(f"noisy c1 ITL {noisy1['itl_median'] / c1['itl_median']:.2f}x (bar 2x)")
        equal32 = find("nanoserve", f"README run {run} + equal-share noise", 32)
        if equal32:
            parts.append(f"equal-share c32 {equal32['output_throughput'] / tok:.0%} of quiet")
        lines.append("; ".join(parts))
        run += 1
    return lines


def paired_c1(nanoserve, llama, run: int, args: argparse.Namespace, work: Path) -> list[dict]:
    """Concurrency 1 on both servers, both up, in ``args.c1_rounds`` rounds that alternate
    between them (nanoserve first in even rounds, llama-server in odd ones); a round's prompts
    are new to both (seed 10 + round). A row per server, its medians the median of its rounds'.

    A concurrency-1 run lasts seconds, and this machine's speed drifts by tens of percent over
    minutes (docs/performance.md): one run on each server, a minute or two apart, compared the
    machine's phases as often as the servers."""
    servers = (("nanoserve", f"README run {run}", nanoserve), ("llama.cpp", f"run {run}", llama))
    reports: dict[str, list[dict]] = {name: [] for name, _, _ in servers}
    for round_ in range(args.c1_rounds):
        for name, label, server in servers if round_ % 2 == 0 else servers[::-1]:
            out = work / f"{name}-{label}-c1-round{round_}.json".replace(" ", "_")
            reports[name].append(bench(server.url, 1, args, out, seed=10 + round_))
    rows = []
    for name, label, _ in servers:
        row = {**merge_rounds(reports[name]), "server": name, "dtype": label, "concurrency": 1}
        rows.append(row)
        print(format_table(rows[-1:]), flush=True)
    return rows


MEDIAN_KEYS = (
    "output_throughput",
    "ttft_median",
    "itl_median",
    "tpot_median",
    "worker_busy_ratio",
    "scheduler_ms_per_step",
    "frontend_cpu_us_per_token",
    "scheduler_cpu_us_per_token",
)


def merge_rounds(reports: list[dict]) -> dict:
    """One row from rounds of the same load on one server: the median of each round's median
    (and throughput), the largest p99, RSS at the first round's start and the last one's end,
    and every round's ITL and TTFT medians; a failed round fails the row."""
    # bench's own failure is a sentence; a finished run's report counts failed requests.
    failed = [report["failed"] for report in reports if isinstance(report.get("failed"), str)]
    if failed:
        return {"failed": failed[0]}
    merged = dict(reports[0])
    for key in MEDIAN_KEYS:
        values = [report[key] for report in reports if report.get(key) is not None]
        merged[key] = statistics.median(values) if values else None
    merged["itl_p99"] = max(report["itl_p99"] for report in reports)
    merged["failed"] = sum(report.get("failed", 0) for report in reports)
    merged["worker_rss_mib_end"] = reports[-1].get("worker_rss_mib_end")
    merged["itl_rounds"] = [report["itl_median"] for report in reports]
    merged["ttft_rounds"] = [report["ttft_median"] for report in reports]
    return merged


def bench_all(
    name: str, label: str, server, args, work: Path, concurrencies=None, seed: int = 0
) -> list[dict]:
    """Bench a started server at every concurrency (it keeps running): ``concurrencies``, else
    ``args.concurrency``."""
    rows = []
    for concurrency in args.concurrency if concurrencies is None else concurrencies:
        out = work / f"{name}-{label}-c{concurrency}.json".replace(" ", "_").replace("+", "")
        report = bench(server.url, concurrency, args, out, seed)
        rows.append({**report, "server": name, "dtype": label, "concurrency": concurrency})
        print(format_table(rows[-1:]), flush=True)
    return rows


def bench(url: str, concurrency: int, args: argparse.Namespace, out: Path, seed: int = 0) -> dict:
    """One ``nanoserve bench serve`` run; its JSON report, flattened for the table. Runs on one
    server with the same ``seed`` send the same prompts: the later ones find them cached."""
    prompts = max(concurrency * args.waves, args.min_prompts)
    flags = ["--max-concurrency", str(concurrency), "--num-prompts", str(prompts)]
    flags += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    flags += ["--num-warmups", "2", "--seed", str(seed)]
    report = bench_serve(url, flags, out, args.timeout)
    if report is None:
        return {"failed": f"not done in {args.timeout:.0f} s"}
    for key in ("ttft", "itl", "tpot"):
        report[f"{key}_median"] = report[f"{key}_ms"]["median"]
        report[f"{key}_p99"] = report[f"{key}_ms"]["p99"]
    return report


def run_server(name, dtype, server, args, work: Path) -> list[dict]:
    """Bench a started server at every concurrency, then stop it."""
    try:
        return bench_all(name, dtype, server, args, work)
    finally:
        server.stop()


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
    return markdown_table(rows, columns)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        choices=("throughput", "multi-turn", "repetitive", "overhead"),
        default="throughput",
        help="throughput: random prompts at --concurrency; multi-turn: chat conversations; "
        "repetitive: concurrency 1, speculative decoding on and off (and llama.cpp's n-grams); "
        "overhead: speculation on and off on unrelated prompts, in alternating rounds",
    )
    parser.add_argument(
        "--llama-spec-types",
        default=compare_repetitive.LLAMA_SPEC_TYPES,
        type=lambda s: s.split(","),
        help="repetitive: llama-server's --spec-type kinds to run beside its plain run",
    )
    parser.add_argument("--conversations", type=int, default=8, help="multi-turn, at once")
    parser.add_argument("--turns", type=int, default=6, help="multi-turn: turns each")
    parser.add_argument(
        "--system-len", type=int, default=950, help="multi-turn: words (~1,000 tokens)"
    )
    parser.add_argument("--turn-len", type=int, default=38, help="multi-turn: user words")
    parser.add_argument("--reply-len", type=int, default=64, help="multi-turn: reply tokens")
    parser.add_argument(
        "--as-readme", action="store_true", help="nanoserve as the README starts it (make serve)"
    )
    parser.add_argument("--runs", type=int, default=1, help="--as-readme: starts, back to back")
    parser.add_argument(
        "--noisy-neighbour", type=int, default=0, help="also bench beside N busy loops (nice 19)"
    )
    parser.add_argument(
        "--equal-share",
        action="store_true",
        help="--noisy-neighbour: also once beside loops whose session is at nice 0",
    )
    parser.add_argument(
        "--compile-wait", type=float, default=900, help="--as-readme: seconds to await compiled"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one bench run may take")
    parser.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    parser.add_argument(
        "--concurrency", default="32,1", type=lambda s: [int(c) for c in s.split(",")]
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="prompts per concurrent client")
    parser.add_argument(
        "--min-prompts",
        type=int,
        default=None,
        help="prompts a run sends at least (default 8; repetitive 32, overhead 16: one "
        "repetitive prompt's accepted share of tokens ranges from 6%% to 79%%)",
    )
    parser.add_argument("--threads", type=int, default=None, help="worker threads (nanoserve)")
    parser.add_argument(
        "--compile", action="store_true", help="also bench nanoserve with --compile, each dtype"
    )
    parser.add_argument("--with-llamacpp", action="store_true", help="also bench llama-server")
    parser.add_argument(
        "--speculative",
        choices=("off", "ngram"),
        default="off",
        help="throughput: nanoserve's --speculative (its rows' dtype reads '+ ngram')",
    )
    parser.add_argument(
        "--c1-rounds",
        type=int,
        default=3,
        help="--as-readme --with-llamacpp: concurrency 1 on both servers, both up, in this many "
        "alternating rounds (0: one run each, as part of each server's own runs)",
    )
    parser.add_argument("--llama-server", type=Path, help="a built llama-server binary")
    parser.add_argument(
        "--llama-cache", type=Path, default=Path.home() / ".cache" / "nanoserve" / "llama.cpp"
    )
    parser.add_argument("--llama-slots", type=int, default=8)
    parser.add_argument("--with-transformers", action="store_true", help="static batching too")
    parser.add_argument("--skip-nanoserve", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: tmp)")
    parser.add_argument("--json", type=Path, help="write every row as JSON here")
    args = parser.parse_args()
    if args.min_prompts is None:
        args.min_prompts = {"repetitive": 32, "overhead": 16}.get(args.workload, 8)
    return args


def _settle(args):
    """What a speculation workload does to a started nanoserve before it is timed: await its
    final decode path, so that both ways are timed in their steady state, not partly while
    one of them still loads its compiled graphs (9 to 17 s here, in the background)."""

    def settle(server) -> None:
        path = await_decode_path(server, args.compile_wait)
        print(f"{server.name}: decode steps run {path}", flush=True)

    return settle


def _report(args, rows: list[dict], table: str, verdicts: list[str]) -> int:
    """Print a speculation workload's table and verdicts; its rows to ``--json``."""
    print()
    print(table)
    print("\n".join(verdicts))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="nanoserve-compare-"))
    logs = args.log_dir or work / "logs"
    if args.workload == "overhead":
        rows = compare_overhead.overhead_rows(args, work, logs, _settle(args))
        return _report(args, rows, compare_overhead.table(rows), compare_overhead.verdicts(rows))
    if args.workload == "repetitive":
        if args.with_llamacpp and args.llama_server is None:  # built before anything is timed
            args.llama_server, _ = build_llama_server(args.llama_cache)
        rows = compare_repetitive.repetitive_rows(
            args,
            work,
            logs,
            lambda args, logs, extra: _llama_server(args, logs, slot_context=2048, extra=extra),
            _settle(args),
        )
        table = compare_repetitive.table(rows)
        return _report(args, rows, table, compare_repetitive.verdicts(rows))
    if args.workload == "multi-turn":
        rows = multi_turn_rows(args, work, logs)
        print()
        print(format_table(rows, MULTI_TURN_COLUMNS))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    if args.as_readme:
        starts, rows = readme_rows(args, work, logs)
        print()
        print(format_table(starts, START_COLUMNS))
        print()
        print(format_table(rows))
        print()
        print("\n".join(readme_verdicts(rows)))
        if args.json:
            args.json.write_text(json.dumps({"starts": starts, "rows": rows}, indent=2) + "\n")
        return 0
    rows: list[dict] = []
    if not args.skip_nanoserve:
        for dtype in args.dtypes:
            for compile in (False, True) if args.compile else (False,):
                label = f"{dtype} compiled" if compile else dtype
                if args.speculative != "off":
                    label += f" + {args.speculative}"
                log_dir = logs / f"nanoserve-{label}".replace(" ", "-").replace("+", "")
                env = {"NANOSERVE_SPECULATIVE": args.speculative}
                server = start_nanoserve(dtype, log_dir, args.threads, compile, env)
                rows += run_server("nanoserve", label, server, args, work)
    if args.with_llamacpp:
        from models.files import resolve_model

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
