"""``nanoserve bench tp`` runs the real ranks and prints a row per size, with the all-reduces
a decode step makes (two per layer and one for the embedding)."""

from __future__ import annotations

import subprocess
import sys


def test_bench_tp_prints_a_row_per_size(tiny_dir):
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "tp", "--model", str(tiny_dir)]
    command += ["--sizes", "2", "--batch", "2", "--context", "8", "--decode-steps", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    by_size = {int(row[0]): row for row in rows[1:]}
    assert set(by_size) == {2}
    assert int(by_size[2][3]) == 2 * 2 + 1  # the tiny model has 2 layers
    assert float(by_size[2][1]) > 0
