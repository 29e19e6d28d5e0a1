"""Compiled decode steps (``--compile``) on the seeded tiny Llama: the same greedy tokens and
logits as transformers in float32, in every batching scenario, with the pool NaN-poisoned so a
read of anything the step should not touch would show; and which steps run compiled."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_logits, make_worker
from driver import Driver, greedy_requests
from test_tiny_exact import LOGIT_TOL, PROMPTS, check, reference


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    return reference(tiny_dir)


@pytest.fixture(scope="module")
def compiled_worker(tiny_dir):
    """One compiled worker for the module: compiling takes tens of seconds."""
    worker = make_worker(tiny_dir, compile=True)
    assert worker.compiled.steps == 3  # warm-up: batches 1, 2 and MAX_BATCH
    # Every step below must find a graph the warm-up built: a recompile raises.
    worker.compiled.stance = "fail_on_recompile"
    return worker


@pytest.mark.parametrize("scenario", ["alone", "batched", "chunked", "recompute"])
def test_compiled_matches_transformers(compiled_worker, tiny_reference, scenario):
    model, expected = tiny_reference
    before = compiled_worker.compiled.steps
    check(compiled_worker, model, expected, scenario)
    # Most decode steps ran compiled (four prompts: every decode-only step has <= 4 rows).
    assert compiled_worker.compiled.steps - before >= 15


def test_bigger_decode_batches_and_mixed_steps_stay_eager(
    compiled_worker, tiny_reference, monkeypatch
):
    model, _ = tiny_reference
    monkeypatch.setattr("worker.compiled.MAX_BATCH", 4)  # the tiny worker has only 8 slots
    prompts = PROMPTS + [[1, 9, 8, 7], [1, 3]]  # six rows, padded to 8: above the limit
    driver = Driver(compiled_worker)
    before = compiled_worker.compiled.steps
    requests = driver.run(greedy_requests(prompts, 6))
    for req in requests:
        ref = hf_logits(model, req.known[:-1])[len(req.prompt) - 1 :]
        assert (torch.stack(req.logits) - ref).abs().max().item() < LOGIT_TOL
    # All six prefill together, then decode together: nothing here is small enough.
    assert compiled_worker.compiled.steps == before


def test_a_step_no_graph_covers_runs_eagerly_or_fails_in_tests(compiled_worker):
    compiled = compiled_worker.compiled
    with torch.inference_mode():
        ids, positions, meta = compiled.trash_step(3)
        compiled.stance = "default"
        covered = compiled(ids, positions, meta)
        ids32 = ids.to(torch.int32)  # dynamo guards on dtypes: no warm-up graph covers this
        try:
            compiled.stance = "eager_on_recompile"  # how the worker serves
            eager = compiled(ids32, positions, meta)
            compiled.stance = "fail_on_recompile"
            with pytest.raises(RuntimeError, match="[Rr]ecompil"):
                compiled(ids32, positions, meta)
        finally:
            compiled.stance = "fail_on_recompile"
    assert torch.allclose(covered, eager, atol=1e-5)


def test_bfloat16_compiled_stays_close_to_eager(tiny_dir):
    eager = make_worker(tiny_dir, dtype="bfloat16")
    compiled = make_worker(tiny_dir, dtype="bfloat16", compile=True)
    compiled.compiled.stance = "fail_on_recompile"
    runs = []
    for worker in (eager, compiled):
        requests = greedy_requests(PROMPTS[:2], 12)
        for req in requests:  # both runs feed the same tokens, whatever each one samples
            req.forced = list(range(40, 52))
        runs.append(Driver(worker).run(requests))
    assert compiled.compiled.steps > 3
    for ours, theirs in zip(*runs, strict=True):
        # bfloat16 rounds in other places when fused (the attention here runs in float32).
        assert (torch.stack(ours.logits) - torch.stack(theirs.logits)).abs().max().item() < 0.1


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "from-cache"])
def test_a_worker_serves_eagerly_until_its_graphs_are_built_beside_it(
    tiny_dir, tiny_reference, compiled_worker, cold
):
    """Background compile: the first steps run eagerly while the graphs are built (cold: in a
    child process at the lowest priority, then loaded; warm: only loaded), the worker switches
    without a restart, and the tokens are transformers' throughout."""
    from protocol.model_files import resolve_model
    from worker.compiling import compile_dir
    from worker.config import WorkerConfig
    from worker.worker import Worker

    model, expected = tiny_reference
    # Each case its own cache key, told apart by q4_max_tokens (the tiny float32 model has no
    # 4-bit weights to use it). Warm: the module's compiled worker (make_worker's settings)
    # filled and marked this cache. Cold: a key nobody compiled.
    config = WorkerConfig(
        model=str(tiny_dir), block_size=4, num_blocks=256, num_slots=8, dtype="float32",
        q4_max_tokens=3 if cold else 8, compile=True,
    )  # fmt: skip
    marker = compile_dir(config, resolve_model(str(tiny_dir)).model_id) / "compiled.ok"
    assert marker.exists() is not cold
    worker = Worker(config, progress=False, background_compile=True)
    assert worker.compile_job.cold is cold and worker.decode_path == "compiling"
    check(worker, model, expected, "batched")  # served now, whatever the job's progress
    if cold:  # the child takes tens of seconds: those steps ran eagerly
        assert worker.compiled is None
    assert worker.compile_job.wait(600), worker.compile_job.error
    assert marker.exists() and worker.decode_path == "compiled"
    # The worker only loaded what the child (cold) or an earlier worker built: a graph it had
    # to compile again would have left inductor files newer than the marker.
    marker_time = marker.stat().st_mtime
    newer = [f for f in marker.parent.rglob("*") if f.is_file() and f.stat().st_mtime > marker_time]
    assert not [f for f in newer if "locks" not in f.parts], newer
    check(worker, model, expected, "batched")  # the first step adopts the graphs
    assert worker.compiled is not None and worker.compiled.steps > 3
