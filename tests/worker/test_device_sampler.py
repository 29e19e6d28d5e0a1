"""The device sampler (``worker.sampling.device``) against the reference
(``worker.sampling.sampler``): on the same logits and rows, over every option at once
(temperature, top_k, top_p, min_p, repetition/presence/frequency penalties, logit_bias,
min_tokens, seeds, logprobs and grammar masks), the same tokens and top alternatives, and
logprobs within float rounding; its per-slot penalty state, folded step by step on the device,
equals the reference's."""

from __future__ import annotations

import random
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from protocol.messages import SamplingParams
from worker.grammar import PendingMasks
from worker.rows import Row
from worker.sampling.device import DeviceSampler
from worker.sampling.inputs import pack_sampling
from worker.sampling.penalties import has_penalties, pack_folds
from worker.sampling.sampler import Sampler
from worker.step.pack import Staging

VOCAB = 67  # not a multiple of 32: the masks' last word is partial
EOS = [2, 5]


def random_params(rng: random.Random, grammar: bool) -> SamplingParams:
    """One row's parameters, each option on about half the time."""
    maybe = lambda value, off: value if rng.random() < 0.5 else off  # noqa: E731
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.6]),
        top_k=maybe(rng.randint(1, 80), None),
        top_p=maybe(rng.uniform(0.3, 0.99), 1.0),
        min_p=maybe(rng.uniform(0.0, 0.3), 0.0),
        repetition_penalty=maybe(rng.uniform(0.6, 1.8), 1.0),
        presence_penalty=maybe(rng.uniform(-1.5, 1.5), 0.0),
        frequency_penalty=maybe(rng.uniform(-1.0, 2.0), 0.0),
        logit_bias=maybe({rng.randrange(VOCAB + 3): rng.uniform(-30, 30) for _ in range(4)}, None),
        seed=maybe(rng.randrange(2**62), None),
        logprobs=maybe(rng.choice([0, 1, 3, 20]), None),
        stop_token_ids=maybe([rng.randrange(VOCAB) for _ in range(3)], []),
        min_tokens=maybe(rng.randint(0, 6), 0),
        max_tokens=64,
        grammar="a grammar" if grammar else None,
    )


def random_rows(rng: random.Random, count: int) -> list[Row]:
    rows = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        params = random_params(rng, grammar=rng.random() < 0.3)
        seed = rng.randrange(2**62)
        rows.append(Row("r", [], 0, params, len(prompt), prompt + outputs, seed))
    return rows


def masks_for(rows: list[Row], rng: random.Random) -> PendingMasks | None:
    """Grammar masks of the constrained rows, filled: a random allowed set, or EOS alone (as
    a complete grammar's), which min_tokens may ban."""
    index = [i for i, row in enumerate(rows) if row.params.grammar is not None]
    if not index:
        return None
    words = (VOCAB + 31) // 32
    bitmask = np.zeros((len(index), words), dtype=np.int32)
    bits = bitmask.view(np.uint32)
    for k in range(len(index)):
        allowed = [EOS[0]] if rng.random() < 0.4 else rng.sample(range(VOCAB), rng.randint(1, 20))
        for token in allowed:
            bits[k, token // 32] |= np.uint32(1 << (token % 32))
    filled: Future = Future()
    filled.set_result(0.0)
    return PendingMasks(index, bitmask, filled, VOCAB)


def device_sample(rows: list[Row], logits: torch.Tensor, masks: PendingMasks | None):
    """The device sampler over ``rows`` in slots 0..S-1, their penalty state folded from their
    histories (as a fresh row's cache hits are)."""
    sampler = DeviceSampler(num_slots=len(rows), vocab=VOCAB, device="cpu")
    pack = Staging("cpu", pin=False).pack()
    folds = [(s, r, True, list(r.history), 0, 0) for s, r in enumerate(rows) if has_penalties(r)]
    folding = pack_folds(pack, folds)
    plan = pack_sampling(pack, rows, list(range(len(rows))), EOS, VOCAB)
    packed = pack.upload()
    if folding:
        sampler.penalties.fold(packed, torch.zeros(0, dtype=torch.long))
    allowed = None if masks is None else sampler.unpack(torch.from_numpy(masks.filled()))
    return sampler.sample(logits, packed, plan, allowed), plan, sampler


@pytest.mark.parametrize("trial", range(25))
def test_the_device_sampler_matches_the_reference_over_every_option(trial):
    rng = random.Random(trial)
    rows = random_rows(rng, rng.randint(1, 12))
    generator = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
    reference = Sampler(EOS).sample(logits, rows, masks_for(rows, random.Random(trial)))
    out, plan, sampler = device_sample(rows, logits, masks_for(rows, random.Random(trial)))
    assert out.tokens.tolist() == [draw.token_id for draw in reference]
    assert sampler.last_ids.tolist() == out.tokens.tolist()  # the slots' feeds
    for k, i in enumerate(plan.logprob_rows):
        want = reference[i]
        assert float(out.logprob[k]) == pytest.approx(want.logprob, abs=1e-5)
        n = rows[i].params.logprobs
        if n:
            ids = out.top_ids[k, :n].tolist()
            assert ids == [t for t, _ in want.top_logprobs]
            values = out.top_logprobs[k, :n].tolist()
            assert values == pytest.approx([v for _, v in want.top_logprobs], abs=1e-5)
    assert all(reference[i].logprob is None for i in range(len(rows)) if i not in plan.logprob_rows)


def test_every_option_was_exercised():
    """The trials above cover each option, drawing and greedy, and the grammar's fallback."""
    seen = set()
    for trial in range(25):
        rng = random.Random(trial)
        rows = random_rows(rng, rng.randint(1, 12))
        plan = pack_sampling(Staging("cpu", pin=False).pack(), rows, [0] * len(rows), EOS, VOCAB)
        seen |= {name for name in ("drawing", "repetition", "presence", "bias", "bans") if
                 getattr(plan, name)}  # fmt: skip
        seen |= {"grammar"} if plan.grammar else set()
        seen |= {"top"} if plan.top else set()
        seen |= {"greedy"} if any(r.params.temperature == 0 for r in rows) else set()
    assert seen == {"drawing", "repetition", "presence", "bias", "bans", "grammar", "top", "greedy"}


def test_a_dead_grammar_row_falls_back_to_what_its_grammar_allows():
    """min_tokens bans EOS, the complete grammar allows only EOS: EOS it is, in both."""
    params = SamplingParams(temperature=0.0, min_tokens=5, grammar="g")
    rows = [Row("r", [], 0, params, 2, [7, 8, 9], 1)]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    masks = masks_for(rows, random.Random(1))  # 0.13 < 0.4: EOS alone
    assert masks.allowed()[0].nonzero().flatten().tolist() == [EOS[0]]
    reference = Sampler(EOS).sample(logits, rows, masks)
    out, _, _ = device_sample(rows, logits, masks)
    assert reference[0].token_id == EOS[0] == out.tokens.item()


def test_slot_penalties_folded_step_by_step_equal_the_reference_state():
    """A row fed its prompt (half as cache hits), then one token a step, the last ones from the
    device's feed: the slot's seen set and counts equal the reference's after each step."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3)
    row = Row("r", [], 0, params, 4, [], 0)
    sampler = DeviceSampler(num_slots=3, vocab=VOCAB, device="cpu")
    staging = Staging("cpu", pin=False)
    steps = [([11, 12], [13, 11], True), ([], [40], False), ([], [40], False), ([], [11], False)]
    for cached, fed, fresh in steps:
        row.history.extend(cached + fed)
        pack = staging.pack()
        assert pack_folds(pack, [(2, row, fresh, cached, 1, len(fed))])
        packed = pack.upload()
        ids = torch.tensor([0, *fed, 0])  # the row's tokens sit at positions 1.. of the step
        sampler.penalties.fold(packed, ids)
        reference = Sampler([])
        scores = torch.zeros(VOCAB)
        reference._adjust(scores, row)
        state = row.penalty_state
        assert torch.equal(sampler.penalties.seen[2], state.seen)
        assert torch.equal(sampler.penalties.counts[2], state.counts)
        row.penalty_state = None  # the reference rebuilt from the whole history, every step
    assert sampler.penalties.counts[2].nonzero().flatten().tolist() == [11, 40]
    assert not sampler.penalties.seen[:2].any()  # other slots untouched
