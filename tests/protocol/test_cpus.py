"""nanoserve.cpus: the frontend and the scheduler move onto the last CPU of their affinity mask,
threads already started included, and stay put where the mask has one CPU; several frontends
take a CPU each below the scheduler's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nanoserve.cpus import frontend_offset

# Runs in a process of its own (the test process must keep its CPUs): starts a thread, pins,
# starts another, and reports every thread's CPUs and what pin_to_last_cpu returned.
_CHILD = """
import json, logging, os, sys, threading
from nanoserve.cpus import pin_to_last_cpu
os.sched_setaffinity(0, set(json.loads(sys.argv[1])))
release = threading.Event()
before = threading.Thread(target=release.wait)
before.start()
pinned = pin_to_last_cpu(logging.getLogger("test"))
after = threading.Thread(target=release.wait)
after.start()
threads = {
    name: sorted(os.sched_getaffinity(thread.native_id))
    for name, thread in (("before", before), ("after", after))
}
threads["main"] = sorted(os.sched_getaffinity(0))
release.set()
print(json.dumps({"pinned": pinned, "threads": threads}))
"""


def _pin_in_child(cpus: list[int], child: str = _CHILD) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", child, json.dumps(cpus)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    return json.loads(done.stdout)


needs_two = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process that may use two CPUs",
)


@needs_two
def test_every_thread_moves_to_the_last_cpu_of_the_mask():
    first, last = sorted(os.sched_getaffinity(0))[:2]
    report = _pin_in_child([first, last])
    assert report["pinned"] == last
    assert report["threads"] == {"before": [last], "after": [last], "main": [last]}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_one_cpu_is_left_as_it_is():
    only = min(os.sched_getaffinity(0))
    report = _pin_in_child([only])
    assert report["pinned"] is None
    assert report["threads"] == {"before": [only], "after": [only], "main": [only]}


@pytest.mark.parametrize(
    "count, num_cpus, offsets",
    [
        (1, 16, [0]),  # one frontend: the last CPU, beside the scheduler
        (4, 16, [1, 2, 3, 4]),  # several: the CPUs below the scheduler's
        (2, 4, [1, 2]),  # the worker keeps CPU 0
        (2, 3, [0, 1]),  # too few to leave the worker one: down from the last
        (3, 2, [0, 1, 0]),  # fewer CPUs than frontends: wrapping
    ],
)
def test_several_frontends_spread_over_the_cpus_below_the_schedulers(count, num_cpus, offsets):
    assert [frontend_offset(i, count, num_cpus) for i in range(count)] == offsets


@needs_two
def test_a_frontend_pins_the_cpu_its_offset_names():
    first, last = sorted(os.sched_getaffinity(0))[:2]
    child = _CHILD.replace('getLogger("test"))', 'getLogger("test"), from_last=1)')
    report = _pin_in_child([first, last], child)
    assert report["pinned"] == first
    assert report["threads"] == {"before": [first], "after": [first], "main": [first]}
