"""``compare.py --workload overhead``: what speculation costs where drafts rarely help.

Two nanoserve servers at the default dtype, one without and one with ``--speculative ngram``,
both up at once and each timed once its decode steps run compiled. In each of ``ROUNDS`` rounds
both run the same ``bench serve`` loads back to back, in turn (off first in odd rounds, ngram
first in even ones), at every ``--concurrency`` (default 32 and 1) on two datasets:

- ``shipped``: the bundled prompts (questions, chat) through the chat endpoint, unrelated to
  each other; the model's answers rarely repeat their prompt;
- ``random``: compare.py's throughput load, random token ids, 128 in and 128 out.

Each round sends other prompts (its own seed), the same to both servers. This machine's speed
drifts by 10 to 30% over minutes, so a pair of runs seconds apart is the comparison: the
verdicts are issue 47's bars on the median over the rounds of each pair's ratio (speculation's
output tokens per second over its absence's): concurrency 1 at most 3% slower and concurrency
32 at most 3% lower throughput.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from compare_servers import bench_serve, markdown_row, markdown_table, start_nanoserve

WAYS = ("off", "ngram")
ROUNDS = 5
DATASETS = ("shipped", "random")
BAR = 0.97  # speculation's output tok/s at least this share of its absence's

COLUMNS = (
    ("round", "round", "{}"),
    ("speculative", "speculative", "{}"),
    ("dataset", "dataset", "{}"),
    ("concurrency", "concurrency", "{}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("median TPOT ms", "tpot_median", "{:.1f}"),
    ("acceptance length", "spec_acceptance_length", "{:.2f}"),
    ("verifications", "spec_drafts", "{:.0f}"),
    ("failed", "failed", "{}"),
)


def bench_load(url: str, dataset: str, concurrency: int, seed: int, args, out: Path) -> dict:
    """One ``bench serve`` run of ``dataset`` at ``concurrency``; its report, flattened."""
    prompts = max(concurrency * args.waves, args.min_prompts)
    flags = ["--dataset", dataset, "--max-concurrency", str(concurrency)]
    flags += ["--num-prompts", str(prompts), "--num-warmups", "2", "--seed", str(seed)]
    flags += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    if dataset == "shipped":
        flags += ["--endpoint-type", "chat"]
    report = bench_serve(url, flags, out, args.timeout)
    if report is None:
        return {"failed": f"not done in {args.timeout:.0f} s"}
    report["tpot_median"] = report["tpot_ms"]["median"]
    return report


def overhead_rows(args, work: Path, logs: Path, settle=None) -> list[dict]:
    """Every run's row, round by round; ``settle(server)`` runs on each server before the
    first round (compare.py awaits its compiled decode steps)."""
    servers = {}
    try:
        for spec in WAYS:
            env = {"NANOSERVE_SPECULATIVE": spec}
            log_dir = logs / f"nanoserve-{spec}"
            servers[spec] = start_nanoserve("auto", log_dir, args.threads, False, env)
            if settle is not None:
                settle(servers[spec])
        rows = []
        for round_ in range(1, ROUNDS + 1):
            order = WAYS if round_ % 2 else WAYS[::-1]
            for dataset in DATASETS:
                for concurrency in args.concurrency:
                    for spec in order:
                        out = work / f"overhead-{round_}-{spec}-{dataset}-c{concurrency}.json"
                        url = servers[spec].url
                        report = bench_load(url, dataset, concurrency, round_, args, out)
                        row = {**report, "round": round_, "speculative": spec}
                        row.update(dataset=dataset, concurrency=concurrency)
                        rows.append(row)
                        print(markdown_row(row, COLUMNS), flush=True)
        return rows
    finally:
        for server in servers.values():
            server.stop()


def verdicts(rows: list[dict]) -> list[str]:
    """Issue 47's bars, for each dataset and concurrency: the median over the rounds of
    speculation's output tok/s over its absence's in the same round."""
    lines = []
    for dataset in DATASETS:
        for concurrency in sorted({r["concurrency"] for r in rows}, reverse=True):
            speed = {
                (r["round"], r["speculative"]): r["output_throughput"]
                for r in rows
                if (r["dataset"], r["concurrency"]) == (dataset, concurrency)
                and r.get("output_throughput")
            }
            rounds = sorted(
                {n for n, spec in speed if (n, "off") in speed and (n, "ngram") in speed}
            )
            if not rounds:
                lines.append(f"{dataset} c{concurrency}: not run both ways")
                continue
            ratios = [speed[(n, "ngram")] / speed[(n, "off")] for n in rounds]
            ratio = statistics.median(ratios)
            off = statistics.median(speed[(n, "off")] for n in rounds)
            on = statistics.median(speed[(n, "ngram")] for n in rounds)
            lines.append(
                f"{dataset} c{concurrency}: median of {len(rounds)} rounds' ratios {ratio:.3f}x "
                f"({'met' if ratio >= BAR else 'missed'}: bar {BAR}x); "
                f"{on:.1f} tok/s with speculation, {off:.1f} without (medians); "
                f"ratios {', '.join(f'{r:.2f}' for r in ratios)}"
            )
    return lines


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    return markdown_table(rows, COLUMNS)
