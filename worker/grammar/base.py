"""``GrammarBackend``: the operations every grammar engine provides to the worker.

A backend is built once, as the worker starts (``worker.grammar.masks`` builds it in its own
thread), and nothing else asks which one it has:

- ``compile``: compile one grammar string ahead of its rows, and keep it (any thread);
- ``matcher``: a fresh matcher for one grammar string (``SamplingParams.grammar``), compiling
  it there if ``compile`` did not (counted in ``compiles_in_place``);
- ``fill``: the token masks of several matchers, each into one row of a bitmask.

A ``Matcher`` follows one sequence: ``consume`` its tokens, ask ``error``; ``fork`` and
``try_consume`` walk a copy through a draft's tokens without ever erring. Masks are bitmasks:
int32 (rows, ceil(vocab / 32)), bit ``t % 32`` of word ``t // 32`` set when token ``t`` may
come next; once a grammar is complete, or in error, only the EOS tokens are set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Matcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def consume(self, tokens: list[int]) -> None:
        """Advance past ``tokens``; a token the grammar forbids puts the matcher in error."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher is in error ("" while it is not)."""

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy at the same position."""

    @abstractmethod
    def try_consume(self, tokens: list[int]) -> int:
        """Advance past the longest prefix of ``tokens`` the grammar allows; its length. The
        matcher is never put in error."""


class GrammarBackend(ABC):
    """Compiles grammars over one vocabulary and fills their token masks."""

    name: str  # how the worker's log names it
    vocab_size: int  # the model's: the width of every mask, in tokens
    compiles_in_place: int  # grammars ``matcher`` compiled itself, in a step's path

    @abstractmethod
    def compile(self, grammar: str) -> str:
        """Compile ``grammar`` and keep it for ``matcher``; why it does not compile ("" when it
        does). Thread-safe."""

    @abstractmethod
    def matcher(self, grammar: str) -> Matcher:
        """A matcher at the start of ``grammar`` (in error if the grammar is invalid)."""

    @abstractmethod
    def fill(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's mask of allowed next tokens into ``bitmask[row]``."""
