"""What the machine lends the worker: the CPUs it may really use, and its available memory.

CPUs: the affinity mask, capped by the cgroup's CPU quota. ``os.cpu_count()`` counts the
machine's CPUs, which a container or a ``taskset`` may deny the worker; more threads than usable
CPUs make OpenMP's threads wait on each other at every barrier, and one descheduled thread
stalls the whole step.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity), at most its cgroup quota; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 ``cpu.max``, or v1's CFS quota), or
    None when it is unlimited or unknown."""
    try:
        fields = (root / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else the free pages the OS reports."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def bound_onednn_cache() -> None:
    """Bound oneDNN's primitive cache, unless the user set it: it caches one primitive per
    matmul shape, and the worker pads every step to bucketed sizes (``worker.shapes``), so a run
    meets a bounded set of shapes and oneDNN's usual 1024 entries hold the ones in use; memory
    stops growing once they are built. oneDNN reads the variable when it builds its first
    primitive, so this runs before the model loads."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
