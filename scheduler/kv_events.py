"""KvEventLog: the prefix cache's index as it changes, written down as vLLM's KV events.

It is told what the index gains (``stored``: a run of one request's full blocks, with their
tokens and the hash before them), what it loses to an eviction (``removed``) and when it is
forgotten whole (``cleared``: the worker's rows were lost, or its pool replaced), and keeps the
events in order until the scheduler process publishes them once an iteration
(``scheduler.kv_publisher``). It is only a witness: nothing reads it back, so it cannot change
what the cache does. Replaying its events from the start rebuilds the index's set of hashes
exactly (as ``external_hash`` integers).
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)


class KvEventLog:
    """The events since the last ``take``, oldest first; evictions in a row share one event."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._removed: list[int] = []  # evictions not yet in an event

    def stored(
        self,
        digests: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Blocks joined the index: ``digests`` of consecutive blocks whose tokens are
        ``token_ids``, after the block hashed ``parent`` (None: they start the sequence)."""
        self._flush_removed()
        self._events.append(
            BlockStored(
                block_hashes=[external_hash(digest) for digest in digests],
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=list(token_ids),
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM,
            )
        )

    def removed(self, digest: bytes) -> None:
        """A block was evicted: its hash left the index."""
        self._removed.append(external_hash(digest))

    def cleared(self) -> None:
        """The whole index was forgotten."""
        self._flush_removed()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(block_hashes=self._removed, medium=MEDIUM))
            self._removed = []
