"""scripts/compare.py: its table, its flags and its process launcher (no model, no servers)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare = _load("compare")
servers = _load("compare_servers")


def test_table_has_one_line_per_row_and_dashes_for_missing_cells():
    rows = [
        {
            "server": "nanoserve",
            "dtype": "bfloat16",
            "concurrency": 32,
            "output_throughput": 812.345,
            "ttft_median": 95.4,
            "itl_median": 31.25,
            "itl_p99": 60.0,
            "tpot_median": 33.0,
            "worker_busy_ratio": 0.973,
            "scheduler_ms_per_step": 0.4567,
            "frontend_cpu_us_per_token": 412.6,
            "scheduler_cpu_us_per_token": 388.2,
            "worker_rss_mib_start": 700.4,
            "worker_rss_mib_end": 701.6,
            "failed": 0,
        },
        {"server": "transformers static b32", "dtype": "float32", "output_throughput": 164.0},
    ]
    lines = compare.format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| nanoserve | bfloat16 | 32 | 812.3 | 95 | 31.2 | 60.0 | 33.0 | 97% | 0.46 | 413 | 388 "
        "| 700 | 702 | 0 |"
    )
    assert lines[3] == (
        "| transformers static b32 | float32 | - | 164.0 | - | - | - | - | - | - | - | - | - | - "
        "| - |"
    )


def test_help_names_the_peers():
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "compare.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "--with-llamacpp" in done.stdout and "--with-transformers" in done.stdout


def test_wait_ready_raises_when_a_process_exits(tmp_path):
    server = servers.Server("dies", servers.free_port(), tmp_path / "logs")
    server.spawn("quitter", [sys.executable, "-c", "raise SystemExit(3)"], {})
    try:
        with pytest.raises(RuntimeError, match="a process exited"):
            server.wait_ready("/health", timeout=30)
    finally:
        server.stop(timeout=5)
    assert server.processes[0].returncode == 3


class _Stub:
    """A started server that records its stop."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name = self.url = name
        self.events = events

    def stop(self) -> None:
        self.events.append(f"stop {self.name}")


def _readme_rows(monkeypatch, tmp_path, *flags: str) -> tuple[list[str], list[dict]]:
    """``readme_rows`` for two runs with stub servers; every start, bench and stop in order."""
    events: list[str] = []
    starts, llamas = iter(range(1, 10)), iter(range(1, 10))
    monkeypatch.setattr(
        compare, "start_as_readme", lambda log_dir: _Stub(f"nano{next(starts)}", events)
    )
    monkeypatch.setattr(
        compare, "_llama_server", lambda args, logs: _Stub(f"llama{next(llamas)}", events)
    )
    monkeypatch.setattr(compare, "time_readme_start", lambda server, label, wait: {})

    def bench_all(name, label, server, args, work, concurrencies=None, seed=0):
        for concurrency in args.concurrency if concurrencies is None else concurrencies:
            events.append(f"c{concurrency} {server.name}")
        return [{"server": name, "dtype": label}]

    def bench(url, concurrency, args, out, seed=0):
        events.append(f"c{concurrency} {url} seed {seed}")
        return {"itl_median": float(seed), "ttft_median": 1.0, "itl_p99": 2.0, "failed": 0}

    monkeypatch.setattr(compare, "bench_all", bench_all)
    monkeypatch.setattr(compare, "bench", bench)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--as-readme", "--runs", "2", *flags])
    args = compare.parse_args()
    args.with_llamacpp, args.llama_server = True, Path("/nonexistent/llama-server")
    _, rows = compare.readme_rows(args, tmp_path, tmp_path)
    return events, rows


def test_each_readme_start_is_followed_by_its_llama_server_start(monkeypatch, tmp_path):
    """The bars compare the servers run by run, so run N of llama-server must come right after
    run N of nanoserve, not after all of nanoserve's runs (the machine's speed drifts); and
    concurrency 1 alternates between the two, both up, each round on prompts new to both."""
    events, rows = _readme_rows(monkeypatch, tmp_path)
    run = [
        "c32 nano{n}",
        "c32 llama{n}",
        "c1 nano{n} seed 10",
        "c1 llama{n} seed 10",
        "c1 llama{n} seed 11",
        "c1 nano{n} seed 11",
        "c1 nano{n} seed 12",
        "c1 llama{n} seed 12",
        "stop nano{n}",
        "stop llama{n}",
    ]
    assert events == [event.format(n=n) for n in (1, 2) for event in run]
    c1 = [row for row in rows if row.get("concurrency") == 1]
    assert [(row["server"], row["dtype"]) for row in c1] == [
        ("nanoserve", "README run 1"),
        ("llama.cpp", "run 1"),
        ("nanoserve", "README run 2"),
        ("llama.cpp", "run 2"),
    ]
    assert c1[0]["itl_rounds"] == [10.0, 11.0, 12.0] and c1[0]["itl_median"] == 11.0


def test_without_rounds_each_server_runs_its_own_c1(monkeypatch, tmp_path):
    events, rows = _readme_rows(monkeypatch, tmp_path, "--c1-rounds", "0")
    run = ["c32 nano{n}", "c1 nano{n}", "stop nano{n}", "c32 llama{n}", "c1 llama{n}"]
    run.append("stop llama{n}")
    assert events == [event.format(n=n) for n in (1, 2) for event in run]
    assert len(rows) == 4


def test_rounds_merge_into_medians_and_a_failed_round_fails_the_row():
    rounds = [
        {"itl_median": 7.0, "ttft_median": 50.0, "itl_p99": 12.0, "output_throughput": 140.0},
        {"itl_median": 5.0, "ttft_median": 70.0, "itl_p99": 30.0, "output_throughput": 180.0},
        {"itl_median": 6.0, "ttft_median": 60.0, "itl_p99": 14.0, "output_throughput": 160.0},
    ]
    for report in rounds:
        report["failed"] = 0  # a finished run counts its failed requests
    merged = compare.merge_rounds(rounds)
    assert (merged["itl_median"], merged["ttft_median"]) == (6.0, 60.0)
    assert (merged["itl_p99"], merged["output_throughput"], merged["failed"]) == (30.0, 160.0, 0)
    assert merged["itl_rounds"] == [7.0, 5.0, 6.0]
    assert compare.merge_rounds([*rounds, {"failed": "not done in 240 s"}]) == {
        "failed": "not done in 240 s"
    }


def test_repetitive_runs_each_server_with_and_without_drafts(monkeypatch, tmp_path):
    """Per start: nanoserve without and with --speculative ngram, then llama-server plain and
    with each n-gram --spec-type; the verdicts hold each start to the 0.6x and llama.cpp bars."""
    repetitive = _load("compare_repetitive")
    events = []

    def nanoserve(dtype, log_dir, threads, compile, env):
        events.append(f"nanoserve {dtype} {env['NANOSERVE_SPECULATIVE']}")
        return _Stub(f"nano-{env['NANOSERVE_SPECULATIVE']}", events)

    def llama(args, logs, extra):
        events.append(f"llama {' '.join(extra) or 'plain'}")
        return _Stub(f"llama-{extra[-1] if extra else 'off'}", events)

    itl = {"nano-off": 10.0, "nano-ngram": 5.0, "llama-off": 9.0}
    itl |= {"llama-ngram-simple": 6.0, "llama-ngram-mod": 4.0}

    def bench(url, args, out):
        events.append(f"bench {url}")
        length = 3.2 if url == "nano-ngram" else None
        return {"itl_median": itl[url], "spec_acceptance_length": length}

    monkeypatch.setattr(repetitive, "start_nanoserve", nanoserve)
    monkeypatch.setattr(repetitive, "bench_repetitive", bench)
    argv = ["compare.py", "--workload", "repetitive", "--runs", "2", "--with-llamacpp"]
    argv += ["--llama-spec-types", "ngram-simple,ngram-mod"]
    monkeypatch.setattr(sys, "argv", argv)
    args = compare.parse_args()
    rows = repetitive.repetitive_rows(
        args, tmp_path, tmp_path, llama, lambda server: events.append(f"settle {server.url}")
    )
    one = [
        "nanoserve auto off",
        "settle nano-off",
        "bench nano-off",
        "stop nano-off",
        "nanoserve auto ngram",
        "settle nano-ngram",
        "bench nano-ngram",
        "stop nano-ngram",
        "llama plain",
        "bench llama-off",
        "stop llama-off",
        "llama --spec-type ngram-simple",
        "bench llama-ngram-simple",
        "stop llama-ngram-simple",
        "llama --spec-type ngram-mod",
        "bench llama-ngram-mod",
        "stop llama-ngram-mod",
    ]
    assert events == one + one
    assert [row["run"] for row in rows] == [1] * 5 + [2] * 5
    (first, _) = repetitive.verdicts(rows)
    assert "0.50x without (met: bar 0.6x)" in first
    assert "acceptance length 3.20" in first
    assert "llama.cpp's best ngram-mod 4.0 ms (missed)" in first
    assert "| 1 | nanoserve | ngram | 5.0 |" in repetitive.table(rows)


def test_overhead_alternates_both_servers_round_by_round_and_holds_paired_ratios_to_the_bar(
    monkeypatch, tmp_path
):
    """Both servers up and settled first; each round benches every load on both, back to back,
    off first in odd rounds; the verdicts take the median of each round's ratio."""
    overhead = _load("compare_overhead")
    monkeypatch.setattr(overhead, "ROUNDS", 3)
    events = []

    def nanoserve(dtype, log_dir, threads, compile, env):
        events.append(f"start {env['NANOSERVE_SPECULATIVE']}")
        return _Stub(env["NANOSERVE_SPECULATIVE"], events)

    # tok/s by (speculation, dataset, concurrency), round by round
    speeds = {
        ("off", "shipped", 32): [100.0, 90.0, 120.0],
        ("ngram", "shipped", 32): [98.0, 99.0, 60.0],  # ratios 0.98, 1.10, 0.50
        ("off", "shipped", 1): [200.0, 210.0, 150.0],
        ("ngram", "shipped", 1): [190.0, 300.0, 100.0],  # ratios 0.95, 1.43, 0.67
    }
    speeds |= {("off", "random", c): [50.0] * 3 for c in (32, 1)}
    speeds |= {("ngram", "random", c): [60.0] * 3 for c in (32, 1)}
    seeds = []

    def bench(url, dataset, concurrency, seed, args, out):
        events.append(f"bench {url} {dataset} c{concurrency}")
        seeds.append(seed)
        return {"output_throughput": speeds[(url, dataset, concurrency)].pop(0)}

    monkeypatch.setattr(overhead, "start_nanoserve", nanoserve)
    monkeypatch.setattr(overhead, "bench_load", bench)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--workload", "overhead"])
    settle = lambda server: events.append(f"settle {server.url}")  # noqa: E731
    rows = overhead.overhead_rows(compare.parse_args(), tmp_path, tmp_path, settle)
    assert events[:4] == ["start off", "settle off", "start ngram", "settle ngram"]
    assert events[4:6] == ["bench off shipped c32", "bench ngram shipped c32"]
    assert events[12:14] == ["bench ngram shipped c32", "bench off shipped c32"]  # round 2
    assert events[-2:] == ["stop off", "stop ngram"]
    assert seeds == [1] * 8 + [2] * 8 + [3] * 8  # each round its own prompts, both the same
    assert len(rows) == 3 * 8
    lines = overhead.verdicts(rows)
    assert lines[0].startswith("shipped c32: median of 3 rounds' ratios 0.980x (met: bar 0.97x)")
    assert lines[0].endswith("ratios 0.98, 1.10, 0.50")
    assert lines[1].startswith("shipped c1: median of 3 rounds' ratios 0.950x (missed")
    assert "1.200x (met" in lines[2]
    assert "| 1 | off | shipped | 32 | 100.0 |" in overhead.table(rows)


@pytest.mark.parametrize(
    ("workload", "prompts"), [("throughput", 8), ("repetitive", 32), ("overhead", 16)]
)
def test_each_workload_sends_its_own_least_number_of_prompts(monkeypatch, workload, prompts):
    monkeypatch.setattr(sys, "argv", ["compare.py", "--workload", workload])
    assert compare.parse_args().min_prompts == prompts
    monkeypatch.setattr(sys, "argv", ["compare.py", "--workload", workload, "--min-prompts", "4"])
    assert compare.parse_args().min_prompts == 4


def test_a_bench_run_passes_its_flags_and_says_when_it_timed_out(monkeypatch, tmp_path):
    """compare_servers.bench_serve runs ``bench serve`` with the workload's flags and its JSON
    path; the workloads flatten its report, and a run past the timeout reads as failed."""
    overhead = _load("compare_overhead")
    commands = []

    def run(command, timeout, **_):
        commands.append(command)
        if timeout < 1:
            raise subprocess.TimeoutExpired(command, timeout)
        report = {"output_throughput": 5.0, "tpot_ms": {"median": 2.0}}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--workload", "overhead"])
    args = compare.parse_args()
    report = overhead.bench_load("http://h", "shipped", 1, 3, args, tmp_path / "r.json")
    assert report["tpot_median"] == 2.0 and report["output_throughput"] == 5.0
    command = commands[0]
    assert command[command.index("--base-url") + 1] == "http://h"
    assert command[command.index("--seed") + 1] == "3" and "--endpoint-type" in command
    args.timeout = 0.5
    failed = overhead.bench_load("http://h", "random", 1, 3, args, tmp_path / "s.json")
    assert failed == {"failed": "not done in 0 s"}
    assert (tmp_path / "s.log").exists()  # the run's output is kept even when it failed
