"""Grammar-constrained sampling: one interface, one file per engine, chosen once.

- ``base``: ``GrammarBackend`` and ``Matcher``, the operations an engine provides;
- ``llguidance_backend``: ``LLGuidanceBackend``, the one engine (why: docs/performance.md);
- ``masks``: ``GrammarMasks``, each row's matcher and the masks of one step's sampled rows.

The worker calls ``grammar_masks`` once, at start; the backend itself is built on first need.
"""

from __future__ import annotations

from models.files import ModelFiles
from worker.grammar.base import GrammarBackend, Matcher
from worker.grammar.masks import GrammarMasks, PendingMasks

__all__ = ["GrammarBackend", "GrammarMasks", "Matcher", "PendingMasks", "grammar_masks"]


def grammar_masks(files: ModelFiles, vocab_size: int, eos_token_ids: list[int]) -> GrammarMasks:
    """Masks over the model's own tokenizer, the one the frontend validates grammars with."""

    def load() -> GrammarBackend:
        from models.tokenizer import load_tokenizer
        from worker.grammar.llguidance_backend import LLGuidanceBackend

        tokenizer = load_tokenizer(files).tokenizer
        return LLGuidanceBackend(tokenizer.to_str(), vocab_size, list(eos_token_ids))

    return GrammarMasks(load, vocab_size, list(eos_token_ids))
