"""With the real default model: greedy text is the same whatever the pool size (roomy to
thrashing hard), with overlap or without, and the same as each request run alone. One worker
serves every pool size."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "Once upon a time there was a small robot who",
]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker():
    from worker.config import WorkerConfig
    from worker.worker import Worker

    config = WorkerConfig(
        dtype="float32", compile=False, block_size=4, num_blocks=48, num_slots=4, seed=0
    )
    return Worker(config, progress=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from nanoserve.commands.generate import load_tokenizer

    tokenizer = load_tokenizer(None)
    return [tokenizer.encode(t) for t in TEXTS]


def _run(
    worker, prompts, num_blocks: int, num_slots: int, budget: int, overlap: bool = True
) -> tuple[list, int]:
    config = SchedulerConfig(
        overlap=overlap,
        num_blocks=num_blocks,
        num_slots=num_slots,
        token_budget=budget,
        watermark_blocks=0,
        audit=True,
    )
    engine = Engine.for_worker(worker, config)
    outs = engine.generate(prompts, PARAMS)
    step = engine.plan()  # deliver the final releases so the next engine finds empty rows
    if step is not None:
        engine.apply(worker.execute(step))
    engine.audit(worker.rows())
    return [o.new_token_ids for o in outs], engine.scheduler.num_preemptions_total


def test_greedy_text_is_independent_of_pool_size_and_batching(worker, prompts) -> None:
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    roomy, evicted = _run(worker, prompts, num_blocks=48, num_slots=4, budget=256)
    assert evicted == 0
    thrash_blocks = -(-longest // 4) + 1
    thrash, evicted = _run(worker, prompts, num_blocks=thrash_blocks, num_slots=3, budget=5)
    assert evicted > 0, "the small pool was meant to preempt"
    assert thrash == roomy
    alone = [
        _run(worker, [p], num_blocks=48, num_slots=1, budget=256, overlap=False)[0][0]
        for p in prompts
    ]
    assert alone == roomy


def test_speculation_beside_structured_outputs_changes_no_token(worker, prompts) -> None:
    """The real model, float32: requests that draft (their prompts repeat themselves) run in the
    same steps as requests under a grammar, which never draft; every token is what it is with
    speculation off, the constrained ones still match their grammar."""
    import re

    import llguidance

    line = "the cat sat on the mat and the dog sat on the log. "
    repeating = [prompts[0] + prompts[0] + prompts[0], prompts[3] * 3]
    from nanoserve.commands.generate import load_tokenizer

    repeating.append(load_tokenizer(None).encode(line * 4))
    words = r"[a-z]+( [a-z]+){3,7}\."
    constrained = SamplingParams(
        max_tokens=16, temperature=0.0, grammar=llguidance.grammar_from("regex", words)
    )
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batch = [*repeating, prompts[1], prompts[2]]
    params = [free, free, free, constrained, constrained]
    outs = {}
    for spec in ("off", "ngram"):
        config = SchedulerConfig(
            speculative=spec, num_blocks=48, token_budget=256, watermark_blocks=0, audit=True
        )
        engine = Engine.for_worker(worker, config)
        outs[spec] = [o.new_token_ids for o in engine.generate(batch, params)]
        step = engine.plan()
        if step is not None:
            engine.apply(worker.execute(step))
        engine.audit(worker.rows())
        if spec == "ngram":
            assert engine.scheduler.speculation.accepted_total > 0
    assert outs["ngram"] == outs["off"]
    tokenizer = load_tokenizer(None).tokenizer
    for tokens in outs["ngram"][3:]:
        text = tokenizer.decode([t for t in tokens if t not in worker.eos_token_ids])
        assert re.fullmatch(r"[a-z ]+\.?", text), text  # the grammar's alphabet, at least
