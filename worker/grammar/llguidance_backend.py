"""``LLGuidanceBackend``: grammars compiled and masks filled by llguidance (torch-free).

Why llguidance, and its measured costs, are in docs/performance.md. A grammar is compiled once
per worker (an LRU of pristine matchers; compiling drops the GIL), ahead of its requests when
the scheduler asks (``compile``, in a compile thread) or else at a row's first mask; every row
gets a deep copy, which costs microseconds. Masks are filled by one ``LLExecutor`` thread,
without the GIL.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import llguidance
import numpy as np

from worker.grammar.base import GrammarBackend, Matcher

log = logging.getLogger(__name__)

# Pristine matchers kept, least recently used first out: more than the scheduler believes the
# worker holds (scheduler.grammar_gate), so a grammar it has released a request for is here.
_COMPILED = 256


class LLGuidanceMatcher(Matcher):
    """An ``llguidance.LLMatcher``."""

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def consume(self, tokens: list[int]) -> None:
        self.inner.consume_tokens(tokens)  # False puts it in error, which ``error`` reports

    @property
    def error(self) -> str:
        return self.inner.get_error() if self.inner.is_error() else ""

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.inner.deep_copy())

    def try_consume(self, tokens: list[int]) -> int:
        return self.inner.try_consume_tokens(tokens)


class LLGuidanceBackend(GrammarBackend):
    """llguidance over one tokenizer's vocabulary, widened to the model's ``vocab_size``."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the compile threads' and the mask thread's LRU
        self.compiles_in_place = 0  # compiles ``matcher`` did itself: in a step's path

    def compile(self, grammar: str) -> str:
        with self._lock:
            pristine = self._compiled.get(grammar)
        if pristine is None:
            pristine = self._cache(grammar, self._compile(grammar))
        return pristine.get_error() if pristine.is_error() else ""

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
        if pristine is None:
            self.compiles_in_place += 1
            pristine = self._cache(grammar, self._compile(grammar))
        return LLGuidanceMatcher(pristine.deep_copy())

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """Outside the lock: the compile is the slow part, and drops the GIL."""
        pristine = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if pristine.is_error():
            log.error("a grammar that does not compile: %s", pristine.get_error())
        return pristine

    def _cache(self, grammar: str, pristine: llguidance.LLMatcher) -> llguidance.LLMatcher:
        with self._lock:
            self._compiled[grammar] = pristine
            self._compiled.move_to_end(grammar)
            if len(self._compiled) > _COMPILED:
                self._compiled.popitem(last=False)
        return pristine

    def fill(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        if not matchers:
            return
        rows, words = bitmask.shape
        if not bitmask.flags["C_CONTIGUOUS"] or bitmask.dtype != np.int32:
            raise ValueError("the bitmask must be a C-contiguous int32 array")
        pairs = [(matcher.inner, row) for matcher, row in matchers]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, rows)
