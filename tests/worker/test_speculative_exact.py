"""Speculative decoding on the real worker (the seeded tiny Llama, float32): greedy output equals
transformers' and no speculation's token for token, alone, 32 at once and under preemption; a
seeded sampled request gives the same text on every run, and the same as without drafts; and
rejection sampling leaves the model's next-token distribution unchanged (a chi-square with
drafts that are sometimes right and sometimes wrong)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from protocol.messages import SamplingParams, StepInput, StepItem
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from tests.worker.conftest import hf_greedy, hf_logits, hf_model, make_worker
from tests.worker.test_tiny_exact import MAX_NEW, PROMPTS

# The exactness tests' prompts, then 28 more: half of them repeat themselves, so drafts are
# found and often accepted, and the tiny model's greedy loops repeat too.
MORE = [[1] + [40 + i, 41 + i, 42 + i, 43 + i] * 3 for i in range(14)]
MORE += [[1, 7 * i % 250 + 3, 11 * i % 250 + 3, 60 + i] for i in range(14)]
PROMPTS_32 = PROMPTS + MORE
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def worker(tiny_dir):
    return make_worker(tiny_dir, num_slots=32, num_blocks=512)


@pytest.fixture(scope="module")
def expected(tiny_dir) -> list[list[int]]:
    model = hf_model(tiny_dir)
    return [hf_greedy(model, p, MAX_NEW, [2]) for p in PROMPTS_32]


def generate(worker, prompts, params, spec: str = "ngram", **config) -> tuple[list, Engine]:
    """Every prompt's tokens, audited every iteration; the rows are left empty."""
    settings = dict(speculative=spec, num_speculative_tokens=4, audit=True, watermark_blocks=0)
    settings["speculative_max_running"] = 32  # drafts with all 32 running too
    engine = Engine.for_worker(worker, SchedulerConfig(**{**settings, **config}))
    outs = engine.generate(prompts, params)
    step = engine.plan()  # the last releases, so that the next engine finds empty rows
    if step is not None:
        engine.apply(worker.execute(step))
    engine.audit(worker.rows())
    return [o.new_token_ids for o in outs], engine


def test_greedy_alone_equals_transformers(worker, expected) -> None:
    accepted = 0
    for prompt, want in zip(PROMPTS_32, expected, strict=True):
        (got,), engine = generate(worker, [prompt], GREEDY, num_slots=1)
        assert got == want, prompt
        accepted += engine.scheduler.speculation.accepted_total
    assert accepted > 0


def test_greedy_32_at_once_equals_transformers(worker, expected) -> None:
    got, engine = generate(worker, PROMPTS_32, GREEDY)
    assert got == expected
    spec = engine.scheduler.speculation
    assert spec.accepted_total > 0 and spec.drafts_total > 0
    plain, _ = generate(worker, PROMPTS_32, GREEDY, spec="off")
    assert plain == got


def test_greedy_under_preemption(worker, expected) -> None:
    """A pool far too small for 32 requests: evictions with drafts in flight, same text."""
    got, engine = generate(worker, PROMPTS_32, GREEDY, num_blocks=24, token_budget=48)
    assert engine.scheduler.num_preemptions_total > 0
    assert got == expected


def test_seeded_sampling_is_the_same_on_every_run(worker) -> None:
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=1000 + i)
        for i in range(len(PROMPTS_32))
    ]
    runs = [generate(worker, PROMPTS_32, params)[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    plain, _ = generate(worker, PROMPTS_32, params, spec="off")
    assert plain == runs[0]  # each position draws with its own output index's uniform


def _top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(vocab,) the distribution a top_k sampler at temperature 1 draws from."""
    kept = torch.full_like(logits, float("-inf"))
    values, ids = logits.topk(k)
    return torch.softmax(kept.scatter(0, ids, values), dim=-1)


def _chi_square_passes(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """The chi-square statistic of ``counts`` (n draws) against ``probs`` (vocab,), bins of
    expected count under 5 pooled, and its critical value at alpha 0.001 (Wilson-Hilferty)."""
    expected = probs * n
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    wants = [expected[t].item() for t in big]
    rest = n - sum(observed)
    if n - sum(wants) > 1e-9:
        observed.append(rest)
        wants.append(n - sum(wants))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wants, strict=True))
    df = len(wants) - 1
    z = 3.09  # the standard normal's 0.999 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def test_rejection_sampling_leaves_the_distribution_unchanged(tiny_dir) -> None:
    """1024 seeded draws of a prompt with two drafts after it: the first draft is the model's
    second choice, so it is accepted about as often as that token is drawn. The tokens kept
    (the scheduler's rule: drafts while they equal what was sampled before them, then the
    sampled token) follow the model's own distribution (top_k 8): the first token p0, and
    after an accepted first draft d the second token p1 = p(. | prompt + d)."""
    from scheduler.request import Request
    from scheduler.speculation import Speculation

    top_k, slots, rounds = 8, 64, 16
    prompt = PROMPTS[1]
    model = hf_model(tiny_dir)
    p0 = _top_k_probs(hf_logits(model, prompt)[-1], top_k)
    d1 = p0.argsort(descending=True)[1].item()
    p1 = _top_k_probs(hf_logits(model, [*prompt, d1])[-1], top_k)
    d2 = p1.argmax().item()
    worker = make_worker(tiny_dir, num_slots=slots, num_blocks=4 * slots)
    speculation, first, second = Speculation(2), Counter(), Counter()
    for r in range(rounds):
        fresh = [
            StepItem(
                request_id=f"d{r}-{s}",
                slot=s,
                new_blocks=list(range(4 * s, 4 * s + 4)),
                token_ids=prompt[:-1],
                start=0,
                sample=False,
                params=SamplingParams(temperature=1.0, top_k=top_k, seed=r * slots + s),
                prompt_len=len(prompt),
                fresh=True,
            )
            for s in range(slots)
        ]
        released = list(range(slots)) if r else []
        worker.execute(StepInput(step_id=2 * r, items=fresh, released_slots=released))
        drafts = [
            StepItem(
                request_id=item.request_id,
                slot=item.slot,
                new_blocks=[],
                token_ids=[prompt[-1], d1, d2],
                start=len(prompt) - 1,
                num_draft=2,
            )
            for item in fresh
        ]
        result = worker.execute(StepInput(step_id=2 * r + 1, items=drafts))
        for sample in result.samples:
            request = Request(sample.request_id, prompt, SamplingParams(), 0)
            sampled = [sample.token_id, *sample.draft_samples]
            accepted = speculation.verify(request, (d1, d2), sampled)
            kept = [d1, d2][:accepted] + [sampled[accepted]]
            first[kept[0]] += 1
            if kept[0] == d1:
                second[kept[1]] += 1
    n = slots * rounds
    assert 0 < first[d1] < n  # the first draft was sometimes right and sometimes wrong
    assert 0 < speculation.accepted_total < speculation.draft_tokens_total
    statistic, critical = _chi_square_passes(first, p0, n)
    assert statistic < critical, (statistic, critical)
    statistic, critical = _chi_square_passes(second, p1, first[d1])
    assert statistic < critical, (statistic, critical)


def test_the_chi_square_rejects_a_sampler_that_favours_the_draft() -> None:
    """The check above can fail: 1024 draws from a top-8 distribution pass it, and the same
    draws pass no more once a draft is kept half of the times it was rejected (a sampler that
    accepted drafts with probability p(d) + (1 - p(d)) / 2, not p(d))."""
    generator = torch.Generator().manual_seed(0)
    probs = _top_k_probs(torch.randn(32, generator=generator), 8)
    draft = probs.argsort(descending=True)[1].item()
    n = 1024
    draws = torch.multinomial(probs, n, replacement=True, generator=generator).tolist()
    coins = torch.rand(n, generator=generator).tolist()
    right = Counter(draws)
    wrong = Counter(draft if coin < 0.5 else t for t, coin in zip(draws, coins, strict=True))
    statistic, critical = _chi_square_passes(right, probs, n)
    assert statistic < critical, (statistic, critical)
    statistic, critical = _chi_square_passes(wrong, probs, n)
    assert statistic > critical, (statistic, critical)
