"""The monitor's rate: snapshots cost at most ``budget`` of the scheduler's own CPU since the
page opened, at most one per ``interval_s``, and at least one per ``max_gap_s``."""

from __future__ import annotations

import pytest

from scheduler import monitor as monitor_module
from scheduler.monitor import Monitor

SNAPSHOT_S = 100e-6  # what each snapshot costs here


class Workers:
    """The scheduler's side as the monitor reads it: its busy CPU, and never a step to send."""

    busy_s = 0.0

    def can_step(self) -> bool:
        return False


def run(monkeypatch: pytest.MonkeyPatch, seconds: float, busy_per_s: float) -> Monitor:
    """``seconds`` of the scheduler's loop (a turn every 10 ms) that is busy ``busy_per_s``."""
    workers = Workers()
    monitor = Monitor(object(), None, workers, interval_s=0.25, budget=0.03, max_gap_s=1.0)
    monitor.topics.add(b"")  # a page watches (from the start: nothing spent, nothing allowed)

    def publish() -> None:
        monitor.busy_s += SNAPSHOT_S
        monitor.sent += 1

    monitor.publish = publish
    now = [1000.0]
    monkeypatch.setattr(monitor_module.time, "monotonic", lambda: now[0])
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
