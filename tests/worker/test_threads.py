"""ThreadGovernor: one thread while a neighbour holds a core, all of them when it leaves.

The policy on a fake clock and fake readings, the reading on a fake /proc, and the whole on
this machine: real OpenMP matmuls beside a real busy loop in a session of its own (another
autogroup, as another user's job would be)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from worker.threads import ThreadGovernor, runnable_wait_s


class Fake:
    """A clock, a wait counter and the thread counts set, all by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wait = 0.0
        self.set: list[int] = []

    def governor(self, full: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            full,
            read_wait=lambda: self.wait,
            clock=lambda: self.now,
            set_threads=self.set.append,
        )

    def steps(self, governor: ThreadGovernor, seconds: float, waited_per_s: float) -> None:
        """Steps of 50 ms for ``seconds``, the threads waiting ``waited_per_s`` per second."""
        for _ in range(round(seconds / 0.05)):
            self.now += 0.05
            self.wait += 0.05 * waited_per_s
            governor.after_step(0.05)


def test_it_keeps_every_thread_while_they_barely_wait() -> None:
    fake = Fake()
    governor = fake.governor()
    fake.steps(governor, 5.0, waited_per_s=0.05)
    assert governor.threads == 2 and fake.set == [] and governor.last_wait == pytest.approx(0.05)


def until_probe(fake: Fake, governor: ThreadGovernor) -> float:
    """Step (one thread, no wait) until the governor probes; the seconds that took."""
    began = fake.now
    while governor.threads == 1:
        fake.steps(governor, 0.05, waited_per_s=0.0)
    return fake.now - began


def test_a_neighbour_drops_it_to_one_thread_and_probes_back_with_backoff() -> None:
    fake = Fake()
    governor = fake.governor()
    fake.steps(governor, 0.3, waited_per_s=0.6)  # a neighbour holds a core
    assert governor.threads == 1 and fake.set == [1]
    assert until_probe(fake, governor) == pytest.approx(2.0, abs=0.06)
    fake.steps(governor, 0.3, waited_per_s=0.6)  # still there: back to one, backoff doubled
    assert fake.set == [1, 2, 1] and governor.backoff_s == 4.0
    assert until_probe(fake, governor) == pytest.approx(4.0, abs=0.06)
    fake.steps(governor, 0.3, waited_per_s=0.02)  # gone: the probe holds, the backoff resets
    assert fake.set == [1, 2, 1, 2] and governor.threads == 2 and governor.backoff_s == 2.0
    fake.steps(governor, 5.0, waited_per_s=0.02)
    assert fake.set == [1, 2, 1, 2] and governor.switches == 4


def test_a_neighbour_that_stays_costs_a_probe_a_minute_at_most() -> None:
    fake = Fake()
    governor = fake.governor()
    for _ in range(4000):  # 200 s, a neighbour throughout
        fake.steps(governor, 0.05, waited_per_s=0.0 if governor.threads == 1 else 0.6)
    until_probe(fake, governor)  # the backoff in progress
    fake.steps(governor, 0.3, waited_per_s=0.6)
    gaps = []
    while len(gaps) < 3:
        gaps.append(until_probe(fake, governor))
        fake.steps(governor, 0.3, waited_per_s=0.6)
    assert governor.backoff_s == 60.0 and gaps == pytest.approx([60.0] * 3, abs=0.06)


def test_idle_time_does_not_count() -> None:
    """Windows hold stepping time: a neighbour seen over a few steps between long idle gaps
    still shows."""
    fake = Fake()
    governor = fake.governor()
    for _ in range(5):
        fake.now += 10.0  # idle: no wait accrues
        fake.steps(governor, 0.05, waited_per_s=0.6)
    assert fake.set == [1]


def test_it_stays_off_with_one_thread_or_no_schedstat() -> None:
    fake = Fake()
    one = fake.governor(full=1)
    fake.steps(one, 1.0, waited_per_s=0.9)
    blind = ThreadGovernor(2, read_wait=lambda: None, set_threads=fake.set.append)
    blind.after_step(1.0)
    assert not one.enabled and not blind.enabled and fake.set == []


def test_the_wait_is_the_second_schedstat_field_summed_over_threads(tmp_path: Path) -> None:
    for task, fields in (("100", "5 2000000000 7"), ("101", "9 500000000 3")):
        (tmp_path / task).mkdir()
        (tmp_path / task / "schedstat").write_text(fields + "\n")
    (tmp_path / "102").mkdir()  # a thread that ended between the listing and the read
    assert runnable_wait_s(tmp_path) == 2.5
    (tmp_path / "101" / "schedstat").write_text("9\n")
    assert runnable_wait_s(tmp_path) is None
    assert runnable_wait_s(tmp_path / "missing") is None


@pytest.fixture
def two_cpus():
    """This process's threads on two CPUs (and torch on two threads), restored afterwards."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or runnable_wait_s() is None:
        pytest.skip("needs two CPUs and /proc/self/task/*/schedstat")
    pair = set(cpus[:2])
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    for task in tasks:
        os.sched_setaffinity(task, pair)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield pair
    finally:
        torch.set_num_threads(threads)
        for task in tasks:
            try:
                os.sched_setaffinity(task, set(cpus))
            except OSError:
                pass


def _step(governor: ThreadGovernor, a: torch.Tensor) -> None:
    began = time.perf_counter()
    for _ in range(4):
        a @ a  # (384, 384) float32: OpenMP regions on both threads
    governor.after_step(time.perf_counter() - began)


def test_a_real_neighbour_takes_a_thread_and_gives_it_back(two_cpus: set[int]) -> None:
    torch.manual_seed(0)
    a = torch.randn(384, 384)
    governor = ThreadGovernor(2)
    for _ in range(40):  # quiet: both threads stay
        _step(governor, a)
    assert governor.threads == 2, governor.last_wait
    neighbour = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        start_new_session=True,  # another session: another autogroup, as another user's job
        preexec_fn=lambda: os.sched_setaffinity(0, two_cpus),
    )
    try:
        deadline = time.monotonic() + 30
        while governor.threads == 2 and time.monotonic() < deadline:
            _step(governor, a)
        assert governor.threads == 1 and torch.get_num_threads() == 1, governor.last_wait
    finally:
        os.kill(neighbour.pid, signal.SIGKILL)
        neighbour.wait(10)
    deadline = time.monotonic() + 30
    while (governor.threads == 1 or governor._probing) and time.monotonic() < deadline:
        _step(governor, a)
    assert governor.threads == 2 and torch.get_num_threads() == 2, governor.last_wait
