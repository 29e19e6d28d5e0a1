"""``nanoserve supervise``: restart with backoff, stop on exit 0 or 2, forward SIGTERM and exit
with the child's code. Children are tiny shell scripts, so this runs in seconds."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.supervisor import SupervisorConfig

SUPERVISE = [sys.executable, "-m", "nanoserve.cli", "supervise", "--initial-backoff", "0.05"]


def _supervise(*child: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*SUPERVISE, *extra, "--", *child], stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 20.0) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise
    return process.returncode, err


def test_restarts_a_crashing_child_with_growing_backoff(tmp_path):
    counter = tmp_path / "runs"
    # Crash three times, then exit 0: the supervisor restarts it, then ends with 0.
    script = f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 4 ] && exit 0; exit 3"
    code, err = _finish(_supervise("sh", "-c", script))
    assert code == 0
    assert counter.read_text().count("x") == 4
    backoffs = [float(b) for b in re.findall(r"restarting in ([\d.]+) s", err)]
    assert backoffs == [0.05, 0.1, 0.2]


def test_a_usage_error_is_not_restarted():
    code, err = _finish(_supervise("sh", "-c", "exit 2"))
    assert code == 2 and err.count("started pid") == 1


def test_sigterm_is_forwarded_and_the_childs_code_returned(tmp_path):
    ready = tmp_path / "trapped"
    trap = f"trap 'exit 7' TERM; touch {ready}; while true; do sleep 0.05; done"
    process = _supervise("sh", "-c", trap, extra=("--pid-file", str(tmp_path / "child.pid")))
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:  # the trap is set
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    code, err = _finish(process)
    assert code == 7 and err.count("started pid") == 1
    assert int((tmp_path / "child.pid").read_text()) > 0


def test_config_is_validated():
    with pytest.raises(ValueError, match="command"):
        SupervisorConfig(command=())
    with pytest.raises(ValueError, match="backoff"):
        SupervisorConfig(command=("true",), initial_backoff=2, max_backoff=1)
    assert SupervisorConfig(command=("true",), pid_file=Path("x")).healthy_after == 30.0
