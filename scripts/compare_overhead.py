"""``compare.py --workload overhead``: what speculation costs where drafts rarely help.

Six nanoserve servers at the default dtype, one at a time, each timed once its decode steps
run compiled, in the order off, ngram, ngram, off,
off, ngram (so each way sees early and late phases of the machine's drift): each runs the same
``bench serve`` loads at every ``--concurrency`` (default 32 and 1), on two datasets:

- ``shipped``: the bundled prompts (questions, chat) through the chat endpoint, unrelated to
  each other; the model's answers rarely repeat their prompt;
- ``random``: compare.py's throughput load, random token ids, 128 in and 128 out.

The verdicts are issue 47's bars on medians of the three servers each way: with speculation,
concurrency 1 at most 3% slower and concurrency 32 at most 3% lower throughput (output tokens
per second, both) than without.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from compare_servers import start_nanoserve

ORDER = ("off", "ngram", "ngram", "off", "off", "ngram")
DATASETS = ("shipped", "random")
BAR = 0.97  # speculation's output tok/s at least this share of its absence's

COLUMNS = (
    ("server", "index", "{}"),
    ("speculative", "speculative", "{}"),
    ("dataset", "dataset", "{}"),
    ("concurrency", "concurrency", "{}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("median TPOT ms", "tpot_median", "{:.1f}"),
    ("acceptance length", "spec_acceptance_length", "{:.2f}"),
    ("verifications", "spec_drafts", "{:.0f}"),
    ("failed", "failed", "{}"),
)


def bench_load(url: str, dataset: str, concurrency: int, args, out: Path) -> dict:
    """One ``bench serve`` run of ``dataset`` at ``concurrency``; its report, flattened."""
    prompts = max(concurrency * args.waves, args.min_prompts)
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
    command += ["--dataset", dataset, "--max-concurrency", str(concurrency)]
    command += ["--num-prompts", str(prompts), "--num-warmups", "2"]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    if dataset == "shipped":
        command += ["--endpoint-type", "chat"]
    command += ["--json", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        try:
            subprocess.run(
                command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"failed": f"not done in {args.timeout:.0f} s"}
    report = json.loads(out.read_text())
    report["tpot_median"] = report["tpot_ms"]["median"]
    return report


def overhead_rows(args, work: Path, logs: Path, settle=None) -> list[dict]:
    """Every server's rows, in ``ORDER``; ``settle(server)`` runs on each before its benches
    (compare.py awaits its compiled decode steps)."""
    rows = []
    for index, spec in enumerate(ORDER, start=1):
        env = {"NANOSERVE_SPECULATIVE": spec}
        log_dir = logs / f"nanoserve-{spec}-{index}"
        server = start_nanoserve("auto", log_dir, args.threads, False, env)
        try:
            if settle is not None:
                settle(server)
            for dataset in DATASETS:
                for concurrency in args.concurrency:
                    out = work / f"overhead-{index}-{spec}-{dataset}-c{concurrency}.json"
                    report = bench_load(server.url, dataset, concurrency, args, out)
                    row = {**report, "index": index, "speculative": spec}
                    row.update(dataset=dataset, concurrency=concurrency)
                    rows.append(row)
                    print(row_line(row), flush=True)
        finally:
            server.stop()
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Issue 47's bars: medians of output tok/s with speculation against without, for each
    dataset and concurrency."""
    lines = []
    for dataset in DATASETS:
        for concurrency in sorted({r["concurrency"] for r in rows}, reverse=True):
            medians = {}
            for spec in ("off", "ngram"):
                values = [
                    r["output_throughput"]
                    for r in rows
                    if (r["dataset"], r["concurrency"], r["speculative"])
                    == (dataset, concurrency, spec)
                    and r.get("output_throughput") is not None
                ]
                medians[spec] = statistics.median(values) if values else None
            if None in medians.values():
                lines.append(f"{dataset} c{concurrency}: not run both ways")
                continue
            ratio = medians["ngram"] / medians["off"]
            lines.append(
                f"{dataset} c{concurrency}: {medians['ngram']:.1f} tok/s with speculation, "
                f"{medians['off']:.1f} without: {ratio:.3f}x "
                f"({'met' if ratio >= BAR else 'missed'}: bar {BAR}x)"
            )
    return lines


def row_line(row: dict) -> str:
    """One row as a Markdown table row of ``COLUMNS``."""
    cells = []
    for _, key, fmt in COLUMNS:
        value = row.get(key)
        cells.append("-" if value is None else fmt.format(value))
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    head = "| " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    return "\n".join([head, "|" + "---|" * len(COLUMNS), *(row_line(r) for r in rows)])
