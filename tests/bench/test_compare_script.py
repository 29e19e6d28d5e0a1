"""scripts/compare.py: its table, its flags and its process launcher (no model, no servers)."""

from __future__ import annotations

import importlib.util
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
            "worker_rss_mib_start": 700.4,
            "worker_rss_mib_end": 701.6,
            "failed": 0,
        },
        {"server": "transformers static b32", "dtype": "float32", "output_throughput": 164.0},
    ]
    lines = compare.format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| nanoserve | bfloat16 | 32 | 812.3 | 95 | 31.2 | 60.0 | 33.0 | 97% | 0.46 | 700 | 702 "
        "| 0 |"
    )
    assert lines[3] == (
        "| transformers static b32 | float32 | - | 164.0 | - | - | - | - | - | - | - | - | - |"
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


def test_each_readme_start_is_followed_by_its_llama_server_start(monkeypatch, tmp_path):
    """The bars compare the servers run by run, so run N of llama-server must come right after
    run N of nanoserve, not after all of nanoserve's runs (the machine's speed drifts)."""
    events: list[str] = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            events.append(f"stop {self.name}")

    starts = iter(range(1, 10))
    monkeypatch.setattr(compare, "start_as_readme", lambda log_dir: Stub(f"nano{next(starts)}"))
    llamas = iter(range(1, 10))
    monkeypatch.setattr(compare, "_llama_server", lambda args, logs: Stub(f"llama{next(llamas)}"))
    monkeypatch.setattr(compare, "time_readme_start", lambda server, label, wait: {})

    def bench_all(name, label, server, args, work, seed=0):
        events.append(f"bench {server.name} {label}")
        return [{"server": name, "dtype": label}]

    monkeypatch.setattr(compare, "bench_all", bench_all)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--as-readme", "--runs", "2"])
    args = compare.parse_args()
    args.with_llamacpp, args.llama_server = True, Path("/nonexistent/llama-server")
    _, rows = compare.readme_rows(args, tmp_path, tmp_path)
    assert events == [
        "bench nano1 README run 1",
        "stop nano1",
        "bench llama1 run 1",
        "stop llama1",
        "bench nano2 README run 2",
        "stop nano2",
        "bench llama2 run 2",
        "stop llama2",
    ]
    assert len(rows) == 4
