"""The background compiler's child process dies with the worker that started it, so a killed
worker never leaves a compiler behind to race its successor's (``worker.compiled.background``)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

PARENT = """
import subprocess, sys, time
from worker.compiled.background import _polite_child
child = subprocess.Popen(
    [sys.executable, "-c", "import os, time; print(os.nice(0), flush=True); time.sleep(600)"],
    preexec_fn=_polite_child, stdout=subprocess.PIPE, text=True,
)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_compiling_child_runs_at_the_lowest_priority_and_dies_with_the_worker():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the parent never reported its child"
        pid, niceness = (int(field) for field in parent.stdout.readline().split())
        assert niceness == 19
        child = os.pidfd_open(pid)
        parent.send_signal(signal.SIGKILL)
        # The pidfd turns readable when the child exits: an event, not a poll.
        gone, _, _ = select.select([child], [], [], 30)
        os.close(child)
        assert gone, f"child {pid} outlived its killed parent"
    finally:
        parent.kill()
        parent.wait(10)
