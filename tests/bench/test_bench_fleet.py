"""``nanoserve bench fleet`` end to end at its smallest: two simulated replicas behind the real
sglang-router, round-robin then cache-aware, a trace of 4 conversations of 3 turns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROUTER = shutil.which("sglang-router") or os.path.join(
    os.path.dirname(sys.executable), "sglang-router"
)
pytestmark = pytest.mark.skipif(not os.path.exists(ROUTER), reason="pip install sglang-router")


def test_the_simulation_prints_the_policy_table(tmp_path) -> None:
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "fleet", "--replicas", "2"]
    command += ["--conversations", "4", "--turns", "3", "--json", str(tmp_path / "rows.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.splitlines()[-3:]
    assert table[0].startswith("replicas  policy        hit rate")
    rows = {line.split()[1]: line.split() for line in table[1:]}
    assert set(rows) == {"round_robin", "cache_aware"}
    hit = {policy: float(row[2].rstrip("%")) for policy, row in rows.items()}
    # The shared prompt hits either way. Which policy hits more at 4 conversations depends on
    # how their turns interleave (the router balances load too): the bench's figures compare them.
    assert hit["round_robin"] > 0 and hit["cache_aware"] > 0
