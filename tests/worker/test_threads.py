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

from worker.cpu.threads import ThreadGovernor, thread_times, waiting_share


class Fake:
    """A clock, the threads' times and the thread counts set, all by hand: two compute threads
    and a ZeroMQ-like one that barely runs and waits on every wake-up."""

    def __init__(self) -> None:
        self.now = 0.0
        self.times = {"main": (0.0, 0.0), "omp": (0.0, 0.0), "zmq": (0.0, 0.0)}
        self.set: list[int] = []

    def governor(self, full: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            full,
            read_times=lambda: dict(self.times),
            clock=lambda: self.now,
            set_threads=self.set.append,
        )

    def steps(self, governor: ThreadGovernor, seconds: float, waited: float) -> None:
        """Steps of 50 ms for ``seconds``, each compute thread waiting ``waited`` of its
        runnable time (and, at one thread, the second one idle)."""
        for _ in range(round(seconds / 0.05)):
            self.now += 0.05
            for name in ("main", "omp") if governor.threads > 1 else ("main",):
                run, wait = self.times[name]
                self.times[name] = (run + 0.05 * (1 - waited), wait + 0.05 * waited)
            run, wait = self.times["zmq"]
            self.times["zmq"] = (run + 0.0001, wait + 0.001)
            governor.after_step(0.05)


def test_it_keeps_every_thread_while_they_barely_wait() -> None:
    fake = Fake()
    governor = fake.governor()
    fake.steps(governor, 5.0, waited=0.05)
    assert governor.threads == 2 and fake.set == []
    assert governor.last_share == pytest.approx(0.05)  # the ZeroMQ thread left out


def until_probe(fake: Fake, governor: ThreadGovernor) -> float:
    """Step (one thread, no wait) until the governor probes; the seconds that took."""
    began = fake.now
    while governor.threads == 1:
        fake.steps(governor, 0.05, waited=0.0)
    return fake.now - began


def test_a_neighbour_drops_it_to_one_thread_and_probes_back_with_backoff() -> None:
    fake = Fake()
    governor = fake.governor()
    fake.steps(governor, 0.3, waited=0.6)  # a neighbour holds a core
    assert governor.threads == 1 and fake.set == [1]
    assert until_probe(fake, governor) == pytest.approx(2.0, abs=0.06)
    fake.steps(governor, 0.15, waited=0.6)  # still there: 3 steps, back to one, backoff doubled
    assert fake.set == [1, 2, 1] and governor.backoff_s == 4.0
    assert until_probe(fake, governor) == pytest.approx(4.0, abs=0.06)
    fake.steps(governor, 0.15, waited=0.02)  # gone: the probe holds, the backoff resets
    assert fake.set == [1, 2, 1, 2] and governor.threads == 2 and governor.backoff_s == 2.0
    fake.steps(governor, 5.0, waited=0.02)
    assert fake.set == [1, 2, 1, 2] and governor.switches == 4


def test_a_probe_is_kept_only_well_under_the_threshold() -> None:
    """Hysteresis: two threads stay at a 28% share, but a probe reading 28% is not kept."""
    fake = Fake()
    governor = fake.governor()
    fake.steps(governor, 1.0, waited=0.28)
    assert fake.set == []
    fake.steps(governor, 0.3, waited=0.6)
    until_probe(fake, governor)
    fake.steps(governor, 0.15, waited=0.28)
    assert fake.set == [1, 2, 1] and governor.backoff_s == 4.0


def test_a_neighbour_that_stays_costs_a_probe_a_minute_at_most() -> None:
    fake = Fake()
    governor = fake.governor()
    for _ in range(4000):  # 200 s, a neighbour throughout
        fake.steps(governor, 0.05, waited=0.0 if governor.threads == 1 else 0.6)
    until_probe(fake, governor)  # the backoff in progress
    fake.steps(governor, 0.15, waited=0.6)
    gaps = []
    while len(gaps) < 3:
        gaps.append(until_probe(fake, governor))
        fake.steps(governor, 0.15, waited=0.6)
    assert governor.backoff_s == 60.0 and gaps == pytest.approx([60.0] * 3, abs=0.06)


def test_a_window_mostly_idle_decides_nothing() -> None:
    """Steps between long idle gaps (a trickle of requests): no decision, whatever the wait;
    steps back to back decide again."""
    fake = Fake()
    governor = fake.governor()
    for _ in range(20):
        fake.now += 10.0  # idle
        fake.steps(governor, 0.05, waited=0.6)
    assert fake.set == []
    fake.steps(governor, 0.6, waited=0.6)
    assert fake.set == [1]


def test_it_stays_off_with_one_thread_or_no_schedstat() -> None:
    fake = Fake()
    one = fake.governor(full=1)
    fake.steps(one, 1.0, waited=0.9)
    blind = ThreadGovernor(2, read_times=lambda: None, set_threads=fake.set.append)
    blind.after_step(1.0)
    assert not one.enabled and not blind.enabled and fake.set == []


def test_the_times_are_the_first_two_schedstat_fields(tmp_path: Path) -> None:
    for task, fields in (("100", "5000000000 2000000000 7"), ("101", "9 500000000 3")):
        (tmp_path / task).mkdir()
        (tmp_path / task / "schedstat").write_text(fields + "\n")
    (tmp_path / "102").mkdir()  # a thread that ended between the listing and the read
    assert thread_times(tmp_path) == {"100": (5.0, 2.0), "101": (9e-9, 0.5)}
    (tmp_path / "101" / "schedstat").write_text("9\n")
    assert thread_times(tmp_path) is None
    assert thread_times(tmp_path / "missing") is None


def test_the_share_counts_only_threads_busy_in_the_window() -> None:
    before = {"a": (1.0, 0.0), "b": (1.0, 0.0), "idle": (0.0, 0.0)}
    after = {"a": (1.5, 0.5), "b": (1.9, 0.1), "idle": (0.01, 0.05), "new": (0.5, 0.5)}
    # a: 0.5 run, 0.5 wait; b: 0.9, 0.1; idle: 0.06 of 1 s, left out; new: from its start
    assert waiting_share(before, after, wall_s=1.0) == pytest.approx(1.1 / 3.0)
    assert waiting_share(before, before, wall_s=1.0) == 0.0


@pytest.fixture
def two_cpus():
    """This process's threads on two CPUs (and torch on two threads), restored afterwards."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or thread_times() is None:
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


@pytest.mark.serial  # the suite's other process would be a neighbour too
def test_a_real_neighbour_takes_a_thread_and_gives_it_back(two_cpus: set[int]) -> None:
    torch.manual_seed(0)
    a = torch.randn(384, 384)
    governor = ThreadGovernor(2)
    for _ in range(40):  # quiet: both threads stay
        _step(governor, a)
    assert governor.threads == 2, governor.last_share
    neighbour = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        start_new_session=True,  # another session: another autogroup, as another user's job
        preexec_fn=lambda: os.sched_setaffinity(0, two_cpus),
    )
    try:
        deadline = time.monotonic() + 30
        while governor.threads == 2 and time.monotonic() < deadline:
            _step(governor, a)
        assert governor.threads == 1 and torch.get_num_threads() == 1, governor.last_share
    finally:
        os.kill(neighbour.pid, signal.SIGKILL)
        neighbour.wait(10)
    deadline = time.monotonic() + 30
    while (governor.threads == 1 or governor._probing) and time.monotonic() < deadline:
        _step(governor, a)
    assert governor.threads == 2 and torch.get_num_threads() == 2, governor.last_share
