"""Geometry: what the scheduler says about its worker's cache, as the frontend uses it.

The client builds it from SchedulerInfo and the request parser bounds prompts and max_tokens
by it; neither depends on the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """What the scheduler said about its worker: context length and KV pool size in tokens."""

    model_id: str
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def pool_tokens(self) -> int:
        """How many tokens the whole KV pool can hold."""
        return self.num_blocks * self.block_size
