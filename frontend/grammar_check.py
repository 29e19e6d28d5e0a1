"""GrammarChecker: compile each distinct grammar once, off the event loop, and remember whether
it compiled.

A bad schema, regex or grammar must get a 400 here and never reach the scheduler, so every
constrained request's grammar is compiled against the model's vocabulary (llguidance's
``validate_grammar``, about a millisecond for a typical schema, more for a large one) in one
thread of its own; llguidance drops the GIL while it compiles. Verdicts are kept in an LRU keyed
by a digest of the grammar, and a grammar being compiled is awaited, not compiled twice.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from models.tokenizer import ChatTokenizer

MAX_ERROR_CHARS = 1000  # llguidance's messages can quote a whole grammar


class GrammarChecker:
    """``await error(grammar)``: "" when the grammar compiles, else why not."""

    def __init__(self, tokenizer: ChatTokenizer, capacity: int = 512) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._verdicts: OrderedDict[bytes, asyncio.Future[str]] = OrderedDict()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-check")
        self._vocabulary = None  # llguidance's view of the tokenizer, built on first use

    async def error(self, grammar: str) -> str:
        """Why ``grammar`` does not compile ("" when it does); compiled once per grammar."""
        key = hashlib.blake2b(grammar.encode(), digest_size=16).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            loop = asyncio.get_running_loop()
            verdict = loop.run_in_executor(self._thread, self._compile, grammar)
            self._verdicts[key] = verdict
            if len(self._verdicts) > self._capacity:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(key)
        return await asyncio.shield(verdict)

    def _compile(self, grammar: str) -> str:
        """In the checker's thread."""
        import llguidance

        if self._vocabulary is None:
            tokenizer = self._tokenizer
            self._vocabulary = llguidance.LLTokenizer(
                tokenizer.tokenizer.to_str(),
                n_vocab=tokenizer.vocab_size,
                eos_token=list(tokenizer.eos_token_ids),
            )
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._vocabulary
        )
        if not failed:
            return ""
        message = messages[0] if messages else "the grammar does not compile"
        return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
