"""The monitor feed: what the scheduler publishes for the web page, as msgspec structs.

The scheduler binds an XPUB socket (``Addresses.monitor``) and, only while some frontend
subscribes, publishes one ``PoolSnapshot`` a few times a second. Frontends relay it to browsers.
Same conventions as ``messages.py``: ``array_like`` structs, ``kw_only`` on each class, fields
only ever appended with defaults, the greeting field ``protocol_version`` first. Nothing here
carries prompt text: request ids, counts and states only.

The pool travels as ``PoolStates``: one byte per block (a bitmap of four states, 5.8 KB for a
5,825-block pool), copied from the allocator's own ``block_states``, and each running request's
row lists the blocks it holds. Building that costs the scheduler one copy and a list per
running request, however fragmented the pool. Frontends turn it into runs for browsers
(``frontend.pool_runs``): ``PoolRuns.runs`` is a flat list of triples
``(state, owner_set, length)`` covering ``range(num_blocks)`` in block order; ``owner_sets[i]``
lists the holders of a run with owner set ``i`` as indexes into ``requests`` (``owner_sets[0]``
is the empty set of free blocks).
"""

from __future__ import annotations

import msgspec

from protocol.messages import PROTOCOL_VERSION, Message

# The states of a block on the pool map (see scheduler/block_allocator.py).
FREE = 0  # uncached-free: holds nothing worth keeping
CACHED = 1  # cached-free: no holder, its K/V kept for a prefix-cache hit
HELD = 2  # held by exactly one request
SHARED = 3  # held by several requests (a shared prefix)
STATES = ("free", "cached", "held", "shared")


class _Part(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """Base of the snapshot's parts."""


class RequestRow(_Part, kw_only=True):
    """One waiting or running request as the page shows it: no text, only counts and ids."""

    request_id: str
    running: bool
    slot: int | None  # None while waiting
    num_blocks: int
    num_computed: int  # tokens with K/V (planned)
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_preemptions: int
    age_s: float  # since it arrived at the scheduler
    num_cached_tokens: int = 0  # prompt tokens its first admission found cached
    blocks: list[int] = []  # the block ids it holds, in order (a running request's; no text)


class PoolStates(_Part, kw_only=True):
    """The block ledger on the wire: ``states[b]`` is block b's state (FREE..SHARED)."""

    num_blocks: int
    block_size: int
    watermark_blocks: int
    states: bytes


class PoolRuns(_Part, kw_only=True):
    """The block ledger run-length encoded, as browsers get it (see the module docstring)."""

    num_blocks: int
    block_size: int
    watermark_blocks: int
    runs: list[int]
    owner_sets: list[list[int]]


class AuditRecord(_Part, kw_only=True):
    """The last audit between iterations (``--audit``): its result and how long it took."""

    ok: bool
    seconds: float
    age_s: float  # since it ran
    error: str = ""
    count: int = 0  # audits since the engine started


class Health(_Part, kw_only=True):
    """The worker and the scheduler as the scheduler sees them."""

    worker: str  # "ready", "lost" (waiting for one to come back) or "none"
    reason: str  # why no worker is ready ("" while one is)
    model_id: str
    device: str
    dtype: str
    workers_lost_total: int
    frontends_lost_total: int
    num_steps_total: int
    steps_in_flight: int
    num_preemptions_total: int
    audit: AuditRecord | None  # None while auditing is off or before the first audit
    uptime_s: float
    monitor_s_total: float  # the scheduler's time building and sending these snapshots
    # How the ready (or last known) worker runs its steps, as it announced (WorkerReady.plan):
    # one line per key on the page (attention, linears, dtype, K/V dtype, threads, ...).
    plan: dict[str, str] = {}


class Cadence(_Part, kw_only=True):
    """How the scheduler paces this feed, so a page can tell a throttled snapshot from a
    missing one: at most one per ``interval_s``, fewer while the snapshots' CPU time would pass
    ``budget`` of the scheduler's own, and at least one per ``max_gap_s`` while its loop runs."""

    interval_s: float
    max_gap_s: float
    budget: float  # the share of the scheduler's own CPU time the snapshots may take
    gap_s: float  # since the previous snapshot (0.0 for the first since a frontend subscribed)
    throttled: bool  # the budget held this snapshot back past ``interval_s``


class MonitorEvent(_Part, kw_only=True):
    """Something that happened: a worker lost or back, preemptions, an audit failure."""

    seq: int
    time: float  # wall clock, seconds
    kind: str  # "worker", "preemption", "frontend", "audit"
    text: str


class PoolSnapshot(Message, kw_only=True):
    """One picture of the scheduler: the pool, the queues, health, the latest events, and how
    this snapshot was paced (``cadence``).

    ``requests`` lists every running request first (owner sets index them), then the head of
    the waiting queue, at most ``MAX_WAITING_ROWS``; ``num_waiting`` is the whole queue.
    """

    protocol_version: int = PROTOCOL_VERSION
    seq: int = 0
    time: float = 0.0
    pool: PoolStates | None = None  # None until a worker has announced its pool
    requests: list[RequestRow] = []
    num_running: int = 0
    num_waiting: int = 0
    health: Health | None = None
    events: list[MonitorEvent] = []
    cadence: Cadence | None = None  # None from a scheduler that does not say


MAX_WAITING_ROWS = 200

SchedulerToMonitor = PoolSnapshot
