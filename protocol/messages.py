"""Every message that crosses a process boundary, as msgspec structs.

Conventions (see ../docs/architecture.md):
- every struct is ``array_like`` (encoded as a msgpack array): fields are only ever appended,
  with defaults, and never reordered, so an older peer can still decode a newer message; a field
  removed or reordered bumps ``PROTOCOL_VERSION``, and so does a new field an older peer must not
  ignore (``SamplingParams.grammar``: an older worker would sample unconstrained);
- one tagged union per receiving socket (``SchedulerToWorker``, ``WorkerToScheduler``,
  ``FrontendToScheduler``, ``SchedulerToFrontend``), decoded by one typed decoder, so a message
  of the wrong type is a decode error, never a surprise;
- the messages that introduce a peer (FrontendHello, SchedulerInfo, WorkerReady, SchedulerHello)
  carry ``protocol_version`` as their first field, so a peer on another version can still read
  it and refuse them by name;
- a step sends what changed (new tokens, new block ids), not whole request state.

The scheduler and worker's messages are here; the frontends' are in ``protocol.frontend_messages``
and ``Message``, ``Heartbeat`` and the version in ``protocol.base``; this module re-exports them
all, so every message is imported from here.
"""

from __future__ import annotations

import msgspec

from protocol.base import PENDING_TOKEN, PROTOCOL_VERSION, Heartbeat, Message
from protocol.frontend_messages import (
    Abort,
    AddRequest,
    FrontendHello,
    FrontendToScheduler,
    Outputs,
    RequestOutput,
    SchedulerInfo,
    SchedulerToFrontend,
)
from protocol.params import SamplingParams
from protocol.stats import EngineStats

__all__ = [
    "PENDING_TOKEN",
    "PROTOCOL_VERSION",
    "Abort",
    "AddRequest",
    "CompileGrammar",
    "EngineStats",
    "FrontendHello",
    "FrontendToScheduler",
    "GrammarCompiled",
    "Heartbeat",
    "Message",
    "Outputs",
    "RequestOutput",
    "Rewind",
    "RowSummary",
    "Sample",
    "SamplingParams",
    "SchedulerHello",
    "SchedulerInfo",
    "SchedulerToFrontend",
    "SchedulerToWorker",
    "Shutdown",
    "StepInput",
    "StepItem",
    "StepResult",
    "WorkerReady",
    "WorkerToScheduler",
]

# ---------------------------------------------------------------------------------------------
# Scheduler -> worker


class StepItem(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """One request's share of one step.

    The worker keeps one cache row per slot: the row's block table and how many tokens of K/V
    it holds. ``new_blocks`` are appended to that block table before the forward. ``token_ids``
    are the tokens to compute, at positions ``[start, start + len(token_ids))``; every position
    below ``start`` is already cached in the row. ``fresh`` begins a new row: ``new_blocks`` is
    then its whole block table, and it carries ``params`` and ``prompt_len`` (the worker needs
    both for penalties and seeds; a recomputed request resends its prompt plus everything it had
    generated). A fresh row may start past 0: its first ``start // block_size`` blocks already
    hold the K/V of ``cached_token_ids`` (a prefix-cache hit, a whole number of blocks), which
    the worker must never write.
    ``sample`` is False for a prefill chunk that does not reach the end of the known tokens.
    ``token_ids == [PENDING_TOKEN]`` (only ever alone, on a row that is not fresh) feeds back the
    token the worker sampled for this row in the row's previous step.
    ``num_draft`` (speculative decoding): the last ``num_draft`` of ``token_ids`` are draft
    tokens, and the worker samples at each of the last ``num_draft + 1`` positions (the
    ``Sample`` then carries the further ones in ``draft_samples``). Only a decode of a row that
    is not fresh drafts; the scheduler decides which drafts it accepts and
    rewinds the row over the rest (``StepInput.rewinds``). The token before the drafts may be
    ``PENDING_TOKEN``: the drafts then guess past the row's previous sample too.
    """

    request_id: str
    slot: int
    new_blocks: list[int]
    token_ids: list[int]
    start: int
    sample: bool = True
    params: SamplingParams | None = None
    prompt_len: int = 0
    fresh: bool = False
    cached_token_ids: list[int] = []
    num_draft: int = 0
    # A fresh row re-attached to K/V an earlier worker wrote into the shared pool (see
    # docs/kv_pool.md): its blocks up to position ``start`` hold that K/V, and ``start`` need
    # not end a block. An older worker ignores the field and refuses the unaligned start.
    attached: bool = False


class Rewind(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """Cut a row back after rejected draft tokens: it keeps its first ``num_blocks`` blocks and
    the K/V (and history) of its first ``num_cached`` tokens."""

    slot: int
    num_blocks: int
    num_cached: int


class StepInput(Message):
    """One iteration's work. ``released_slots`` are emptied before any item runs, then the
    ``rewinds`` cut their rows back."""

    step_id: int
    items: list[StepItem]
    released_slots: list[int] = []
    audit: bool = False
    rewinds: list[Rewind] = []
    # Blocks whose K/V checksums the worker returns before running any item: after a
    # re-attach, the scheduler checks the kept K/V against the sums it recorded (docs/kv_pool.md).
    verify_blocks: list[int] = []
    # (block, first slot, end slot): slot ranges of partial blocks whose sums the worker returns
    # with ``verify_blocks``' (``StepResult.range_sums``).
    verify_ranges: list[tuple[int, int, int]] = []


class Shutdown(Message):
    """Ask the worker to exit cleanly."""

    reason: str = ""


class SchedulerHello(Message):
    """The scheduler's greeting to a worker that has announced itself (or that it waits for)."""

    protocol_version: int = PROTOCOL_VERSION


class CompileGrammar(Message):
    """Compile ``grammar`` now, off the step path, and say so with ``GrammarCompiled``.

    The scheduler holds a constrained request back until the worker has compiled its grammar
    (vLLM's ``WAITING_FOR_FSM``): a compile then never delays a step that serves others.
    ``key``: the scheduler's name for the grammar (``scheduler.grammar_gate.grammar_key``).
    """

    key: str
    grammar: str


SchedulerToWorker = StepInput | Shutdown | SchedulerHello | CompileGrammar


# ---------------------------------------------------------------------------------------------
# Worker -> scheduler


class Sample(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """One sampled token. ``top_logprobs`` is ``[(token_id, logprob), ...]``, best first.
    ``draft_samples``: for an item with draft tokens, the tokens sampled at the positions after
    ``token_id``'s, one per draft token (``token_id`` is sampled after the item's first token).
    """

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    draft_samples: list[int] = []


class RowSummary(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """What the worker's cache row for one slot holds, sent while auditing is on.

    ``request_id`` is the tenant the row was last started for, or None for an empty row.
    ``num_cached`` is how many tokens of K/V the row holds.
    """

    slot: int
    request_id: str | None
    block_ids: list[int]
    num_cached: int


class StepResult(Message):
    """The answer to one StepInput. ``rows`` is filled only when the step asked for an audit.

    ``error`` is set when the worker refused the step (a protocol violation): nothing of it ran,
    and the scheduler must treat the worker's rows as lost.
    """

    step_id: int
    samples: list[Sample]
    rows: list[RowSummary] | None = None
    forward_s: float = 0.0
    error: str | None = None
    resident_bytes: int = 0  # the worker process's resident memory after the step (0: unknown)
    # Grammar masks (worker.grammar): the constrained rows sampled, the mask thread's time
    # (hidden behind the forward), and the sampler's time waiting for and applying the masks.
    grammar_rows: int = 0
    grammar_fill_s: float = 0.0
    grammar_apply_s: float = 0.0
    decode_path: str = ""  # "eager", "graphs", "compiling", "compiled", "failed" (Worker's)
    num_threads: int = 0  # the worker's intra-op threads after the step (worker.cpu.threads)
    # grammars compiled in this step's mask fill, on its path: ones the scheduler did not hold
    # back (a row resumed on a new worker, one the worker's cache had dropped)
    grammar_compiles: int = 0
    # (block, CRC-32 of its K/V bytes, every layer) for each block this step filled, on a
    # shared pool, and for each of the step's ``verify_blocks``.
    block_sums: list[tuple[int, int]] = []
    # (block, first slot, end slot, CRC-32 of those slots' K/V, every layer) for the slots each
    # item wrote into a block it left partial (the row's last), on a shared pool, and for each
    # of the step's ``verify_ranges``.
    range_sums: list[tuple[int, int, int, int]] = []


class WorkerReady(Message):
    """A worker announces itself and its cache geometry (of a tensor-parallel worker: the
    geometry every rank shares, with each rank holding its share of the KV heads)."""

    protocol_version: int
    model_id: str
    num_blocks: int
    block_size: int
    num_slots: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    device: str = "cpu"
    dtype: str = "float32"
    tensor_parallel_size: int = 1  # ranks behind this one worker (appended: no version bump)
    # How the worker runs its steps, chosen once at start (``worker.plan.Plan.summary``): what
    # its log, /metrics and the web page show.
    plan: dict[str, str] = {}
    # The shared K/V pool it mapped (``holder/``): its id and generation after this worker's
    # attach ("" and 0 for a private pool), or the kind of reason it is private although
    # --shared-kv-pool asked for a shared one ("" otherwise).
    pool_id: str = ""
    pool_generation: int = 0
    pool_fallback: str = ""
    # A tensor-parallel group's shared pools, one per rank, rank 0 first: (pool id, generation
    # after this group's attach). ``pool_id`` and ``pool_generation`` are rank 0's. Empty for a
    # worker of one rank, and for a group whose pools are private.
    pool_ranks: list[tuple[str, int]] = []


class GrammarCompiled(Message):
    """A ``CompileGrammar`` done: ``key``'s grammar is compiled and cached in the worker.

    Sent, like heartbeats, from the worker's second socket (the main one only answers steps),
    so ``sender`` names the main socket's identity. ``error``: why it does not compile ("" when
    it does); its requests run anyway, and the mask then allows only EOS.
    """

    sender: str
    key: str
    error: str = ""
    seconds: float = 0.0


WorkerToScheduler = StepResult | WorkerReady | Heartbeat | GrammarCompiled
