"""What every message shares: the ``Message`` base (a tagged, array-like msgspec struct), the
protocol's version, the pending-token marker and ``Heartbeat``, which every socket carries.
Conventions: ``protocol.messages``."""

from __future__ import annotations

import msgspec

from protocol.stats import EngineStats

# 9: partial blocks' sums (StepInput.verify_ranges, StepResult.range_sums); 8: a KV pool per
# tensor-parallel rank (PoolGeometry.rank, WorkerReady.pool_ranks); 7: draft tokens
# (StepItem.num_draft); 6: CompileGrammar
PROTOCOL_VERSION = 9

PENDING_TOKEN = -1
"""A token the scheduler has not seen yet: the one the worker sampled for this row in the
row's previous step. Overlapped scheduling plans step N+1 before step N's samples are back, so
a decode item of step N+1 names its input token this way and the worker substitutes its own."""


class Message(msgspec.Struct, tag=True, array_like=True, gc=False, frozen=True, kw_only=True):
    """Base of every top-level message. The tag is the class name."""


class Heartbeat(Message):
    """Liveness, sent by every process to its peers at a fixed period while idle or busy.

    ``stats``: the scheduler's gauges, on every beat it sends a frontend (None from any other
    sender). They ride the beat, not each step's Outputs: /metrics and the web page read them
    at most one period old, and a step's message stays the tokens alone.
    """

    sender: str
    time: float
    stats: EngineStats | None = None
