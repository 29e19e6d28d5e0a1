"""The monitor's rate: snapshots cost at most ``budget`` of the scheduler's own CPU since the
page opened, at most one per ``interval_s``, and at least one per ``max_gap_s``; each says how
it was paced (its ``Cadence``), so a page can tell a throttled feed from a missing one."""

from __future__ import annotations

import msgspec
import pytest

from protocol.monitor import PoolSnapshot
from scheduler import monitor as monitor_module
from scheduler.monitor import Monitor

SNAPSHOT_S = 100e-6  # what each snapshot costs here
DECODE = msgspec.msgpack.Decoder(PoolSnapshot).decode


class Workers:
    """The scheduler's side as the monitor reads it: its busy CPU, and never a step to send."""

    busy_s = 0.0

    def can_step(self) -> bool:
        return False


class Socket:
    """The XPUB as the monitor uses it: every snapshot sent, decoded as a frontend would."""

    def __init__(self) -> None:
        self.snapshots: list[PoolSnapshot] = []

    def send(self, payload: bytes, flags: int, copy: bool) -> None:
        self.snapshots.append(DECODE(payload))


def run(monkeypatch: pytest.MonkeyPatch, seconds: float, busy_per_s: float) -> Monitor:
    """``seconds`` of the scheduler's loop (a turn every 10 ms) that is busy ``busy_per_s``;
    each snapshot costs ``SNAPSHOT_S`` of the loop thread's CPU."""
    workers = Workers()
    monitor = Monitor(Socket(), None, workers, interval_s=0.25, budget=0.03, max_gap_s=1.0)
    monitor.topics.add(b"")  # a page watches (from the start: nothing spent, nothing allowed)
    now, cpu = [1000.0], [0.0]

    def snapshot() -> PoolSnapshot:
        cpu[0] += SNAPSHOT_S
        return PoolSnapshot(seq=monitor.sent, cadence=monitor.cadence())

    monitor.snapshot = snapshot
    monkeypatch.setattr(monitor_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(monitor_module.time, "thread_time", lambda: cpu[0])
    for _ in range(round(seconds / 0.01)):
        now[0] += 0.01
        workers.busy_s += 0.01 * busy_per_s
        monitor.maybe_publish()
    return monitor


@pytest.mark.parametrize(
    ("busy_per_s", "per_s"),
    [
        (0.0, 1.0),  # idle: one a second keeps the page live
        (0.001, 1.0),  # light: the floor
        (0.005, 1.5),  # 3% of 5 ms a second is 150 us: one and a half snapshots
        (0.1, 4.0),  # busy: the interval caps it
    ],
)
def test_snapshots_stay_within_the_budget_and_the_bounds(
    monkeypatch: pytest.MonkeyPatch, busy_per_s: float, per_s: float
) -> None:
    monitor = run(monkeypatch, 60.0, busy_per_s)
    assert monitor.sent / 60.0 == pytest.approx(per_s, rel=0.05)
    if per_s > 1.0:  # above the floor, the budget or the interval holds it
        assert monitor.busy_s <= 0.03 * 60.0 * busy_per_s + SNAPSHOT_S


def test_a_snapshot_held_back_by_the_budget_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the floor every snapshot after the first is throttled, a second after the last."""
    snapshots = run(monkeypatch, 10.0, 0.001).socket.snapshots
    first, *rest = [s.cadence for s in snapshots]
    assert first.gap_s == 0.0 and not first.throttled  # nothing spent yet: within the budget
    assert rest and all(c.throttled for c in rest)
    assert all(c.gap_s == pytest.approx(1.0, abs=0.011) for c in rest)
    assert (first.interval_s, first.max_gap_s, first.budget) == (0.25, 1.0, 0.03)


def test_a_snapshot_within_the_budget_is_not_throttled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy enough that the interval, not the budget, paces them: none says throttled."""
    snapshots = run(monkeypatch, 10.0, 0.1).socket.snapshots
    cadences = [s.cadence for s in snapshots[1:]]
    assert len(cadences) > 30 and not any(c.throttled for c in cadences)
    assert all(c.gap_s == pytest.approx(0.25, abs=0.011) for c in cadences)


def test_between_the_bounds_the_budget_paces_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """3% of 5 ms a second allows one and a half snapshots: the budget holds each back past the
    interval (throttled), and none waits for the floor."""
    cadences = [s.cadence for s in run(monkeypatch, 20.0, 0.005).socket.snapshots[1:]]
    assert len(cadences) > 20 and all(c.throttled for c in cadences)
    assert all(0.25 + 0.011 < c.gap_s < 1.0 for c in cadences), [c.gap_s for c in cadences]
