"""scripts/cpu_peak.py builds its vdpbf16ps loop (or, without AVX512-BF16, its AVX2 loops) and
prints a positive rate per thread count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpu import kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_peak.py"


def _lines_per_thread_count() -> list[str]:
    """The script's lines for 1 and 2 threads, short rounds; it must succeed."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "200000", "--threads", "1,2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["1", "2"]
    return lines


@pytest.mark.skipif(kernels.BF16_FLAG not in kernels.cpu_flags(), reason="needs AVX512-BF16")
def test_it_prints_one_positive_peak_per_thread_count():
    lines = _lines_per_thread_count()
    for line in lines:
        found = re.search(r"(\d+) GFLOP/s bfloat16 peak", line)
        assert found and int(found.group(1)) > 0, line


@pytest.mark.skipif(
    kernels.BF16_FLAG in kernels.cpu_flags() or not kernels.cpu_supports_avx2(),
    reason="the AVX2 loops run where AVX512-BF16 is missing and AVX2 is there",
)
def test_without_avx512_bf16_it_prints_the_avx2_peaks_per_thread_count():
    lines = _lines_per_thread_count()
    for line in lines:
        rates = re.findall(r"(\d+) G multiply-adds/s (float32 vfmadd|int8 vpmaddubsw)", line)
        assert [name for _, name in rates] == ["float32 vfmadd", "int8 vpmaddubsw"], line
        assert all(int(rate) > 0 for rate, _ in rates), line
