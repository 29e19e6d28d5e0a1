"""Grammar-constrained sampling: one interface, one file per engine, chosen once.

- ``base``: ``GrammarBackend`` and ``Matcher``, the operations an engine provides;
- ``llguidance_backend``: ``LLGuidanceBackend``, the one engine (why: docs/performance.md);
- ``masks``: ``GrammarMasks``, each row's matcher and the masks of one step's sampled rows;
- ``vocabulary``: ``tokenizer_json``, the vocabulary the backend reads (cached for a GGUF).

The worker calls ``grammar_masks`` once, at start, and its leader builds the backend then, in
the mask thread, beside the rest of its start (``GrammarMasks.wait_built``): no step waits for
it.
"""

from __future__ import annotations

from models.files import ModelFiles
from worker.grammar.base import GrammarBackend, Matcher
from worker.grammar.masks import GrammarMasks, PendingMasks

__all__ = ["GrammarBackend", "GrammarMasks", "Matcher", "PendingMasks", "grammar_masks"]


def grammar_masks(
    files: ModelFiles, vocab_size: int, eos_token_ids: list[int], eager: bool = True
) -> GrammarMasks:
    """Masks over the model's own tokenizer, the one the frontend validates grammars with;
    ``eager``: build the backend now (a rank that never samples builds none)."""

    def load() -> GrammarBackend:
        from worker.grammar.llguidance_backend import LLGuidanceBackend
        from worker.grammar.vocabulary import tokenizer_json

        return LLGuidanceBackend(tokenizer_json(files), vocab_size, list(eos_token_ids))

    return GrammarMasks(load, vocab_size, list(eos_token_ids), eager=eager)
