"""Grammar masks on the real worker (tiny seeded Llama, a byte-level tokenizer: id t >= 3 is
the byte t, EOS is 2): a random model's text obeys the grammar only because of the mask, a
matcher rebuilt from a recomputed row's tokens gives the undisturbed tokens, and a step without
a constrained row does no mask work."""

from __future__ import annotations

import json
import re
import shutil
import threading

import llguidance
import pytest

from protocol.messages import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from tests.tiny_model import write_byte_tokenizer
from tests.worker.conftest import make_worker
from tests.worker.driver import Driver, Request
from worker.grammar import GrammarMasks
from worker.grammar.llguidance_backend import LLGuidanceMatcher
from worker.rows import Row

EOS = 2
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
PROMPTS = [[1, 5 + i, 40, 77, 3 + 2 * i, 99] for i in range(6)]


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t != EOS).decode("latin-1")


@pytest.fixture(scope="module")
def worker(tiny_dir, tmp_path_factory):
    """The tiny model with a tokenizer (a copy: other tests read ``tiny_dir`` without one)."""
    directory = tmp_path_factory.mktemp("tokenized") / "model"
    shutil.copytree(tiny_dir, directory)
    return make_worker(write_byte_tokenizer(directory), num_slots=16)


def test_a_regex_is_forced_on_a_random_model(worker):
    """Sampled at temperature 1 with a penalty and a bias towards a forbidden byte, every
    constrained reply is an address and ends with EOS; the same draws without the grammar
    (in the same batches) never are one: the mask is what makes them match."""
    grammar = llguidance.grammar_from("regex", EMAIL)
    extra = dict(temperature=1.0, max_tokens=40, repetition_penalty=1.3, logit_bias={90: 50.0})
    bound = [
        Request(f"g{i}", p, 40, SamplingParams(seed=i, grammar=grammar, **extra))
        for i, p in enumerate(PROMPTS)
    ]
    free = [Request(f"f{i}", p, 40, SamplingParams(seed=i, **extra)) for i, p in enumerate(PROMPTS)]
    Driver(worker).run(bound + free)
    for request in bound:
        assert request.output[-1] == EOS, request.output
        assert re.fullmatch(EMAIL, text(request.output)), text(request.output)
    assert not any(re.fullmatch(EMAIL, text(r.output)) for r in free)


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_recomputed_row_rebuilds_its_matcher(worker, chunk):
    """Rows thrown away mid-reply and recomputed (in chunks) from prompt + generated tokens,
    as after a preemption or a worker restart, give the undisturbed greedy tokens."""
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "array", "items": number, "minItems": 4, "maxItems": 6}
    compact = {"whitespace_flexible": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
    params = SamplingParams(temperature=0.0, max_tokens=30, grammar=grammar)
    runs = []
    for recompute_after in (None, 4):
        requests = [Request(f"r{i}", p, 30, params) for i, p in enumerate(PROMPTS[:3])]
        Driver(worker).run(requests, chunk=chunk, recompute_after=recompute_after)
        runs.append([r.output for r in requests])
    assert runs[0] == runs[1]
    for output in runs[0]:
        assert output[-1] == EOS and 4 <= len(json.loads(text(output))) <= 6


def test_overlap_and_preemption_keep_the_grammar(worker):
    """Through the scheduler with overlap (pending tokens fed back by the worker) and a pool so
    small that requests are preempted and recomputed: the greedy replies equal a roomy run's,
    each one valid and ended by EOS ("stop"), and the seeded ones valid too."""
    grammar = llguidance.grammar_from("regex", EMAIL)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, grammar=grammar)
    seeded = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30, grammar=grammar) for i in (1, 2)
    ]
    params = [greedy] * 4 + seeded
    prompts = PROMPTS[: len(params)]
    roomy_engine = Engine.for_worker(worker, SchedulerConfig(audit=True))
    roomy = roomy_engine.generate(prompts, params)
    stats = roomy_engine.stats()  # every sampled token was masked (overlap adds surplus rows)
    assert stats.grammar_tokens_total >= sum(len(o.new_token_ids) for o in roomy)
    assert stats.grammar_fill_s_total > 0 and stats.grammar_apply_s_total > 0
    small = SchedulerConfig(audit=True, num_blocks=24, watermark_blocks=0)
    engine = Engine.for_worker(worker, small)
    tight = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions_total > 0
    assert [o.new_token_ids for o in tight[:4]] == [o.new_token_ids for o in roomy[:4]]
    for out in tight:
        assert out.finish_reason == "stop" and out.new_token_ids[-1] == EOS
        assert re.fullmatch(EMAIL, text(out.new_token_ids))


def test_the_grammar_wins_over_min_tokens(worker):
    """min_tokens bans EOS, but once "yes" or "no" is complete EOS is all the grammar allows:
    the draw gets EOS, never a row with nothing allowed."""
    grammar = llguidance.grammar_from("choice", '["yes", "no"]')
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=20, min_tokens=10, grammar=grammar)
        for i, t in enumerate([0.0, 1.0, 1.0])
    ]
    requests = [Request(f"c{i}", PROMPTS[i], 20, p) for i, p in enumerate(params)]
    Driver(worker).run(requests)
    for request in requests:
        assert text(request.output) in ("yes", "no") and request.output[-1] == EOS


def test_no_mask_work_without_a_grammar(tiny_dir):
    """Unconstrained steps never start a fill. A model without a tokenizer cannot enforce a
    grammar (its start says so): its constrained requests end at once with EOS."""
    bare = make_worker(tiny_dir)  # no tokenizer.json
    assert "tokenizer.json" in bare.grammar.unavailable
    fills = []
    fill = bare.grammar._fill
    bare.grammar._fill = lambda rows, bitmask: fills.append(len(rows)) or fill(rows, bitmask)
    Driver(bare).run([Request("free", PROMPTS[0], 5, SamplingParams(temperature=1.0, seed=3))])
    assert fills == []
    bound = Request("bound", PROMPTS[0], 5, SamplingParams(grammar='start: "a"'))
    Driver(bare).run([bound])
    assert bound.output == [EOS] and fills == [1]


def test_the_backend_is_built_before_the_worker_is(worker):
    """The worker returns from its start with the backend built: no step waits for it."""
    assert worker.grammar._backend is not None and worker.grammar.unavailable is None
    assert worker.grammar.wait_built(timeout=0)


def test_the_first_constrained_fill_waits_for_an_eager_build_only(worker):
    """While an eager build runs, the first fill waits behind it (then masks as usual); an
    unconstrained step starts no fill at all. A lazy one (a rank that never samples) builds
    nothing until a constrained row comes."""
    release, built = threading.Event(), []

    def load():
        release.wait(30)
        built.append(True)
        return worker.grammar._backend

    eos = [EOS]
    eager = GrammarMasks(load, worker.spec.vocab_size, eos, eager=True)
    assert not eager.wait_built(timeout=0.05)
    rows = [_row(llguidance.grammar_from("regex", "ab"))]
    assert eager.start([_row(None)]) is None
    pending = eager.start(rows)
    assert not pending._filled.done()
    release.set()
    assert eager.wait_built(timeout=30) and built == [True]
    allowed = pending.allowed()[0].nonzero().flatten().tolist()
    assert allowed == [ord("a")]
    lazy = GrammarMasks(load, worker.spec.vocab_size, eos)
    assert lazy.wait_built(timeout=0) and built == [True]
    lazy.start(rows).allowed()
    assert built == [True, True]


def test_a_grammar_compiled_ahead_is_not_compiled_in_a_step(worker):
    """``compile`` (what a CompileGrammar runs, in a compile thread) answers once the grammar is
    in the backend's cache: the row's first mask then takes a copy, and its step compiles
    nothing. A grammar not compiled ahead compiles in the step, and the step counts it; one that
    does not compile is answered with why."""
    answers: list[str] = []
    done = threading.Event()

    def answer(error: str, seconds: float) -> None:
        answers.append(error)
        done.set()

    ahead = llguidance.grammar_from("regex", r"[a-c]{3}x")
    worker.grammar.compile(ahead, answer)
    assert done.wait(30) and answers == [""]
    pending = worker.grammar.start([_row(ahead)])
    assert pending.allowed()[0].nonzero().flatten().tolist() == [ord(c) for c in "abc"]
    assert pending.compiles == 0
    pending = worker.grammar.start([_row(llguidance.grammar_from("regex", r"[d-f]{3}y"))])
    pending.allowed()
    assert pending.compiles == 1
    done.clear()
    worker.grammar.compile('{"grammars": [{"lark_grammar": "start: ("}]}', answer)
    assert done.wait(30) and answers[1] != ""


def test_a_draft_item_gets_each_positions_mask_and_ends_at_a_forbidden_draft(worker):
    """A draft item's row appears once per position: the mask at each is its matcher's after
    the drafts before it; a draft the grammar forbids is masked out at its own position, and
    the positions after it keep that mask. The row's own matcher stays before the drafts."""
    grammar = llguidance.grammar_from("regex", r"(ab|ac)d[ef]+")
    row = _row(grammar)
    for drafts, want in (("bd", ["bc", "d", "ef"]), ("bz", ["bc", "d", "d"])):
        row.history = [1, ord("a"), *(ord(c) for c in drafts)]  # a known token, then drafts
        k = len(drafts)
        pending = worker.grammar.start([row] * (k + 1), list(range(k, -1, -1)))
        masks = [pending.allowed()[i].nonzero().flatten().tolist() for i in range(k + 1)]
        assert masks == [[ord(c) for c in w] for w in want], (drafts, masks)
        assert row.grammar_state.consumed == 1  # its own matcher: after "a" only
    row.history = [1, ord("a"), ord("b")]  # "b" accepted: the next step's plain position
    plain = worker.grammar.start([row])
    assert plain.allowed()[0].nonzero().flatten().tolist() == [ord("d")]


def test_drafts_under_a_grammar_change_no_token(worker, monkeypatch):
    """Greedy replies under a grammar, drafted from prompts that repeat themselves (with a byte
    the grammar forbids among the repeats, so some drafts are forbidden), equal the replies
    without drafts, and drafts are accepted."""
    forbidden = []
    try_consume = LLGuidanceMatcher.try_consume

    def recording(matcher, tokens):
        taken = try_consume(matcher, tokens)
        forbidden.append(taken < len(tokens))
        return taken

    monkeypatch.setattr(LLGuidanceMatcher, "try_consume", recording)
    grammar = llguidance.grammar_from("regex", r"[a-e]{30,40}")
    prompts = [[1, *(ord(c) for c in "abcx" * 6 + "bcdx" * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar)
    replies = []
    for spec in ("ngram", "off"):
        settings = dict(audit=True, speculative=spec, num_speculative_tokens=4)
        engine = Engine.for_worker(worker, SchedulerConfig(**settings))
        replies.append([o.new_token_ids for o in engine.generate(prompts, params)])
        if spec == "ngram":
            speculation = engine.scheduler.speculation
            assert speculation.drafts_total > 0 and speculation.accepted_total > 0
    assert replies[0] == replies[1]
    assert any(forbidden) and not all(forbidden)  # drafts the grammar forbade, and allowed
    for reply in replies[0]:
        assert reply[-1] == EOS and re.fullmatch(r"[a-e]{30,40}", text(reply)), text(reply)


def _row(grammar: str | None) -> Row:
    """A row at the start of its reply (byte tokens: "a" is id 97)."""
    return Row(params=SamplingParams(grammar=grammar), prompt_len=1, history=[1])


@pytest.mark.slow
def test_a_gguf_vocabulary_is_read_once_then_from_the_cache(tmp_path, monkeypatch):
    """The default GGUF's tokenizer JSON is written whole on first use and read back after."""
    from models.files import resolve_model
    from worker.grammar import vocabulary

    cached = tmp_path / "tokenizers" / "model.json"
    monkeypatch.setattr(vocabulary, "_cached_path", lambda files: cached)
    files = resolve_model(None)
    first = vocabulary.tokenizer_json(files)
    assert json.loads(first)["model"]["type"] == "BPE" and cached.read_text() == first
    assert list(cached.parent.iterdir()) == [cached]  # no staging file left behind
    monkeypatch.setattr(vocabulary, "load_tokenizer", lambda files: pytest.fail("read again"))
    assert vocabulary.tokenizer_json(files) == first
