"""The numbers ``nanoserve bench serve`` reports: one request's measurements, the run's
throughput, latency percentiles and goodput, and what it reads from a server's /metrics (the
worker's busy ratio, the scheduler's own work per step, the worker's resident memory).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What one request measured; times in seconds from the moment it was sent."""

    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None
    text: str = ""  # the generated text (a multi-turn run feeds it back)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent

    @property
    def success(self) -> bool:
        """A request succeeded when its stream completed without an error."""
        return self.error is None

    @property
    def tpot(self) -> float:
        """Time per output token after the first; 0 for a one-token answer (as vLLM)."""
        if self.output_len < 2 or self.ttft is None:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """Mean, median and p99 in milliseconds; None for each when there is nothing to measure."""
    if not seconds:
        return {"mean": None, "median": None, "p99": None}
    ms = [s * 1000.0 for s in seconds]
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p99": percentile(ms, 99)}


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """True when a successful request is within every SLO (milliseconds)."""
    if not result.success or result.ttft is None:
        return False
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    return all(measured[key] * 1000.0 <= limit for key, limit in slos.items())


def summarize(
    results: list[RequestResult], duration: float, slos: dict[str, float]
) -> dict[str, object]:
    """The run's metrics as a JSON-ready dict (the ``--json`` schema, less the run info)."""
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    good = sum(meets_slos(r, slos) for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in done if r.output_len > 1]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itl]),
        "e2el_ms": latency_stats([r.latency for r in done]),
        "errors": dict(Counter(r.error for r in results if r.error).most_common()),
    }


def samples(metrics_text: str) -> dict[str, float]:
    """Every sample of a Prometheus text, as {name with its labels: value} (comments dropped)."""
    found = {}
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def scrape_counter(metrics_text: str, fragment: str) -> tuple[str, float] | None:
    """The first Prometheus counter or gauge whose name contains ``fragment``, summed over its
    label sets, as (name, value); None when the server exposes no such metric."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(None, 1)[0]
        if fragment not in name or name.endswith("_created"):
            continue  # prometheus_client adds a *_created timestamp next to each counter
        value = line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1]
        totals[name] = totals.get(name, 0.0) + float(value)
    if not totals:
        return None
    name = next((n for n in totals if n.endswith("_total")), next(iter(totals)))
    return name, totals[name]


def worker_busy_seconds(metrics_text: str) -> tuple[str, float] | None:
    """The worker busy counter (a name containing ``worker_busy``), as ``scrape_counter``."""
    return scrape_counter(metrics_text, "worker_busy")


# What a scrape collects: the worker's busy seconds, the scheduler's own busy seconds (planning
# and applying, not waiting on the worker) and the steps it ran, for its work per iteration, the
# worker's resident memory, to show it flat over a run, and the frontend's and the scheduler's
# CPU seconds (every thread), for what serving costs outside the worker per token.
SCRAPED = (
    "worker_busy",
    "scheduler_busy",
    "num_steps",
    "worker_resident_memory",
    "grammar_masked_tokens",
    "grammar_mask_fill",
    "grammar_mask_apply",
    "frontend_cpu",
    "scheduler_cpu",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def acceptance(before: dict, after: dict) -> dict[str, float | None]:
    """Speculative decoding over the run: verifications, draft tokens and accepted ones, and
    the mean acceptance length (tokens a verification yields: accepted drafts plus its own);
    None without the metrics or drafts."""
    counts = {
        name: busy_delta(before.get(fragment), after.get(fragment))
        for name, fragment in (
            ("spec_drafts", "spec_decode_num_drafts"),
            ("spec_draft_tokens", "spec_decode_num_draft_tokens"),
            ("spec_accepted_tokens", "spec_decode_num_accepted_tokens"),
        )
    }
    drafts, accepted = counts["spec_drafts"], counts["spec_accepted_tokens"]
    length = None if not drafts or accepted is None else (accepted + drafts) / drafts
    return {**counts, "spec_acceptance_length": length}


def us_per_grammar_token(before: dict, after: dict, seconds: str) -> float | None:
    """Microseconds of a grammar-mask counter (``grammar_mask_fill`` or ``grammar_mask_apply``)
    per token sampled under a grammar over the run; None without the metrics or such tokens."""
    spent = busy_delta(before.get(seconds), after.get(seconds))
    tokens = busy_delta(before.get("grammar_masked_tokens"), after.get("grammar_masked_tokens"))
    return None if spent is None or not tokens else spent * 1e6 / tokens


def cpu_us_per_token(before: dict, after: dict, process: str, tokens: int) -> float | None:
    """Microseconds of CPU a process (``frontend_cpu`` or ``scheduler_cpu``) used per output
    token over the run; None without the metric or tokens."""
    spent = busy_delta(before.get(process), after.get(process))
    return None if spent is None or not tokens else spent * 1e6 / tokens


def mib(scraped: tuple[str, float] | None) -> float | None:
    """A scraped byte count in MiB; None when absent or not positive."""
    return None if scraped is None or scraped[1] <= 0 else scraped[1] / 2**20


def scheduler_ms_per_step(before: dict, after: dict) -> float | None:
    """The scheduler's own milliseconds per step over the run; None without both metrics."""
    busy = busy_delta(before.get("scheduler_busy"), after.get("scheduler_busy"))
    steps = busy_delta(before.get("num_steps"), after.get("num_steps"))
    return None if busy is None or not steps else busy * 1000.0 / steps


def busy_delta(before: tuple[str, float] | None, after: tuple[str, float] | None) -> float | None:
    """Worker busy seconds gained between two scrapes of the same counter."""
    if before is None or after is None or before[0] != after[0]:
        return None
    return after[1] - before[1]


def busy_ratio(
    before: tuple[str, float] | None, after: tuple[str, float] | None, wall: float
) -> float | None:
    """Worker busy seconds gained over the run, per second of wall time."""
    delta = busy_delta(before, after)
    return None if delta is None or wall <= 0 else delta / wall
