"""The asynchronous hand-off, on CPU tensors: a step launched before the last one is finished
feeds its pending token from the device's copy of the row's last sample, its row's history
holds a placeholder until that sample is back, results come back in launch order, and the
scheduler's engine running two steps in flight through ``launch``/``finish`` gets the tokens
of the same requests run one step at a time (greedy, seeded, penalties, bias, logprobs,
grammars, and preemptions)."""

from __future__ import annotations

import shutil
from collections import deque

import llguidance
import pytest
import torch

from protocol.messages import PENDING_TOKEN, SamplingParams, StepInput, StepItem
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from tests.tiny_model import write_byte_tokenizer
from tests.worker.conftest import make_worker
from worker.step.fences import FENCES, Fence


def item(**overrides) -> StepItem:
    fields = dict(
        request_id="a",
        slot=0,
        new_blocks=[0, 1],
        token_ids=[1, 5, 6],
        start=0,
        params=SamplingParams(temperature=0.0),
        prompt_len=3,
        fresh=True,
    )
    fields.update(overrides)
    return StepItem(**fields)


def pending(start: int, rid: str = "a", slot: int = 0) -> StepItem:
    return StepItem(
        request_id=rid, slot=slot, new_blocks=[], token_ids=[PENDING_TOKEN], start=start
    )


def test_a_pending_token_launched_before_its_sample_is_back(tiny_dir):
    worker = make_worker(tiny_dir, num_slots=2, num_blocks=8)
    first = worker.launch(StepInput(step_id=0, items=[item()]))
    second = worker.launch(StepInput(step_id=1, items=[pending(3)]))
    row = worker.row_table.rows[0]
    assert worker.in_flight == 2
    assert row.history == [1, 5, 6, PENDING_TOKEN]  # the host has not read step 0's sample yet
    with pytest.raises(RuntimeError, match="finish in the order they were launched"):
        worker.finish(second)
    one = worker.finish(first).samples[0].token_id
    assert row.history == [1, 5, 6, one]  # written in as step 0's ids came back
    two = worker.finish(second).samples[0].token_id
    assert worker.in_flight == 0 and row.last_sampled == two
    # The same tokens as a worker told each token outright, one step at a time.
    plain = make_worker(tiny_dir, num_slots=2, num_blocks=8)
    assert plain.execute(StepInput(step_id=0, items=[item()])).samples[0].token_id == one
    told = StepItem(request_id="a", slot=0, new_blocks=[], token_ids=[one], start=3)
    _, logits = plain.execute_with_logits(StepInput(step_id=1, items=[told]))
    assert two == logits.argmax(-1).item()
    assert torch.allclose(second.logits, logits, atol=1e-6)


def requests() -> list[tuple[list[int], SamplingParams]]:
    seeded = dict(temperature=0.9, top_p=0.92, top_k=50, max_tokens=14)
    return [
        ([1, 17, 42, 99, 3], SamplingParams(temperature=0.0, max_tokens=14)),
        ([1, 200, 201, 5, 6, 7, 8], SamplingParams(seed=5, logprobs=3, **seeded)),
        ([1, 55], SamplingParams(seed=9, repetition_penalty=1.4, presence_penalty=0.5, **seeded)),
        (
            [1, 30, 31],
            SamplingParams(
                temperature=0.0,
                max_tokens=14,
                logit_bias={77: 4.0},
                frequency_penalty=0.7,
                min_tokens=6,
            ),
        ),  # fmt: skip
        ([1, 9, 9, 9], SamplingParams(seed=2, min_p=0.05, **seeded)),
    ]


def pipelined(worker, config: SchedulerConfig, work) -> tuple[dict, int, int]:
    """Run ``work`` as the worker process does: two steps launched, the oldest finished and
    applied, the engine's audit after each; returns each request's tokens and logprobs, the
    most steps in flight at once, and the preemptions."""
    engine = Engine.for_worker(worker, config)
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", prompt, params)
    launched, most, got = deque(), 0, {f"r{i}": ([], []) for i in range(len(work))}
    while engine.has_unfinished() or launched:
        while engine.can_plan() and (step := engine.plan()) is not None:
            launched.append(worker.launch(step))
        most = max(most, worker.in_flight)
        result = worker.finish(launched.popleft())
        for out in engine.apply(result):
            tokens, logprobs = got[out.request_id]
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
        engine.audit(result.rows)
    return got, most, engine.stats().num_preemptions_total


def one_at_a_time(worker, config: SchedulerConfig, work) -> dict:
    engine = Engine.for_worker(worker, config)
    outs = engine.generate([p for p, _ in work], [params for _, params in work])
    return {f"r{i}": (o.new_token_ids, o.logprobs or []) for i, o in enumerate(outs)}


@pytest.mark.parametrize("num_blocks", [256, 14])  # 14: requests are preempted and recomputed
def test_two_steps_in_flight_give_the_tokens_of_one_at_a_time(tiny_dir, num_blocks):
    overlap = SchedulerConfig(audit=True, num_blocks=num_blocks, watermark_blocks=0)
    got, most, preempted = pipelined(make_worker(tiny_dir), overlap, requests())
    assert most == 2 and (preempted > 0) == (num_blocks < 256)
    serial = SchedulerConfig(audit=True, overlap=False, num_blocks=num_blocks, watermark_blocks=0)
    want = one_at_a_time(make_worker(tiny_dir), serial, requests())
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-5)
    assert len(want["r0"][0]) == 14 and any(len(t) > 3 for t, _ in want.values())


class LateFence(Fence):
    """A device that is never done before the host waits for it (a busy GPU, on the CPU)."""

    def __init__(self) -> None:
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.waited = True


@pytest.mark.parametrize("late", [False, True])
def test_grammar_rows_in_flight(tiny_dir, tmp_path, monkeypatch, late):
    """A constrained row's matcher needs its last token on the host: the worker waits for it
    before the row's next masks (once the forward is queued, while the previous step is not
    done: ``late``), and the replies equal those run one step at a time."""
    if late:
        monkeypatch.setitem(FENCES, "cpu", LateFence)
    directory = tmp_path / "model"
    shutil.copytree(tiny_dir, directory)
    write_byte_tokenizer(directory)
    grammar = llguidance.grammar_from("regex", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)")
    work = [
        (
            [1, 5 + i, 40, 77],
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=30, grammar=grammar if i % 2 else None
            ),
        )  # fmt: skip
        for i in range(4)
    ]
    got, most, _ = pipelined(make_worker(directory), SchedulerConfig(audit=True), work)
    assert most == 2
    want = one_at_a_time(make_worker(directory), SchedulerConfig(overlap=False), work)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == {
        rid: tokens for rid, (tokens, _) in want.items()
    }
    assert got["r1"][0][-1] == 2  # the constrained replies end with EOS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_steps_in_flight_on_cuda(tiny_dir):
    """On the GPU, where a launch really returns before the device is done."""
    overlap = SchedulerConfig(audit=True, num_blocks=256)
    got, most, _ = pipelined(make_worker(tiny_dir, device="cuda"), overlap, requests())
    assert most == 2
    serial = SchedulerConfig(audit=True, overlap=False, num_blocks=256)
    want = one_at_a_time(make_worker(tiny_dir, device="cuda"), serial, requests())
    assert {rid: tokens for rid, (tokens, _) in got.items()} == {
        rid: tokens for rid, (tokens, _) in want.items()
    }
