"""``GrammarMasks``: the token masks of the rows a step samples under a grammar.

The matchers live in the worker, next to the sampler: with overlap the scheduler plans step N+1
before step N's token is known, and only the worker has sampled it. A row's matcher follows the
row's generated tokens (``Row.output_tokens``): it is built at the row's first sample and
advanced by every token fed back since, so a row begun again after a preemption or on a new
worker, whose StepItem carries the prompt and every generated token, rebuilds it exactly.

A grammar is compiled ahead of its rows: the scheduler holds a constrained request back and
asks (``compile``, in one of two compile threads), and releases it once the worker says the
grammar is compiled. A row whose grammar the backend does not hold (a row resumed on a new
worker) compiles it in the mask thread, and that step waits for it (``PendingMasks.compiles``).

Per step, ``start`` hands the constrained rows to one thread, which brings their matchers up to
date and fills their masks while the forward runs (llguidance drops the GIL); the sampler then
calls ``PendingMasks.apply``, after penalties, logit_bias and min_tokens and before temperature,
the filters and the draw. A step without a constrained row does no mask work at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitTimeout
from dataclasses import dataclass

import numpy as np
import torch

from worker.grammar.base import GrammarBackend, Matcher
from worker.rows import Row

log = logging.getLogger(__name__)


@dataclass
class _GrammarState:
    """A row's matcher and how many of the row's generated tokens it has consumed."""

    matcher: Matcher
    consumed: int = 0


@dataclass
class _Draft:
    """A draft item's walk through its draft tokens: the matcher of the position filled last
    (a copy; the row's own matcher stays before the drafts, and takes the accepted ones from
    the row's history next step) and where that position is. A draft token the grammar
    forbids ends the walk: its position's mask forbids it, so no sample after it is kept, and
    the positions after it get copies of that matcher."""

    matcher: Matcher
    at: int
    valid: bool = True

    def step(self, history: list[int], end: int) -> Matcher:
        """The matcher of the position before ``history[end]`` (a matcher of its own: one
        fill never takes a matcher twice)."""
        fork = self.matcher.fork()
        if self.valid:
            self.valid = fork.try_consume(history[self.at : end]) == end - self.at
        self.matcher, self.at = fork, end
        return fork


class PendingMasks:
    """One step's masks, being filled; ``apply`` waits for them."""

    def __init__(self, index: list[int], bitmask: np.ndarray, filled: Future, vocab: int) -> None:
        self.index = index  # the constrained rows, as positions in the step's sampled rows
        self.bitmask = bitmask  # (len(index), words) int32
        self._filled = filled  # its result: (the mask thread's seconds, grammars it compiled)
        self._vocab = vocab
        self.apply_s = 0.0  # the sampler's seconds waiting for and applying the masks

    @property
    def fill_s(self) -> float:
        """The mask thread's seconds for this step (matchers brought up to date, masks filled),
        once ``apply`` has waited for them."""
        return self._filled.result()[0] if self._filled.done() else 0.0

    @property
    def compiles(self) -> int:
        """Grammars the mask thread compiled for this step, in its path (0 when the scheduler
        held their requests back until they were compiled), once ``apply`` has waited."""
        return self._filled.result()[1] if self._filled.done() else 0

    def filled(self) -> np.ndarray:
        """The bitmask, once filled: (len(index), words) int32, for the device sampler to unpack
        where the scores are (``DeviceSampler.unpack``); the wait counts in ``apply_s``."""
        began = time.perf_counter()
        self._filled.result()
        self.apply_s += time.perf_counter() - began
        return self.bitmask

    def allowed(self) -> torch.Tensor:
        """(len(index), vocab) bool: which tokens each constrained row may take next."""
        self._filled.result()
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self._vocab]).view(torch.bool)

    def apply(self, scores: torch.Tensor, logits: torch.Tensor, rows: list[Row]) -> None:
        """Set to -inf, in ``scores`` (S, vocab), every token a constrained row's grammar forbids.
        Where min_tokens banned all the grammar allows (EOS, once it is complete), the grammar
        wins: those tokens come back with their raw ``logits``, so no row is left with nothing."""
        began = time.perf_counter()
        allowed = self.allowed()
        forbidden = allowed.logical_not()
        if len(self.index) == scores.shape[0]:  # every sampled row is constrained: in place
            scores.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(self.index)
            scores[index] = scores[index].masked_fill_(forbidden, float("-inf"))
        for k, i in enumerate(self.index):
            row = rows[i]
            if len(row.history) - row.prompt_len >= row.params.min_tokens:
                continue  # min_tokens banned nothing: the mask left the grammar's tokens
            if not torch.isfinite(scores[i]).any():
                scores[i] = torch.where(allowed[k], logits[i], float("-inf"))
        self.apply_s = time.perf_counter() - began


class GrammarMasks:
    """Builds the backend, keeps each row's matcher, fills and applies masks.

    ``load_backend`` builds the grammar backend for the model's vocabulary (seconds: it reads
    the tokenizer). With ``eager`` it starts at once, in the mask thread, so that it is ready
    before the first constrained step (``wait_built``); otherwise on the first constrained
    row. If it fails (a model without a tokenizer), constrained rows may only take EOS: they end
    at once, and the log says why.
    """

    def __init__(
        self,
        load_backend: Callable[[], GrammarBackend],
        vocab_size: int,
        eos_token_ids: list[int],
        eager: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._load_backend = load_backend
        self._backend: GrammarBackend | None = None
        self._unavailable: str | None = None  # why no backend could be built
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # Compiles ahead of their rows; two, so one long compile does not hold up the next.
        self._compilers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._built: Future | None = self._thread.submit(self._build_backend) if eager else None

    def wait_built(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for an eager build; whether the backend is
        built (or could not be: ``unavailable``). True at once without an eager build."""
        if self._built is None:
            return True
        try:
            self._built.result(timeout)
        except WaitTimeout:
            return False
        return True

    @property
    def unavailable(self) -> str | None:
        """Why grammars cannot be enforced (None while they can, or before a build)."""
        return self._unavailable

    def compile(self, grammar: str, done: Callable[[str, float], None]) -> None:
        """Compile ``grammar`` in a compile thread, then call ``done(error, seconds)`` there
        (``error`` "" when it compiles; why grammars cannot be enforced when no backend could
        be built, and then its rows may only take EOS)."""
        self._compilers.submit(self._compile, grammar, done)

    def _compile(self, grammar: str, done: Callable[[str, float], None]) -> None:
        began = time.perf_counter()
        if self._backend is None and self._unavailable is None:
            # the mask thread builds the backend (after an eager build queued there, if any)
            self._thread.submit(lambda: self._backend or self._build_backend()).result()
        backend = self._backend
        error = backend.compile(grammar) if backend is not None else (self._unavailable or "")
        done(error, time.perf_counter() - began)

    def start(self, rows: list[Row], backs: list[int] | None = None) -> PendingMasks | None:
        """Begin filling the masks of the constrained rows among ``rows`` (a step's sampled
        positions, in order; a draft item's row once per position). ``backs``: per position,
        how many of its row's tokens fed this step come after it (k, ..., 1, 0 for a draft
        item's k + 1 positions; 0 elsewhere). None when no row is constrained."""
        backs = backs or [0] * len(rows)
        index = [i for i, row in enumerate(rows) if row.params.grammar is not None]
        if not index:
            return None
        bitmask = np.zeros((len(index), self.words), dtype=np.int32)
        positions = [(rows[i], backs[i]) for i in index]
        filled = self._thread.submit(self._fill, positions, bitmask)
        return PendingMasks(index, bitmask, filled, self.vocab_size)

    def _fill(self, positions: list[tuple[Row, int]], bitmask: np.ndarray) -> tuple[float, int]:
        """In the mask thread: each row's matcher brought up to date, then every mask; returns
        the seconds it took and the grammars it had to compile."""
        began = time.perf_counter()
        backend = self._backend or self._build_backend()
        if backend is None:
            for eos in self._eos:
                bitmask.view(np.uint32)[:, eos // 32] |= np.uint32(1 << (eos % 32))
            return time.perf_counter() - began, 0
        compiled = backend.compiles_in_place
        matchers: list[tuple[Matcher, int]] = []
        drafting: dict[int, _Draft] = {}  # id(row) -> its draft's walk so far
        for k, (row, back) in enumerate(positions):
            end = len(row.history) - back  # the tokens before the position sampled
            walk = drafting.get(id(row))
            if walk is None:  # the row's first position: its own matcher, up to date
                matcher = self._matcher(row, backend, end)
                if back:
                    drafting[id(row)] = _Draft(matcher, end)
            else:  # a copy one draft token further
                matcher = walk.step(row.history, end)
            matchers.append((matcher, k))
        backend.fill(matchers, bitmask)
        return time.perf_counter() - began, backend.compiles_in_place - compiled

    @staticmethod
    def _matcher(row: Row, backend: GrammarBackend, end: int) -> Matcher:
        """The row's matcher, advanced over its generated tokens before ``end``."""
        state = row.grammar_state
        if state is None:
            state = row.grammar_state = _GrammarState(backend.matcher(row.params.grammar))
        new = row.history[row.prompt_len + state.consumed : end]
        if new:
            state.matcher.consume(new)
            state.consumed += len(new)
        return state.matcher

    def _build_backend(self) -> GrammarBackend | None:
        """In the mask thread (the first task of an eager one)."""
        if self._unavailable is not None:
            return None
        began = time.perf_counter()
        try:
            self._backend = self._load_backend()
        except Exception as exc:  # noqa: BLE001 - any failure leaves grammars unenforceable
            self._unavailable = f"{type(exc).__name__}: {exc}"
            log.warning("grammars cannot be enforced (%s): their requests end at once", exc)
            return None
        seconds = time.perf_counter() - began
        name = self._backend.name
        log.info("grammars: %s over %d tokens, built in %.2f s", name, self.vocab_size, seconds)
        return self._backend
