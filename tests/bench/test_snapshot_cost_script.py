"""scripts/snapshot_cost.py fragments a pool on the SimWorker and prints both sides' costs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "snapshot_cost.py"


def test_it_prints_the_pool_and_both_costs():
    command = [sys.executable, str(SCRIPT), "--steps", "60", "--concurrency", "4"]
    done = subprocess.run(
        command + ["--num-blocks", "300"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, scheduler, frontend = done.stdout.strip().splitlines()
    assert re.match(
        r"4 running, \d+ held and \d+ cached-free blocks of 300; a snapshot is \d+ bytes", first
    )
    for line, side in ((scheduler, "scheduler"), (frontend, "frontend")):
        found = re.search(r"(\d+\.\d) us per snapshot", line)
        assert line.startswith(side) and found and float(found.group(1)) > 0, line
