"""Whether a test of nanoserve's CPU kernels (``worker.cpu.kernels``) can run here, and what it
does where it cannot: the one place every kernel test asks.

Each kind of kernel names the instructions its operators are compiled for, as /proc/cpuinfo
names them. Where the CPU lacks them the test skips, naming the missing flags. Where the CPU has
them but the operators are not built or loaded (no compiler, a failed build, NANOSERVE_KERNELS=0)
the test skips as well, unless NANOSERVE_REQUIRE_KERNELS=1 (CI sets it): then it fails, since a
kernel test that skips on a CPU that could run it has stopped testing anything, silently.

Use ``require_kernels(kind)`` in a test or fixture, or mark a test ``@pytest.mark.kernels(kind)``
(tests/worker/conftest.py applies the mark).
"""

from __future__ import annotations

import os

import pytest

from worker.cpu import kernels

REQUIRE = "NANOSERVE_REQUIRE_KERNELS"

# What each kind's operators need of the CPU.
FLAGS: dict[str, tuple[str, ...]] = {
    # The float32 operators (AVX2_SOURCES), built on every CPU that has these.
    "avx2": kernels.AVX2_FLAGS,
    # decode_attention, argmax, rms_norm, silu_mul, rotary_ (and the float32 ones).
    "avx512": kernels.CPU_FLAGS,
    # prefill_attention, q4_linear and gguf_linear besides.
    "bf16": (*kernels.CPU_FLAGS, kernels.BF16_FLAG),
    # w4a8_linear besides.
    "vnni": (*kernels.CPU_FLAGS, kernels.BF16_FLAG, kernels.VNNI_FLAG),
}


def kernels_missing(kind: str) -> str | None:
    """None where the ``kind`` operators run here, else why not. Where the CPU has their flags
    but they are not loaded and NANOSERVE_REQUIRE_KERNELS=1, fails the calling test instead."""
    flags = FLAGS[kind]
    lacking = [flag for flag in flags if flag not in kernels.cpu_flags()]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)} (nanoserve's {kind} kernels)"
    if kind in ("bf16", "vnni") and not kernels.uses_bf16():
        return "NANOSERVE_KERNELS_BF16=0 builds the kernels without their AVX512-BF16 operators"
    built = kernels.loaded() if kind == "avx2" else kernels.available()
    if built:
        return None
    why = (
        f"this CPU has {', '.join(flags)} but nanoserve's {kind} kernels are not built or "
        "loaded (worker.cpu.kernels logs why; NANOSERVE_KERNELS=0 turns them off)"
    )
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1: {why}", pytrace=False)
    return why


def require_kernels(kind: str) -> None:
    """Skip the calling test unless the ``kind`` operators run here (or fail it, as
    ``kernels_missing`` says)."""
    why = kernels_missing(kind)
    if why is not None:
        pytest.skip(why)
