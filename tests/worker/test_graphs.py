"""Decode graphs (``worker.step.graphs``) on the CPU, whose adapter replays each captured function
eagerly on the same persistent buffers: the buckets and widths, which steps replay and which
run eagerly, padded rows that write only the trash block and are never sampled, the block
tables kept on the device, and tokens and logits equal to the eager path's."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams, StepItem
from tests.worker.conftest import make_worker
from tests.worker.driver import Driver, Request, greedy_requests
from worker.step import graphs as graphs_module
from worker.step.graph_adapters import EagerReplay

PROMPTS = [[1, 17, 42, 99, 3], [1, 200, 201, 5, 6, 7, 8, 9, 10], [1, 55], [1, 30, 31, 32, 33]]


def graph_worker(tiny_dir, **overrides):
    """The generic path (the code CUDA runs), whose plan captures decode graphs."""
    worker = make_worker(tiny_dir, generic_path=True, **overrides)
    assert worker.plan.compile == "cuda-graphs" and isinstance(worker.graphs.adapter, EagerReplay)
    return worker


def decode(slot: int, start: int) -> StepItem:
    return StepItem(request_id=f"r{slot}", slot=slot, new_blocks=[], token_ids=[7], start=start)


def test_buckets_are_the_padded_batch_sizes_and_every_key_is_captured(tiny_dir):
    worker = graph_worker(tiny_dir, num_slots=20)
    graphs = worker.graphs
    assert graphs.buckets == [1, 2, 3, 4, 8, 12, 16, 20]
    # block_size 4, max_model_len 512: the torch backend's 256 and 1024 tokens, capped at 512
    assert graphs.widths == [64, 128]
    assert set(graphs.adapter.bodies) == {(b, w) for b in graphs.buckets for w in (64, 128)}
    assert worker.decode_path == "graphs" and worker.ready().plan["compile"] == "cuda-graphs"


def test_which_steps_replay(tiny_dir):
    graphs = graph_worker(tiny_dir).graphs
    assert graphs.choose([decode(0, 10)]) == (1, 64)
    assert graphs.choose([decode(s, 10) for s in range(5)]) == (8, 64)
    assert graphs.choose([decode(0, 10), decode(1, 256)]) == (2, 128)  # 257 tokens
    assert graphs.choose([decode(0, 511)]) == (1, 128)
    prefill = StepItem(request_id="p", slot=1, new_blocks=[], token_ids=[7, 8], start=4)
    assert graphs.choose([decode(0, 10), prefill]) is None
    fresh = StepItem(request_id="f", slot=1, new_blocks=[0], token_ids=[7], start=0)
    assert graphs.choose([fresh]) is None
    assert graphs.choose([decode(s % 8, 10) for s in range(9)]) is None  # past 8 rows
    assert graphs.choose([]) is None


def test_padded_rows_write_only_the_trash_block_and_are_never_sampled(tiny_dir):
    """Five decoding rows replay the bucket of 8: the pool changes at each real row's new
    position and in the trash block, nowhere else, and five samples come back."""
    worker = graph_worker(tiny_dir)
    driver = Driver(worker, eos=[])
    requests = greedy_requests([[1, 2 + i, 3] for i in range(5)], 3)
    driver.step(requests, None, None)  # the prefills: eager
    assert worker.graphs.replays == 0
    before = worker.cache.pool.clone()
    rows = [worker.row_table.rows[r.slot] for r in requests]
    expected = {(row.block_table[3 // 4], 3 % 4) for row in rows}  # position 3, block size 4
    driver.step(requests, None, None)
    assert worker.graphs.replays == 1
    after = worker.cache.pool  # (layers, 2, n_kv, blocks + 1, block_size, hd)
    changed = (before != after) & ~(before.isnan() & after.isnan())
    where = changed.any(dim=(0, 1, 2, 5)).nonzero().tolist()  # (block, offset) pairs
    trash = worker.cache.trash_block
    assert {(b, o) for b, o in where if b != trash} == expected
    assert all(len(r.output) == 2 for r in requests)


def test_block_tables_follow_the_rows(tiny_dir):
    """A fresh row's line is its blocks, then its first block repeated; a decode joining a
    block writes it at its column; the trash row stays all trash."""
    worker = graph_worker(tiny_dir, num_slots=1)
    tables = worker.graphs.tables
    driver = Driver(worker, eos=[])
    # Slot 0; 7 prompt tokens in blocks 0 and 1 (block size 4), and a decode at position 8
    # joins block 2.
    driver.run([Request("r", list(range(1, 8)), 3)])
    assert tables.tables[0, :3].tolist() == [0, 1, 2]
    assert (tables.tables[0, 3:] == 0).all()
    assert (tables.tables[tables.trash_row] == worker.cache.trash_block).all()
    # The slot's next tenant (the driver hands out blocks 3.. next) refills the whole line.
    driver.run([Request("s", [1, 2], 1)])
    assert tables.tables[0, 0].item() == 3 and (tables.tables[0, 1:] == 3).all()


def run(worker, requests, **options):
    return Driver(worker, eos=[]).run(requests, **options)


def mixed_requests() -> list[Request]:
    """Greedy and seeded rows, with penalties, bias and logprobs."""
    sampled = SamplingParams(
        temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.3, logprobs=2, max_tokens=99
    )
    biased = SamplingParams(temperature=0.0, logit_bias={40: 3.0}, frequency_penalty=0.5)
    return [
        Request("g0", PROMPTS[0], 12),
        Request("s1", PROMPTS[1], 12, sampled),
        Request("b2", PROMPTS[2], 12, biased),
        Request("g3", PROMPTS[3], 12),
    ]


@pytest.mark.parametrize("scenario", ["batched", "chunked", "recompute"])
def test_graph_steps_equal_eager_steps(tiny_dir, scenario):
    options = {"batched": {}, "chunked": {"chunk": 3}, "recompute": {"recompute_after": 4}}
    graphed = graph_worker(tiny_dir)
    eager = make_worker(tiny_dir, generic_path=True, enforce_eager=True)
    assert eager.graphs is None and eager.plan.compile == "eager"
    ours = run(graphed, mixed_requests(), **options[scenario])
    theirs = run(eager, mixed_requests(), **options[scenario])
    assert graphed.graphs.replays > 0
    for a, b in zip(ours, theirs, strict=True):
        assert a.output == b.output, a.request_id
        assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), atol=1e-6)
        assert [s.logprob for s in a.samples] == pytest.approx([s.logprob for s in b.samples])


def test_rows_wider_than_every_graph_run_eagerly(tiny_dir, monkeypatch):
    """With graphs only 16 tokens wide, a decode past 16 tokens runs eagerly, and its tokens
    are still the eager worker's."""
    monkeypatch.setitem(graphs_module.GATHERED_CONTEXTS, "torch", (16,))
    graphed = graph_worker(tiny_dir)
    assert graphed.graphs.widths == [4]
    prompts = [[1, 2, 3], list(range(1, 16))]
    ours = run(graphed, greedy_requests(prompts, 6))
    assert graphed.graphs.replays == 1  # the long row's first decode fits 16 tokens; no later
    theirs = run(make_worker(tiny_dir, generic_path=True, enforce_eager=True),
                 greedy_requests(prompts, 6))  # fmt: skip
    assert [r.output for r in ours] == [r.output for r in theirs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_tokens_equal_eager_tokens_on_cuda(tiny_dir, dtype):
    """Captured CUDA graphs, replayed: the tokens of the eager CUDA path."""
    from worker.step.graph_adapters import CudaGraphs

    graphed = make_worker(tiny_dir, device="cuda", dtype=dtype)
    assert graphed.plan.compile == "cuda-graphs" and isinstance(graphed.graphs.adapter, CudaGraphs)
    eager = make_worker(tiny_dir, device="cuda", dtype=dtype, enforce_eager=True)
    ours, theirs = run(graphed, mixed_requests()), run(eager, mixed_requests())
    assert graphed.graphs.replays > 0 and graphed.graphs.capture_bytes is not None
    assert [r.output for r in ours] == [r.output for r in theirs]
