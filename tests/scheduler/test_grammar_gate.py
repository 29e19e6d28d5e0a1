"""GrammarGate and the engine around it: a constrained request waits outside the queues until
the worker has compiled its grammar, then joins them as a new arrival; everyone else runs
meanwhile, and the audit passes throughout."""

from __future__ import annotations

from protocol.messages import AddRequest, SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.grammar_gate import GrammarGate, grammar_key
from scheduler.sim_worker import SimWorker
from tests.scheduler.conftest import GREEDY, assert_all_back, prompts, run_to_end

REGEX = '{"grammars": [{"lark_grammar": "start: /[ab]+/"}]}'
OTHER = '{"grammars": [{"lark_grammar": "start: /[cd]+/"}]}'


def constrained(grammar: str = REGEX) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, grammar=grammar)


def add(request_id: str, grammar: str | None = REGEX) -> AddRequest:
    params = constrained(grammar) if grammar else GREEDY
    return AddRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], params=params)


def gated_engine() -> Engine:
    worker = SimWorker(32, 4, 4, max_model_len=4096, vocab_size=1000)
    config = SchedulerConfig(token_budget=64, watermark_blocks=0, audit=True, overlap=True)
    return Engine(worker.ready(), config, worker=worker, gate_grammars=True)


def test_the_gate_holds_until_the_worker_has_the_grammar() -> None:
    gate = GrammarGate()
    assert not gate.hold(add("plain", None))
    assert gate.hold(add("a")) and gate.hold(add("b")) and gate.hold(add("c", OTHER))
    assert gate.num_held == 3 and gate.holds_total == 3
    asks = gate.to_ask(now=0.0)
    assert sorted(a.key for a in asks) == sorted([grammar_key(REGEX), grammar_key(OTHER)])
    assert {a.key: a.grammar for a in asks}[grammar_key(REGEX)] == REGEX
    assert gate.to_ask(now=1.0) == []  # asked already, not yet due again
    released = gate.compiled(grammar_key(REGEX), seconds=0.5)
    assert [r.request_id for r in released] == ["a", "b"]  # in arrival order
    assert gate.num_held == 1 and gate.compile_s_total == 0.5
    assert not gate.hold(add("d"))  # the worker has it now
    assert gate.compiled(grammar_key(REGEX)) == []  # a second answer releases nothing


def test_an_unanswered_ask_is_sent_again_and_a_new_worker_is_asked_afresh() -> None:
    gate = GrammarGate(reask_s=5.0)
    gate.hold(add("a"))
    assert len(gate.to_ask(now=0.0)) == 1
    assert gate.to_ask(now=4.9) == []
    assert len(gate.to_ask(now=5.0)) == 1  # the answer may have been lost
    gate.compiled(grammar_key(OTHER))
    gate.worker_changed()
    assert len(gate.to_ask(now=5.1)) == 1  # the new worker is asked at once
    assert gate.hold(add("b", OTHER))  # and it holds none of what the last one compiled


def test_dropped_requests_leave_nothing_behind() -> None:
    gate = GrammarGate()
    gate.hold(add("a"))
    gate.hold(add("b"))
    assert gate.drop("a").request_id == "a" and gate.drop("a") is None
    assert [r.request_id for r in gate.compiled(grammar_key(REGEX))] == ["b"]
    gate.hold(add("c", OTHER))
    assert gate.drop("c") is not None and gate.to_ask(now=0.0) == []  # nothing left to ask
    gate.hold(add("d", "x"))
    assert gate.drop_all() == ["d"] and gate.num_held == 0


def test_the_gate_keeps_a_bounded_view_of_the_workers_grammars() -> None:
    gate = GrammarGate(known=2)
    for grammar in ("g1", "g2", "g3"):
        gate.compiled(grammar_key(grammar))
    assert gate.hold(add("old", "g1"))  # forgotten first: asked again rather than assumed
    assert not gate.hold(add("new", "g3"))


def test_a_held_request_runs_after_its_compile_and_others_run_meanwhile() -> None:
    """A plain request admitted while a constrained one waits runs first; the constrained one
    joins the queue as a new arrival (the audit checks the queues' arrival order every step),
    and both finish with every block back."""
    engine = gated_engine()
    engine.add_request("bound", [5, 6, 7], constrained())
    assert engine.scheduler.get("bound") is None
    assert engine.stats().num_waiting_for_grammar == 1 and engine.stats().num_waiting == 1
    (ask,) = engine.grammar_asks()
    engine.add_request("plain", prompts(1)[0], GREEDY)
    for _ in range(3):
        engine.step()  # the plain request runs; the held one is not in any step
    assert engine.scheduler.get("plain") is not None
    assert engine.grammar_compiled(ask.key, seconds=0.2) == []
    assert engine.scheduler.get("bound") is not None
    assert engine.stats().num_waiting_for_grammar == 0
    assert engine.stats().grammar_holds_total == 1
    run_to_end(engine)
    assert_all_back(engine)
    engine.add_request("again", [8, 9], constrained())  # compiled: straight to the queue
    assert engine.scheduler.get("again") is not None and engine.grammar_asks() == []


def test_a_held_request_can_be_aborted_or_refused_when_released() -> None:
    engine = gated_engine()
    engine.add_request("gone", [1, 2, 3], constrained())
    aborted = engine.abort("gone")
    assert aborted.finish_reason == "abort" and aborted.num_prompt_tokens == 3
    assert engine.grammar_asks() == []
    engine.add_request("long", list(range(5000)), constrained(OTHER))  # past max_model_len
    (ask,) = engine.grammar_asks()
    (ended,) = engine.grammar_compiled(ask.key)
    assert ended.request_id == "long" and ended.finish_reason == "error"
    assert "max_model_len" in ended.error


def test_a_lost_worker_is_replaced_and_the_held_grammar_asked_again() -> None:
    engine = gated_engine()
    engine.add_request("bound", [5, 6, 7], constrained())
    assert len(engine.grammar_asks()) == 1
    engine.worker_lost()
    (ask,) = engine.grammar_asks()  # of the next worker, at once
    engine.grammar_compiled(ask.key)
    run_to_end(engine)
    assert_all_back(engine)
