"""The row protocol: what a step does to rows, and the violations the worker refuses."""

from __future__ import annotations

import pytest

from protocol.messages import PENDING_TOKEN, SamplingParams, StepInput, StepItem
from tests.worker.conftest import make_worker

P = SamplingParams(temperature=0.0)


def item(slot=0, start=0, tokens=(1, 5, 6), blocks=(0,), rid="a", **kw) -> StepItem:
    params = dict(params=P, prompt_len=len(tokens), fresh=True) if start == 0 else {}
    params.update(kw)
    return StepItem(
        request_id=rid,
        slot=slot,
        new_blocks=list(blocks),
        token_ids=list(tokens),
        start=start,
        **params,
    )


def step(*items, released=(), audit=True, step_id=0) -> StepInput:
    return StepInput(step_id=step_id, items=list(items), released_slots=list(released), audit=audit)


@pytest.fixture
def worker(tiny_dir):
    return make_worker(tiny_dir, num_slots=3, num_blocks=8)


def test_rows_follow_the_steps(worker):
    result = worker.execute(step(item()))
    assert len(result.samples) == 1 and len(result.rows) == 3
    assert (result.rows[0].request_id, result.rows[0].block_ids, result.rows[0].num_cached) == (
        "a",
        [0],
        3,
    )
    tok = result.samples[0].token_id
    result = worker.execute(step(item(start=3, tokens=[tok], blocks=[4])))
    assert (result.rows[0].block_ids, result.rows[0].num_cached) == ([0, 4], 4)
    result = worker.execute(step(item(slot=1, rid="b", sample=False), released=[0]))
    assert result.samples == []
    assert result.rows[0].request_id is None and result.rows[0].block_ids == []
    assert result.rows[1].num_cached == 3
    assert worker.execute(step(audit=False)).rows is None


@pytest.mark.parametrize(
    "bad,message",
    [
        (item(start=2, tokens=[3]), "does not continue"),
        (item(start=3, tokens=[3], rid="other"), "does not continue"),
        (item(slot=5), "out of range"),
        (item(tokens=[1] * 9, blocks=[1, 2]), "exceed"),
        (item(blocks=[99]), "out of range"),
        (item(tokens=[999]), "out of range"),
        (item(tokens=[]), "no token_ids"),
        (item(params=None), "needs params"),
        (item(tokens=[PENDING_TOKEN]), "only token"),  # a fresh row has nothing to feed back
        (item(start=3, tokens=[PENDING_TOKEN, 4]), "only token"),
    ],
)
def test_violations_raise_and_change_nothing(worker, bad, message):
    worker.execute(step(item()))
    before = worker.rows()
    with pytest.raises(ValueError, match=message):
        worker.execute(step(bad, released=[2]))
    assert worker.rows() == before


def test_released_row_cannot_be_continued(worker):
    worker.execute(step(item()))
    with pytest.raises(ValueError, match="slot 0"):
        worker.execute(step(item(start=3, tokens=[4]), released=[0]))


def test_same_slot_twice_is_refused(worker):
    with pytest.raises(ValueError, match="twice"):
        worker.execute(step(item(), item(rid="b", blocks=[1])))


def test_reset_empties_every_row(worker):
    worker.execute(step(item(), item(slot=2, rid="b", blocks=[1])))
    worker.reset()
    assert all((r.request_id, r.block_ids, r.num_cached) == (None, [], 0) for r in worker.rows())
    with pytest.raises(ValueError, match="does not continue"):
        worker.execute(step(item(start=3, tokens=[4])))


def test_a_pending_token_feeds_back_the_rows_last_sample(worker, tiny_dir):
    first = worker.execute(step(item(), step_id=0)).samples[0].token_id
    pending = item(start=3, tokens=[PENDING_TOKEN], blocks=[])
    result, logits = worker.execute_with_logits(step(pending))
    assert worker.row_table.rows[0].history == [1, 5, 6, first]
    # The same as naming the token: a fresh worker fed [1, 5, 6, first] explicitly.
    fresh = make_worker(tiny_dir, num_slots=3, num_blocks=8)
    _, expected = fresh.execute_with_logits(step(item(tokens=[1, 5, 6, first])))
    assert result.samples[0].token_id == expected.argmax(-1).item()
    assert (logits - expected).abs().max().item() < 1e-4


def test_a_pending_token_after_a_step_that_sampled_nothing_is_refused(worker):
    worker.execute(step(item(sample=False)))
    before = worker.rows()
    with pytest.raises(ValueError, match="sampled none"):
        worker.execute(step(item(start=3, tokens=[PENDING_TOKEN], blocks=[])))
    assert worker.rows() == before


@pytest.mark.parametrize(
    "params,refused",
    [
        (SamplingParams(temperature=0.0, logprobs=1), True),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), True),
        (SamplingParams(temperature=0.0, grammar='start: "a"+', min_tokens=2), True),
        (SamplingParams(temperature=0.0, grammar='start: "a"+'), False),
        (SamplingParams(temperature=0.0), False),
    ],
)
def test_draft_tokens_only_on_rows_without_state_to_roll_back(worker, params, refused):
    """Logprobs, penalties, and a grammar with min_tokens keep per-position state: a draft
    item on such a row is refused; a grammar alone walks its drafts on copies of its matcher."""
    worker.execute(step(item(params=params)))
    before = worker.rows()
    drafted = step(item(start=3, tokens=[4, 7, 8], blocks=[1], num_draft=2))
    if not refused:
        assert len(worker.execute(drafted).samples) == 1
        return
    with pytest.raises(ValueError, match="draft tokens on a row with logprobs"):
        worker.execute(drafted)
    assert worker.rows() == before
