"""The worker's big CPU tensors land on transparent huge pages (``worker/__init__.py``), unless
the user says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Imports the worker the way its process does (the package before torch), fills 64 MiB the way
# the KV pool is filled, and prints how much of the process sits on huge pages.
CHILD = """
import worker.worker
import torch
pool = torch.zeros(64 << 20, dtype=torch.uint8)
pool.add_(1)
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        print(int(line.split()[1]))
"""


def huge_kib(env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)


@needs_thp
def test_the_pool_sits_on_huge_pages_by_default() -> None:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert huge_kib(env) >= 32 << 10  # most of the 64 MiB


@needs_thp
def test_a_users_setting_wins() -> None:
    if "[always]" in THP.read_text():
        pytest.skip("the kernel gives every mapping huge pages here")
    assert huge_kib({**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}) == 0
