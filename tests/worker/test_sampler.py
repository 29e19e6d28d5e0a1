"""The sampler's filters and penalties against direct computations on known logits, and seeded
draws that do not depend on the rest of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.messages import SamplingParams
from tests.worker.conftest import make_worker
from tests.worker.driver import Driver, Request
from worker.rows import Row
from worker.sampling.sampler import Sampler, filtered_probs


def row(history=(), prompt_len=0, seed=7, **params) -> Row:
    return Row("r", [], 0, SamplingParams(**params), prompt_len, list(history), seed)


def direct_filter(logits: list[float], top_k, top_p, min_p) -> dict[int, float]:
    """The filters written out plainly: token -> renormalized probability."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    if top_k is not None:
        order = order[:top_k]

    def softmax(tokens):
        z = sum(math.exp(logits[t]) for t in tokens)
        return {t: math.exp(logits[t]) / z for t in tokens}

    probs, kept, mass = softmax(order), [], 0.0
    for t in order:
        if mass < top_p or not kept:
            kept.append(t)
        mass += probs[t]
    probs = softmax(kept)
    best = max(probs.values())
    return softmax([t for t in kept if probs[t] >= min_p * best])


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(None, 1.0, 0.0), (3, 1.0, 0.0), (None, 0.6, 0.0), (None, 1.0, 0.2), (5, 0.8, 0.05)],
)
def test_filters_match_direct_computation(top_k, top_p, min_p):
    logits = [2.0, 1.5, 0.3, -1.0, 0.9, 3.1, -0.2, 1.1, 0.0, 2.2]
    probs, order = filtered_probs(
        torch.tensor([logits]), top_k=[top_k], top_p=[top_p], min_p=[min_p]
    )
    ours = {int(t): float(p) for t, p in zip(order[0], probs[0], strict=True) if p > 0}
    want = direct_filter(logits, top_k, top_p, min_p)
    assert ours.keys() == want.keys()
    for token, p in want.items():
        assert ours[token] == pytest.approx(p, abs=1e-6)


def test_penalties_bias_and_min_tokens():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, 2.0]])
    sampler = Sampler(eos_token_ids=[4])
    r = row(
        history=[0, 1, 2, 2, 1],
        prompt_len=2,
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={3: 10.0},
        min_tokens=4,
    )
    scores = logits[0].clone()
    sampler._adjust(scores, r)
    # outputs are [2, 2, 1]: repetition over prompt+output {0, 1, 2}; presence/frequency on output
    want = [1.0 / 2, -2.0 * 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.5, 0.5 + 10.0, float("-inf")]
    assert scores.tolist() == pytest.approx(want)
    assert sampler.sample(logits, [r])[0].token_id == 3


def test_penalties_follow_a_growing_history_step_by_step():
    """The running penalty counts fold in only new tokens; each step must still equal the
    penalties computed from the whole history afresh."""
    params = dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3)
    logits = torch.tensor([0.7, -1.2, 2.5, 0.1, -0.4, 1.9])
    sampler = Sampler(eos_token_ids=[])
    growing = row(history=[0, 1], prompt_len=2, **params)
    for new in ([2], [2], [5], [1]):
        growing.history.extend(new)
        scores = logits.clone()
        sampler._adjust(scores, growing)
        fresh = logits.clone()
        sampler._adjust(fresh, row(history=list(growing.history), prompt_len=2, **params))
        assert scores.tolist() == fresh.tolist()
    assert growing.penalty_state.counts.tolist() == [0, 1, 2, 0, 0, 1]


def test_logprobs_come_from_raw_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    r = row(temperature=0.0, logprobs=2, logit_bias={0: 100.0})
    draw = Sampler([]).sample(logits, [r])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert draw.token_id == 0
    assert draw.logprob == pytest.approx(float(raw[0]))
    assert [t for t, _ in draw.top_logprobs] == [3, 2]
    assert draw.top_logprobs[0][1] == pytest.approx(float(raw[3]))


def test_seeded_draw_is_reproducible_and_follows_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    sampler = Sampler([])

    def draw(seed: int) -> int:
        return sampler.sample(logits, [row(seed=seed, temperature=1.0)])[0].token_id

    tokens = [draw(s) for s in range(400)]
    again = [draw(s) for s in range(400)]
    assert tokens == again
    assert 0.68 < sum(tokens) / 400 < 0.82


def test_seeded_sampling_independent_of_batch(tiny_dir):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=100)
    prompt = [1, 10, 20, 30, 40]

    def run(others: int, recompute=None) -> list[int]:
        driver = Driver(make_worker(tiny_dir), eos=[])
        reqs = [Request("seeded", prompt, 24, params)]
        reqs += [
            Request(f"o{i}", [1, 5 + i, 7], 24, SamplingParams(temperature=1.0))
            for i in range(others)
        ]
        driver.run(reqs, recompute_after=recompute)
        return reqs[0].output

    alone = run(0)
    assert len(set(alone)) > 3  # really sampling, not a constant stream
    assert run(3) == alone
    assert run(5, recompute=6) == alone
