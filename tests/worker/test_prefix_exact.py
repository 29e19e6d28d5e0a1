"""Prefix caching on the real worker (tiny seeded Llama, float32, the pool poisoned with NaN):
requests that start on cached blocks give transformers' own greedy tokens, the blocks they share
are never written, and the worker refuses hits it cannot honour."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams, StepInput, StepItem
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from tests.worker.conftest import hf_greedy, hf_model, make_worker

STEM = [1] + list(range(40, 60))  # 21 tokens: 5 full blocks of 4
PROMPTS = [STEM + [7, 8, 9], STEM + [200, 201], STEM[:9] + [77], STEM, STEM + [7, 8, 9]]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _engine(worker, caching: bool = True) -> Engine:
    config = SchedulerConfig(token_budget=64, audit=True, enable_prefix_caching=caching)
    return Engine.for_worker(worker, config)


def test_hits_give_transformers_tokens(tiny_dir):
    model = hf_model(tiny_dir)
    expected = [hf_greedy(model, p, MAX_NEW, [2]) for p in PROMPTS]
    worker = make_worker(tiny_dir)
    engine = _engine(worker)
    cached = []
    for prompt, want in zip(PROMPTS, expected, strict=True):  # one after another: each hits
        (out,) = engine.generate([prompt], GREEDY)
        assert out.new_token_ids == want
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0 and cached[1] == 20 and cached[2] == 8 and cached[4] == 20
    assert cached[3] == 20  # the stem alone: its last block is computed again, for the logits
    together = engine.generate(PROMPTS, GREEDY)  # batched, hits and fresh rows in one step
    assert [o.new_token_ids for o in together] == expected


def test_penalties_see_the_cached_prompt(tiny_dir):
    """The worker's history of a row that starts on cached blocks still holds its whole prompt
    (repetition_penalty reads it): the penalized text is the same with and without the hit."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.5)
    texts = []
    for caching in (False, True):
        engine = _engine(make_worker(tiny_dir), caching)
        first, again = (engine.generate([STEM + [5]], params)[0] for _ in range(2))
        assert again.num_cached_tokens == (20 if caching else 0)
        texts.append((first.new_token_ids, again.new_token_ids))
    assert texts[0] == texts[1] and texts[0][0] == texts[0][1]


def test_shared_blocks_are_never_written(tiny_dir):
    worker = make_worker(tiny_dir)
    engine = _engine(worker)
    engine.generate([STEM], GREEDY)
    blocks = sorted(engine.scheduler.allocator.cached_blocks)  # the stem's 5 full blocks, and more
    before = worker.cache.pool[:, :, :, blocks].clone()
    outs = engine.generate([STEM + [9, 9], STEM + [8]], GREEDY)
    assert all(o.num_cached_tokens == 20 for o in outs)
    assert torch.equal(worker.cache.pool[:, :, :, blocks], before)


def _fresh(start: int, blocks: list[int], cached: list[int]) -> StepInput:
    item = StepItem(
        request_id="x",
        slot=0,
        new_blocks=blocks,
        token_ids=[5],
        start=start,
        params=GREEDY,
        prompt_len=start + 1,
        fresh=True,
        cached_token_ids=cached,
    )
    return StepInput(step_id=0, items=[item])


@pytest.mark.parametrize(
    "start, blocks, cached, match",
    [
        (4, [0, 1], [1, 2, 3, 4], "cache hits on blocks \\[0\\] this worker never wrote"),
        (3, [0, 1], [1, 2, 3], "starts after whole cached blocks"),
        (4, [0, 1], [1, 2, 3], "starts after whole cached blocks"),
    ],
)
def test_the_worker_refuses_hits_it_cannot_honour(tiny_dir, start, blocks, cached, match):
    worker = make_worker(tiny_dir)
    with pytest.raises(ValueError, match=match):
        worker.execute(_fresh(start, blocks, cached))
    assert all(row.request_id is None for row in worker.rows())
