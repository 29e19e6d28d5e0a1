"""``scripts/spec_coverage.py``'s replay: a reply that copies its prompt is mostly accepted
drafts, one that never repeats has none, and the history of earlier replies is searched only
when asked; the server's own drafter and the script's lookup agree where their n-grams do."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load():
    spec = importlib.util.spec_from_file_location("spec_coverage", SCRIPTS / "spec_coverage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("spec_coverage", module)
    spec.loader.exec_module(module)
    return module


coverage = _load()
PROMPT = list(range(100, 140))


def test_a_reply_that_copies_its_prompt_is_mostly_accepted_drafts():
    pairs = [(PROMPT, PROMPT[10:30])]  # the reply: 20 tokens of the prompt, in order
    found = coverage.replay(pairs, 2, 4, 4, False)
    # The first two tokens follow no 2-gram of the prompt; then each step accepts 4 drafts and
    # adds its own token, the last one 2 drafts: 18 tokens in 4 verifications.
    assert found["steps"] == 2 + 4 and found["verifications"] == 4
    assert found["accepted share of tokens"] == (4 + 4 + 4 + 2) / 20
    same = coverage.replay(pairs, 1, 4, 4, False)  # the script's own lookup, 1-grams too
    assert same["accepted share of tokens"] > found["accepted share of tokens"]


def test_a_reply_that_never_repeats_has_no_accepted_drafts():
    found = coverage.replay([(PROMPT, list(range(500, 520)))], 1, 4, 8, False)
    assert found["accepted share of tokens"] == 0 and found["steps"] == 20


def test_earlier_replies_are_searched_only_when_asked():
    first, second = (PROMPT, list(range(500, 520))), ([7, 8], list(range(500, 520)))
    alone = coverage.replay([first, second], 2, 4, 8, False)
    shared = coverage.replay([first, second], 2, 4, 8, True)
    assert alone["accepted share of tokens"] == 0
    # The second reply repeats the first: after its first two tokens, two steps of 8 drafts.
    assert shared["accepted share of tokens"] == (8 + 8) / 40
