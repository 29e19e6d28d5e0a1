"""The kernel tests' gate (``tests.worker.kernel_checks``): a CPU without the instructions skips,
naming what it lacks; a CPU that has them but whose kernels did not load skips, or fails under
NANOSERVE_REQUIRE_KERNELS=1, with a message that says so. The CPU's flags and the build are
simulated, so every case runs on any machine; one child pytest shows that the real kernel tests'
marks go through the gate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.kernel_checks import FLAGS, REQUIRE, kernels_missing, require_kernels
from worker.cpu import kernels

EVERY_FLAG = frozenset(flag for flags in FLAGS.values() for flag in flags)
AVX2_ONLY = frozenset(kernels.AVX2_FLAGS)
NOT_LOADED = r"this CPU has .* but nanoserve's {} kernels are not built or loaded"


def outcome(kind: str) -> tuple[str, str]:
    """What ``require_kernels(kind)`` does to a test: ("ran", ""), ("skipped", why) or
    ("failed", why). Caught here, so a gate that skips where it must fail fails this test."""
    try:
        require_kernels(kind)
    except pytest.skip.Exception as skip:
        return "skipped", str(skip)
    except pytest.fail.Exception as failure:
        return "failed", str(failure)
    return "ran", ""


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    """set(flags, loaded): simulate this CPU's flags and whether the kernels loaded."""
    monkeypatch.delenv(REQUIRE, raising=False)
    monkeypatch.delenv("NANOSERVE_KERNELS_BF16", raising=False)

    def simulate(flags: frozenset[str], loaded: bool) -> None:
        monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
        monkeypatch.setattr(kernels, "loaded", lambda: loaded)

    return simulate


@pytest.mark.parametrize("kind", sorted(FLAGS))
def test_kernels_the_cpu_could_run_but_did_not_load_fail_when_required(cpu, monkeypatch, kind):
    cpu(EVERY_FLAG, loaded=False)
    monkeypatch.setenv(REQUIRE, "1")
    what, why = outcome(kind)
    assert what == "failed", why
    assert re.match(f"{REQUIRE}=1: " + NOT_LOADED.format(kind), why), why


@pytest.mark.parametrize("kind", sorted(FLAGS))
def test_without_the_switch_they_skip_saying_why(cpu, kind):
    cpu(EVERY_FLAG, loaded=False)
    what, why = outcome(kind)
    assert what == "skipped" and re.match(NOT_LOADED.format(kind), why), why
    assert kernels_missing(kind) == why


@pytest.mark.parametrize("kind", sorted(FLAGS))
def test_loaded_kernels_run(cpu, monkeypatch, kind):
    cpu(EVERY_FLAG, loaded=True)
    monkeypatch.setenv(REQUIRE, "1")
    assert outcome(kind) == ("ran", "")
    assert kernels_missing(kind) is None


def test_a_cpu_without_the_flags_skips_naming_them_even_when_required(cpu, monkeypatch):
    cpu(AVX2_ONLY, loaded=True)  # what an AVX2 machine builds
    monkeypatch.setenv(REQUIRE, "1")
    assert outcome("avx2") == ("ran", "")
    lacking = "avx512f, avx512bw, avx512vl, avx512dq"
    why = f"this CPU lacks {lacking} (nanoserve's avx512 kernels)"
    assert outcome("avx512") == ("skipped", why)
    why = f"this CPU lacks {lacking}, avx512_bf16, avx512_vnni (nanoserve's vnni kernels)"
    assert outcome("vnni") == ("skipped", why)
    cpu(EVERY_FLAG - {kernels.VNNI_FLAG}, loaded=True)
    assert outcome("bf16") == ("ran", "")
    assert outcome("vnni") == ("skipped", "this CPU lacks avx512_vnni (nanoserve's vnni kernels)")


def test_bfloat16_operators_left_out_on_purpose_skip_even_when_required(cpu, monkeypatch):
    """NANOSERVE_KERNELS_BF16=0 builds the float32 scoring (test_kernels runs it so): what it
    leaves out is not missing."""
    cpu(EVERY_FLAG, loaded=True)
    monkeypatch.setenv(REQUIRE, "1")
    monkeypatch.setenv("NANOSERVE_KERNELS_BF16", "0")
    assert outcome("avx512") == ("ran", "")
    for kind in ("bf16", "vnni"):
        what, why = outcome(kind)
        assert what == "skipped" and why.startswith("NANOSERVE_KERNELS_BF16=0 builds"), why


def test_the_marked_kernel_tests_fail_when_required(tmp_path):
    """NANOSERVE_KERNELS=0 in a child pytest stands for a build that failed: test_q4's tests
    marked ``kernels`` (the conftest applies the mark) error; none passes, and none skips for
    want of kernels."""
    if not kernels.cpu_supports_avx2():
        pytest.skip(f"this CPU lacks one of {', '.join(kernels.AVX2_FLAGS)}: nothing to require")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + [f"--basetemp={tmp_path / 'child'}", str(Path(__file__).parent / "test_q4.py")]
        + ["-m", "kernels"],
        env={**os.environ, "NANOSERVE_KERNELS": "0", REQUIRE: "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-3000:]
    assert " error" in summary and "passed" not in summary, summary
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skipped if "kernels" in line], skipped
    assert f"{REQUIRE}=1: this CPU has avx2, fma, f16c but nanoserve's avx2" in done.stdout
