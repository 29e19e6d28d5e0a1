"""What a tensor-parallel worker refuses at start, in one line on stderr and exit status 2
(so a supervisor does not restart it): a size that does not split the model's heads, a
rendezvous that cannot be reached, and standby workers for a group."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.servers import free_port


def _worker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NANOSERVE_RUN_ID": f"refusal-{os.getpid()}"}
    command = [sys.executable, "-m", "nanoserve.cli", "worker", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def _one_line(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]


def test_a_size_that_does_not_split_the_default_model_is_refused():
    _one_line(
        _worker("--tensor-parallel-size", "2"),
        "tensor parallel size 2 does not split the model's 9 query heads, 3 KV heads",
        "sizes that do: 1, 3",
    )


def test_a_size_that_does_not_split_the_tiny_model_is_refused(tiny_dir):
    _one_line(_worker("--model", str(tiny_dir), "--tensor-parallel-size", "3"), "1, 2, 4")


def test_an_unreachable_rendezvous_is_refused(tiny_dir):
    port = free_port()  # nothing listens there
    done = _worker(
        "--model", str(tiny_dir), "--tensor-parallel-size", "2", "--tp-ranks", "1",
        "--tp-master-port", str(port), "--tp-connect-timeout", "2",
    )  # fmt: skip
    _one_line(done, f"rendezvous at 127.0.0.1:{port} failed")


def test_standby_workers_with_a_group_are_refused(tiny_dir):
    done = _worker(
        "--model", str(tiny_dir), "--tensor-parallel-size", "2", "--shared-kv-pool",
        "--standby-workers", "1",
    )  # fmt: skip
    _one_line(done, "--standby-workers is not supported with --tensor-parallel-size > 1")


def test_serve_refuses_standby_workers_with_a_group_before_starting_anything(tiny_dir):
    env = {**os.environ, "NANOSERVE_RUN_ID": f"refusal-{os.getpid()}"}
    command = [
        sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(tiny_dir),
        "--tensor-parallel-size", "2", "--shared-kv-pool", "--standby-workers", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    _one_line(done, "nanoserve serve: error: --standby-workers is not supported")
