"""scripts/thread_wait.py prints a busy thread's run and wait shares, and one line for a bad pid."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "thread_wait.py"


def test_it_reports_a_busy_process_and_refuses_a_missing_one():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(busy.pid), "0.5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        busy.kill()
        busy.wait(10)
    assert done.returncode == 0, done.stderr
    ran = re.search(r"ran\s+(\d\.\d+)\s+waited\s+(\d\.\d+)\s+\((\d+)%\)", done.stdout)
    assert ran and float(ran.group(1)) > 0.3, done.stdout
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), str(busy.pid), "0.1"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and missing.stderr.startswith("thread_wait: ")
