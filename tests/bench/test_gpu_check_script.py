"""scripts/gpu_check.sh, the project's GPU check: its verdicts and comparisons (each proven to
fire on one corrupted input), and the whole script in ``--cpu-smoke`` mode on this CPU with tiny
shapes: every step runs (checkpoints made here, the gpu-marked tests, transformers, three
processes per server over HTTP, a worker SIGKILLed mid-stream, the speed levels), the JSON, the
table and the logs are written, and every process it started has ended. Its figures on a CPU
mean nothing; what a GPU run must show is in docs/gpu.md."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _load(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("gpu_report")
probes = _load("gpu_probes")

A, B, C = [104, 105], [33], [10]  # three tokens' bytes


def test_token_comparison_counts_each_reply_and_finds_the_first_difference():
    ours = [[A, B, C], [A, A, A], [B, C]]
    assert probes.same_tokens(ours, copy.deepcopy(ours)) == {
        "matched": 3,
        "of": 3,
        "first_difference": {},
    }
    theirs = [[A, B, C], [A, B, A], [B]]  # the second differs at 1; the third stopped early
    assert probes.same_tokens(ours, theirs) == {
        "matched": 2,
        "of": 3,
        "first_difference": {1: 1},
    }
    assert probes.same_tokens([[]], [[]])["matched"] == 0  # nothing compared is no match


def _gpu_result() -> dict:
    """A GPU run's result that meets every bar."""
    level = {"median_itl_ms": 1.5, "median_ttft_ms": 20.0}
    top = {"output_throughput": 45_000.0, "gpu_utilization_pct": 80.0}
    return {
        "mode": "gpu",
        "steps": {
            "cuda tests": {"ok": True, "tests": 5, "failures": 0, "errors": 0, "skipped": 0},
            "float32 greedy vs transformers": {
                "together": {"matched": 8, "of": 8},
                "one_by_one": {"matched": 8, "of": 8},
            },
            "graphs vs eager tokens": {"same": {"matched": 8, "of": 8}},
            "worker SIGKILL mid-stream": {"ok": True, "streams_undisturbed": 8, "of": 8},
            "worker SIGKILL on the shared pool": {
                "ok": True,
                "of": 8,
                "reattaches": 1,
                "recomputed": 16,
            },
            "speed levels": {
                "levels": [{"concurrency": 1, **level}, {"concurrency": 256, **top}],
                "capture_log": ["worker: captured 35 CUDA graphs in 12.5 s, 0.4 GiB"],
            },
        },
    }


def _met(result: dict) -> dict[str, bool | None]:
    return {bar["check"]: bar["met"] for bar in report.evaluate(result)}


def test_a_run_that_meets_every_bar_is_all_yes():
    assert set(_met(_gpu_result()).values()) == {True}
    assert report.capture_seconds(["captured 35 CUDA graphs in 12.5 s"]) == 12.5


@pytest.mark.parametrize(
    "path, value, check",
    [
        (("float32 greedy vs transformers", "together", "matched"), 7, "float32 greedy = "),
        (("float32 greedy vs transformers", "one_by_one", "matched"), 0, "one by one"),
        (("graphs vs eager tokens", "same", "matched"), 7, "graphs = eager"),
        (("worker SIGKILL mid-stream", "ok"), False, "SIGKILL mid-stream"),
        (("worker SIGKILL on the shared pool", "ok"), False, "shared pool SIGKILL"),
        (("speed levels", "levels", 0, "median_itl_ms"), 2.1, "median ITL"),
        (("speed levels", "levels", 0, "median_ttft_ms"), 26.0, "median TTFT"),
        (("speed levels", "levels", 1, "output_throughput"), 39_999.0, "output tok/s"),
        (("speed levels", "levels", 1, "gpu_utilization_pct"), 69.0, "GPU utilization"),
        (("speed levels", "capture_log", 0), "captured in 31 s", "graph capture"),
        (("cuda tests", "ok"), False, "CUDA tests"),
        (("cuda tests", "skipped"), 5, "CUDA tests"),  # every one skipped: no GPU seen
    ],
)
def test_each_bar_fires_on_its_own_miss(path, value, check):
    result = _gpu_result()
    target = result["steps"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    missed = [name for name, met in _met(result).items() if met is False]
    assert len(missed) == 1 and check in missed[0], missed
    result["bars"] = report.evaluate(result)
    speed = any(w in check for w in ("ITL", "TTFT", "tok/s", "utilization", "capture"))
    failed = report.failed_checks(result)  # what makes the check exit 1
    assert failed == [] if speed else set(missed) <= set(failed), failed
    assert "**no**" in report.format_report(result)


def test_a_cpu_run_judges_no_speed_bar():
    result = _gpu_result() | {"mode": "cpu-smoke"}
    met = _met(result)
    assert met["concurrency 256: output tok/s"] is None and met["graph capture"] is None
    assert met["float32 greedy = transformers, together"] is True


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.serial  # three servers, transformers and a worker restart: it needs the cores
@pytest.mark.timeout(240)
def test_the_whole_check_runs_on_this_cpu(tmp_path):
    marker = f"NANOSERVE_GPU_CHECK_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    env = {**os.environ, name: value, "PYTHON": sys.executable}
    out, work = tmp_path / "out", tmp_path / "work"
    command = ["bash", str(SCRIPTS / "gpu_check.sh"), "--cpu-smoke", "--out", str(out)]
    command += ["--work", str(work), "--tokenizer-dir", str(tmp_path / "none")]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=210)
    finally:
        leftover = _processes_with(marker)
        for pid in leftover:
            os.kill(pid, 9)
    assert not leftover, "processes outlived the check"
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    steps = result["steps"]
    assert result["mode"] == "cpu-smoke"
    assert [n for n, s in steps.items() if s["ok"] is False] == []
    assert "tokenizer" in steps["checkpoints"]  # exported from the default model here
    assert steps["cuda tests"]["files"] and steps["cuda tests"]["failures"] == 0
    met = {bar["check"]: bar["met"] for bar in result["bars"]}
    assert met["float32 greedy = transformers, together"] is True
    assert met["float32 greedy = transformers, one by one"] is True
    assert met["worker SIGKILL mid-stream: undisturbed streams"] is True
    assert met["concurrency 1: median ITL"] is None  # a CPU's speed is not judged
    kill = steps["worker SIGKILL mid-stream"]
    assert kill["in_flight_at_kill"] == kill["of"] == 8
    # The same kill on the holder's pool (a file here, device memory on a GPU): re-attached,
    # at most the two steps in flight computed again.
    shared = steps["worker SIGKILL on the shared pool"]
    assert shared["streams_undisturbed"] == shared["of"] == 8 and shared["reattaches"] == 1
    assert 0 < shared["recomputed"] <= 16 and not shared["fallbacks"], shared
    assert met["shared pool SIGKILL: re-attached, tokens recomputed"] is True
    levels = steps["speed levels"]["levels"]
    assert [(lv["concurrency"], lv["completed"], lv["failed"]) for lv in levels] == [
        (1, 2, 0),
        (32, 32, 0),
        (256, 256, 0),
    ]
    assert all(lv["frontend_cpu_us_per_token"] for lv in levels)  # both frontends' summed
    assert [len(lv["frontends"]) for lv in levels] == [2, 2, 2]  # --api-servers 2
    assert [row["batch"] for row in steps["transformers"]["static"]] == [1, 2]
    table = (out / "gpu_check.md").read_text()
    assert table == done.stdout.strip() + "\n" and "| check | measured | bar | met |" in table
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert "logs/exact/worker.log" in archive.getnames()
