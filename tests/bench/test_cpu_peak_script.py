"""scripts/cpu_peak.py builds its vdpbf16ps loop and prints a positive rate per thread count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker import kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_peak.py"


@pytest.mark.skipif(kernels.BF16_FLAG not in kernels.cpu_flags(), reason="needs AVX512-BF16")
def test_it_prints_one_positive_peak_per_thread_count():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "200000", "--threads", "1,2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["1", "2"]
    for line in lines:
        found = re.search(r"(\d+) GFLOP/s bfloat16 peak", line)
        assert found and int(found.group(1)) > 0, line
