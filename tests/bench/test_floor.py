"""``bench forward --profile``'s floor (``nanoserve.bench.floor``): the memory bandwidth it
divides by is measured on the worker's plan's device, by that device's entry of ``BANDWIDTH``
(a read on CPU, a device-to-device copy on CUDA), and never by asking torch which device there
is. The CUDA measure itself needs a GPU: the GPU check (scripts/gpu_check.sh) reports it."""

from __future__ import annotations

import pytest

from nanoserve.bench import floor, forward
from tests.tiny_model import make_tiny_llama


def test_the_cpu_measure_reads_memory():
    assert (
        floor.read_bandwidth("cpu", repeats=1) > 1e8
    )  # bytes a second: any machine reads 100 MB/s


def test_the_device_names_the_measure(monkeypatch):
    asked = []
    monkeypatch.setitem(
        floor.BANDWIDTH, "cuda", (lambda repeats: asked.append(repeats) or 4.3e12, "copy")
    )
    assert floor.read_bandwidth("cuda", repeats=2) == 4.3e12 and asked == [2]
    with pytest.raises(ValueError, match="no bandwidth measure for device 'tpu'"):
        floor.read_bandwidth("tpu")


def test_bench_forward_measures_once_on_the_plans_device(tmp_path, monkeypatch):
    devices = []
    monkeypatch.setattr(forward, "read_bandwidth", lambda device: devices.append(device) or 1e10)
    rows = forward.bench_forward(
        model=str(make_tiny_llama(tmp_path / "tiny")),
        dtypes=["float32"],
        batch_sizes=[1, 2],
        context=8,
        decode_steps=2,
        num_threads=1,
        profile=True,
    )
    assert devices == ["cpu"]  # the plan's, once for every row
    assert [row.floor.bandwidth for row in rows] == [1e10, 1e10]
    assert {row.floor.measured for row in rows} == {"a 512 MiB read"}
    assert "| floor at 10.0 GB/s (a 512 MiB read) |" in forward.format_breakdown(rows)
