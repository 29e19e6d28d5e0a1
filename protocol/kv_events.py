"""KV events on the wire, in vLLM's format: what KV-aware routers subscribe to.

llm-d's KV cache manager, NVIDIA Dynamo's KV router, AIBrix and vllm-router's ``kv_aware``
policy decode vLLM's ``vllm/distributed/kv_events.py`` messages; these structs encode the same
bytes. A publication is three ZeroMQ frames on a PUB socket: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... per publisher) and a msgpack ``KVEventBatch``. Every struct is
array-like and every event is tagged with its class name, so a batch is
``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ...]]``.

A subscriber that missed a sequence number asks the replay socket (a ROUTER) for everything from
a number on: it sends ``start`` as 8 big-endian bytes (after an empty delimiter frame) and gets
back ``(seq, payload)`` for each batch still buffered, then ``(-1, b"")``.

vLLM's newer releases send each event as a map instead, tagged under ``"type"`` and named by
field (``{"type": "BlockStored", "block_hashes": [...], ...}``) inside the same array batch;
vllm-router reads only that form, Dynamo and AIBrix the arrays, llm-d either. ``as_map`` gives
an event in that form: a publisher sends one form or the other (``--kv-events-format``).

Block hashes are opaque integers to every consumer: they match a ``BlockRemoved`` to its
``BlockStored`` and a block to its ``parent_block_hash``, and the routers rebuild their own
keys from ``token_ids``. nanoserve sends what vLLM sends by default: the last 8 bytes of its
block hash as an unsigned big-endian integer (``external_hash``).
"""

from __future__ import annotations

import msgspec

FORMATS = ("array", "map")  # each event as an array-like struct, or as a tagged map
MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (as against offloaded copies)
END_OF_REPLAY = -1  # the sequence number that ends a replay


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to a replica's prefix cache."""


class BlockStored(KVCacheEvent):
    """Full blocks joined the cache: consecutive blocks of one sequence, their tokens, and the
    hash of the block before the first (None: the first starts the sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (evicted to hold other K/V)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the cache (the worker's rows were lost, or its pool replaced)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publication: the events of one scheduler iteration, in order, and its wall time."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def external_hash(digest: bytes) -> int:
    """A block hash as it goes out: the last 8 bytes, unsigned big-endian (vLLM's default)."""
    return int.from_bytes(digest[-8:], "big")


def as_map(event: KVEvent) -> dict[str, object]:
    """``event`` as vLLM's newer releases send it: a map, its tag under ``"type"`` first, and a
    stored block's ``lora_name`` too (those releases' field, which vllm-router requires)."""
    fields = msgspec.structs.asdict(event)
    if isinstance(event, BlockStored):
        fields["lora_name"] = None
    return {"type": type(event).__name__, **fields}
