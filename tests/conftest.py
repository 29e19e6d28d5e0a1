"""Settings for the whole suite.

Tests compare texts across runs, batchings and pool sizes, and against transformers: float32
makes those comparisons exact, while a bfloat16 text may change with the shape of the step it
ran in. So every process a test starts, and every worker it builds, runs float32 unless the test
names another dtype (the served default, ``auto``, is bfloat16 on CPUs that compute it).

Compiling the real model takes minutes of CPU, so served workers do not compile unless a test
asks (the default compiles in the background where it pays).
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("NANOSERVE_DTYPE", "float32")
os.environ.setdefault("NANOSERVE_COMPILE", "0")
# A pool sized from the RAM free at its start (a quarter, up to 4 GiB) shrinks when other tests'
# servers run beside it: a fixed budget keeps every test's geometry the same, in the servers a
# test starts and in the commands it runs in-process.
os.environ.setdefault("NANOSERVE_KV_CACHE_MEMORY", "1GiB")
# Without a GPU, Triton's kernels run in its interpreter (tests/worker/test_triton_attention.py).
# Triton reads the variable when it is first imported, and other modules of the session may
# import it (torch's inductor does), so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back() -> Iterator[None]:
    """After each module (its fixtures gone), hand its freed heap back to the system: a test
    process runs dozens of modules, and glibc keeps what one model-sized module freed, which
    two test processes and their servers then run short of on a 24 GiB machine."""
    yield
    # A third of a second a call: only once the process has grown by a GiB since the last.
    if _LIBC is not None and _resident_bytes() > _trimmed[0] + _TRIM_GROWTH:
        gc.collect()
        _LIBC.malloc_trim(0)
        _trimmed[0] = _resident_bytes()


_TRIM_GROWTH = 1 << 30
_trimmed = [0]  # the resident bytes the last trim left


def _resident_bytes() -> int:
    """This process's resident memory (the second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()
