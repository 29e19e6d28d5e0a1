"""GrammarChecker: compile each distinct grammar once, off the event loop and within a time
limit, and remember the verdict.

A bad schema, regex or grammar must get a 400 here and never reach the scheduler, so every
constrained request's grammar is compiled against the model's vocabulary the way the worker
compiles it (an ``llguidance.LLMatcher`` with the same default limits, and its first mask: a
grammar accepted here starts in the worker too), in a thread; llguidance drops the GIL while it
compiles. The vocabulary is built once, at start, before the frontend serves.

A compile that runs past ``timeout`` is refused (400) and the verdict kept, so the grammar never
reaches a worker, whose compile of it would take as long. The compile cannot be interrupted: it
runs on in its thread until llguidance's own work limits end it, so compiles run in a few
threads, and a request whose grammar waits for a free thread is not yet on the clock. Verdicts
are kept in an LRU keyed by a digest of the grammar; a grammar being compiled is awaited, not
compiled twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 1000  # llguidance's messages can quote a whole grammar
COMPILE_THREADS = 4  # compiles at once; a runaway one holds its thread until it ends


class GrammarChecker:
    """``await error(grammar)``: "" when the grammar compiles in time, else why not."""

    def __init__(self, tokenizer: ChatTokenizer, timeout: float = 2.0, capacity: int = 512) -> None:
        self._timeout = timeout
        self._capacity = capacity
        self._verdicts: OrderedDict[bytes, asyncio.Task[str]] = OrderedDict()
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-check")
        self._free: asyncio.Semaphore | None = None  # threads free, made in the event loop
        # llguidance's view of the vocabulary, built now, before the event loop serves: its
        # constructor holds the GIL in one call (a quarter second here, seconds on a loaded
        # machine), which beside a running loop would starve the scheduler's heartbeats.
        self._vocabulary: Future[llguidance.LLTokenizer] = Future()
        self._vocabulary.set_result(_vocabulary(tokenizer))
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # no parser dumps

    async def error(self, grammar: str) -> str:
        """Why ``grammar`` does not compile in time ("" when it does); once per grammar."""
        key = hashlib.blake2b(grammar.encode(), digest_size=16).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = asyncio.ensure_future(self._verdict(grammar))
            self._verdicts[key] = verdict
            if len(self._verdicts) > self._capacity:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(key)
        return await asyncio.shield(verdict)

    async def _verdict(self, grammar: str) -> str:
        """Compile in a free thread, on the clock from the moment it starts."""
        await asyncio.wrap_future(self._vocabulary)
        if self._free is None:
            self._free = asyncio.Semaphore(COMPILE_THREADS)
        await self._free.acquire()  # so the pool never queues: the thread starts now
        compiling = asyncio.get_running_loop().run_in_executor(
            self._threads, self._compile, grammar
        )
        compiling.add_done_callback(lambda _: self._free.release())
        try:
            return await asyncio.wait_for(asyncio.shield(compiling), self._timeout)
        except asyncio.TimeoutError:
            log.warning(
                "a grammar of %d characters took over %.2f s to compile",
                len(grammar),
                self._timeout,
            )
            return f"the grammar takes longer than {self._timeout:g} s to compile"

    def _compile(self, grammar: str) -> str:
        """In a compile thread."""
        began = time.perf_counter()
        matcher = llguidance.LLMatcher(
            self._vocabulary.result(), grammar, log_level=0, limits=self._limits
        )
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: some grammars fail only there
        log.debug("compiled a grammar in %.3f s", time.perf_counter() - began)
        if not matcher.is_error():
            return ""
        message = matcher.get_error().removesuffix("<non-verbose/>").strip()
        message = message or "the grammar does not compile"
        return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


def _vocabulary(tokenizer: ChatTokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the model's vocabulary (0.4 s for 49,152 tokens here)."""
    began = time.perf_counter()
    vocabulary = llguidance.LLTokenizer(
        tokenizer.tokenizer.to_str(),
        n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids),
    )
    log.info(
        "grammar vocabulary: %d tokens in %.2f s", tokenizer.vocab_size, time.perf_counter() - began
    )
    return vocabulary
