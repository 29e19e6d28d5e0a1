"""Compiled decode steps (``--compile``) on the seeded tiny Llama: the same greedy tokens and
logits as transformers in float32, in every batching scenario, with the pool NaN-poisoned so a
read of anything the step should not touch would show; and which steps run compiled."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.worker.conftest import hf_logits, make_worker
from tests.worker.driver import Driver, greedy_requests
from tests.worker.test_tiny_exact import LOGIT_TOL, PROMPTS, check, reference

# The module's one compile runs in a child at nice 19, as the worker runs it. Beside the suite's
# other test process it got only the CPU that process left: 200 s where alone it took 60.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    return reference(tiny_dir)


def _config(tiny_dir):
    """make_worker's settings, compiled, under a cache key of this module's own (told apart by
    q4_max_tokens, which the tiny float32 model has no 4-bit weights to use): no other module's
    compile can have made it warm."""
    from worker.config import WorkerConfig

    return WorkerConfig(
        model=str(tiny_dir), block_size=4, num_blocks=256, num_slots=8, dtype="float32",
        q4_max_tokens=3, compile=True,
    )  # fmt: skip


def _plan(tiny_dir):
    """The plan a worker of ``_config`` runs here (the tiny model: 4 heads of 16, 2 KV)."""
    from worker.plan import resolve

    return resolve(
        _config(tiny_dir), device="cpu", dtype="float32", head_dim=16, n_heads=4, n_kv_heads=2,
        q4={},
    )  # fmt: skip


def _marker(tiny_dir) -> Path:
    from models.files import resolve_model
    from worker.compiled.background import compile_dir

    model_id = resolve_model(str(tiny_dir)).model_id
    return compile_dir(_config(tiny_dir), _plan(tiny_dir), model_id) / "compiled.ok"


class BuiltBeside(NamedTuple):
    """A worker whose graphs were built beside its first steps, and what was seen meanwhile."""

    worker: object
    cold: bool  # nothing was cached when it started
    first_path: str  # its decode path at start
    eager_meanwhile: bool  # its first steps ran while the graphs were still being built


@pytest.fixture(scope="module")
def built_beside(tiny_dir, tiny_reference) -> BuiltBeside:
    """The module's one compile (tens of seconds): a worker serves eagerly while a child at
    the lowest priority builds its graphs cold, then loads them. Its steps are checked against
    transformers meanwhile; the tests below use its graphs."""
    from worker.worker import Worker

    model, expected = tiny_reference
    cold = not _marker(tiny_dir).exists()
    worker = Worker(_config(tiny_dir), progress=False, background_compile=True)
    # Poison the pool: a read of a position that was never written turns the logits into NaN.
    worker.cache.pool.fill_(float("nan"))
    first_path = worker.decode_path
    check(worker, model, expected, "batched")  # served now, whatever the job's progress
    eager_meanwhile = worker.compiled is None
    assert worker.compile_job.wait(600), worker.compile_job.error
    return BuiltBeside(worker, cold and worker.compile_job.cold, first_path, eager_meanwhile)


@pytest.fixture(scope="module")
def compiled_worker(built_beside):
    """The module's compiled worker, once it has adopted its graphs."""
    worker = built_beside.worker
    assert worker._compiled() is not None
    assert worker.compiled.steps == 3  # its warm-up: batches 1, 2 and MAX_BATCH
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


@pytest.mark.kernels("avx2")
def test_compiled_float32_decodes_read_the_pool_in_nanoserves_operator(compiled_worker):
    """The graphs trace ``decode_attention_f32`` (its fake gives the shape) and call it, once a
    layer (the profiler sees the dispatcher's calls, from a graph too)."""
    compiled = compiled_worker.compiled
    before = compiled.steps
    with torch.inference_mode():
        ids, positions, meta = compiled.trash_step(3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            compiled(ids, positions, meta)
    calls = sum(1 for event in profile.events() if event.name == "nanoserve::decode_attention_f32")
    assert compiled.steps == before + 1 and calls == compiled_worker.spec.num_layers


def test_a_thread_count_switch_keeps_the_steps_compiled(compiled_worker, tiny_reference):
    """Beside a neighbour the worker drops to one thread (``worker.cpu.threads``) and comes back:
    the same graphs run on either count. A guard on torch's thread count would make the first step
    after a switch recompile, which raises here, and in serving sends every step to eager."""
    model, expected = tiny_reference
    full = torch.get_num_threads()
    try:
        for threads in (1, full + 1):
            torch.set_num_threads(threads)
            before = compiled_worker.compiled.steps
            check(compiled_worker, model, expected, "batched")
            assert compiled_worker.compiled.steps - before >= 15, threads
    finally:
        torch.set_num_threads(full)


def test_verification_steps_run_compiled_with_transformers_greedy_tokens(
    compiled_worker, monkeypatch
):
    """A request's token and its drafts are one group of decode rows (causal within itself,
    in the decode attention operator), so a step that verifies drafts runs in the same graphs:
    greedy output with drafts is transformers' token for token, and the steps that carried
    drafts ran compiled, their logits compared in float32."""
    from protocol.messages import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from tests.worker.conftest import hf_greedy, hf_model

    worker = compiled_worker
    # Prompts that repeat themselves (and the tiny model's greedy loops): drafts are found.
    prompts = [[1] + [40 + i, 41 + i, 42 + i, 43 + i] * 3 for i in range(3)] + [[1, 55]]
    model = hf_model(Path(worker.config.model))
    expected = [hf_greedy(model, p, 24, [2]) for p in prompts]
    config = dict(speculative="ngram", num_speculative_tokens=4, audit=True, watermark_blocks=0)
    engine = Engine.for_worker(worker, SchedulerConfig(**config))
    compiled, launched = worker.compiled.steps, []
    kind = type(worker.compiled)
    original = kind.__call__

    def counted(self, ids, positions, meta):
        """Whether each compiled step had a group of more than one row."""
        launched.append(int(meta.decodes.first.ne(torch.arange(len(ids))).any()))
        return original(self, ids, positions, meta)

    monkeypatch.setattr(kind, "__call__", counted)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    monkeypatch.undo()
    step = engine.plan()
    if step is not None:
        engine.apply(worker.execute(step))
    assert [o.new_token_ids for o in outs] == expected
    assert engine.scheduler.speculation.accepted_total > 0
    assert sum(launched) >= 3 and worker.compiled.steps - compiled == len(launched), launched


def test_bigger_decode_batches_and_mixed_steps_stay_eager(
    compiled_worker, tiny_reference, monkeypatch
):
    model, _ = tiny_reference
    monkeypatch.setattr("worker.compiled.decode.MAX_BATCH", 4)  # the tiny worker has only 8 slots
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


def test_a_worker_serves_eagerly_until_its_graphs_are_built_beside_it(
    built_beside, compiled_worker, tiny_dir, tiny_reference
):
    """Background compile, cold: the first steps ran eagerly while a child built the graphs
    (``built_beside``), the worker switched without a restart, and its tokens are
    transformers' throughout."""
    model, expected = tiny_reference
    assert built_beside.cold and built_beside.first_path == "compiling"
    assert built_beside.eager_meanwhile  # the child takes tens of seconds
    worker = built_beside.worker
    assert _marker(tiny_dir).exists() and worker.decode_path == "compiled"
    _assert_only_loaded(tiny_dir)
    before = worker.compiled.steps
    check(worker, model, expected, "batched")
    assert worker.compiled.steps > before


def test_a_worker_started_on_a_filled_cache_only_loads_its_graphs(
    built_beside, tiny_dir, tiny_reference
):
    """From the cache: a later worker (a restart, the next start) finds the marker, serves
    eagerly for the seconds loading takes, and switches."""
    from worker.worker import Worker

    model, expected = tiny_reference
    assert _marker(tiny_dir).exists()
    worker = Worker(_config(tiny_dir), progress=False, background_compile=True)
    assert not worker.compile_job.cold and worker.decode_path == "compiling"
    check(worker, model, expected, "batched")
    assert worker.compile_job.wait(600), worker.compile_job.error
    assert worker.decode_path == "compiled"
    _assert_only_loaded(tiny_dir)
    check(worker, model, expected, "batched")  # the first step adopts the graphs
    assert worker.compiled is not None and worker.compiled.steps > 3


def test_loading_traces_one_decoder_layer_per_graph_and_reuses_it(built_beside, tiny_dir):
    """Dynamo traces the first layer of each graph and stamps that trace out for the others
    (``_decoder_layer``): a load traces 2 layers for the two graphs, not every layer twice."""
    from torch._dynamo.utils import compilation_time_metrics as timed

    from worker.worker import Worker

    def count(event: str) -> int:
        return len(timed.get(event, []))

    traced, reused = count("invoke_subgraph_trace"), count("invoke_subgraph_reuse_stamp_out")
    worker = Worker(_config(tiny_dir), progress=False, background_compile=True)
    assert worker.compile_job.wait(600), worker.compile_job.error
    layers = len(worker.model.model.layers)
    assert layers > 1
    assert count("invoke_subgraph_trace") - traced == 2
    assert count("invoke_subgraph_reuse_stamp_out") - reused == 2 * (layers - 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cache_key_hashes_every_worker_file_the_graph_traces(tiny_dir, dtype):
    """The graphs' cache directory is keyed by the source of ``_TRACED``: a traced file left out
    would let a changed step load stale graphs' keys and compile in the worker. Every worker
    file that a node of the traced graph comes from is in it (float32 takes the torch backend,
    bfloat16 the CPU kernels where they run)."""
    import re

    import worker.compiled.decode as compiled
    from worker.compiled.background import _TRACED

    worker = make_worker(tiny_dir, dtype=dtype)
    files: set[Path] = set()

    def record(graph_module, example_inputs):
        for module in graph_module.modules():  # subgraphs too, if any were left
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    trace = node.meta.get("stack_trace") or ""
                    files.update(Path(f) for f in re.findall(r'File "([^"]+)"', trace))
        return graph_module.forward

    step = compiled.CompiledDecode(worker.model, worker.cache, worker.attention)
    step._graph = torch.compile(compiled._decode_graph, backend=record, fullgraph=True)
    with torch.inference_mode(), torch._dynamo.config.patch(inline_invoke_subgraph=True):
        step(*step.trash_step(2))
    root = Path(compiled.__file__).resolve().parents[1]  # the worker package
    traced = {f.relative_to(root).as_posix() for f in files if f.is_relative_to(root)}
    assert "model/llama.py" in traced and "compiled/decode.py" in traced
    assert traced <= set(_TRACED), f"traced but not hashed: {sorted(traced - set(_TRACED))}"


def _assert_only_loaded(tiny_dir) -> None:
    """The workers only loaded what the child built: a graph one had to compile again would
    have left inductor files newer than the marker."""
    marker = _marker(tiny_dir)
    marker_time = marker.stat().st_mtime
    newer = [f for f in marker.parent.rglob("*") if f.is_file() and f.stat().st_mtime > marker_time]
    assert not [f for f in newer if "locks" not in f.parts], newer


def test_the_cache_key_names_where_torch_is_installed(tiny_dir, monkeypatch):
    """Another venv's torch, even of the same version, gets a cache of its own: inductor's C++
    builds are keyed by a command line that names torch's include directory."""
    from worker.compiled.background import compile_dir

    config, plan = _config(tiny_dir), _plan(tiny_dir)
    here = compile_dir(config, plan, "m")
    assert compile_dir(config, plan, "m") == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    assert compile_dir(config, plan, "m") != here
