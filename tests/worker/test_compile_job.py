"""Steps beside the graphs' loading (``worker.compiled.background``): the job says when its thread
loads, and a step meanwhile runs on a short switch interval, so that it gets the GIL back from the
loader's tracing at once rather than after 5 ms at each of its operators."""

from __future__ import annotations

import logging
import sys
import types

import pytest

import worker.compiled.decode
from worker.compiled.background import _MARKER, STEP_SWITCH_INTERVAL, BackgroundCompile, step_first


class _Graphs:
    """Stands in for ``CompiledDecode``: records whether the job said it was loading while its
    graphs were traced."""

    seen: list[bool] = []
    job: BackgroundCompile | None = None

    def __init__(self, model, cache, attention) -> None:
        pass

    def warm_up(self) -> None:
        _Graphs.seen.append(_Graphs.job.loading)


def test_the_job_is_loading_exactly_while_its_thread_traces_the_graphs(tmp_path, monkeypatch):
    (tmp_path / _MARKER).write_text("0\n")  # a filled cache: load only, no child
    monkeypatch.setattr(worker.compiled.decode, "CompiledDecode", _Graphs)
    host = types.SimpleNamespace(model=None, cache=None, attention=None)
    job = BackgroundCompile(host, tmp_path)
    _Graphs.job, _Graphs.seen = job, []
    assert not job.cold and not job.loading
    job.start()
    assert job.wait(60), job.error
    assert _Graphs.seen == [True]
    assert not job.loading and isinstance(job.result, _Graphs)


def test_the_job_says_its_graphs_are_ready_without_waiting_for_a_step(
    tmp_path, monkeypatch, caplog
):
    (tmp_path / _MARKER).write_text("0\n")
    monkeypatch.setattr(worker.compiled.decode, "CompiledDecode", _Graphs)
    host = types.SimpleNamespace(model=None, cache=None, attention=None)
    job = BackgroundCompile(host, tmp_path)
    _Graphs.job, _Graphs.seen = job, []
    with caplog.at_level(logging.INFO, logger="nanoserve.worker"):
        job.start()
        assert job.wait(60), job.error
    ready = [r.getMessage() for r in caplog.records if "ready" in r.getMessage()]
    assert len(ready) == 1 and "loaded from the cache" in ready[0], ready


def test_a_step_beside_the_loading_runs_on_the_short_switch_interval():
    usual = sys.getswitchinterval()
    loading = types.SimpleNamespace(loading=True)
    with step_first(loading):
        assert sys.getswitchinterval() == pytest.approx(STEP_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == usual
    with pytest.raises(ValueError, match="refused"), step_first(loading):
        raise ValueError("step refused")
    assert sys.getswitchinterval() == usual  # an error leaves the usual interval too
    for job in (None, types.SimpleNamespace(loading=False)):
        with step_first(job):
            assert sys.getswitchinterval() == usual
