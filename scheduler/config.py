"""SchedulerConfig: the scheduler's knobs. The cache geometry comes from the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.kv_events import FORMATS
from protocol.params import MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches.

    ``num_slots`` and ``max_model_len`` of None take the worker's values (they may only shrink
    them). ``watermark_blocks`` of None means the default reserve, int(0.01 * num_blocks).
    ``num_blocks`` of None uses the worker's whole pool; a smaller number uses only that many of
    its blocks (ids ``0..num_blocks-1``), so one loaded worker can be driven through several
    pool sizes. ``audit`` runs the invariant checks between every iteration (and asks the worker
    for its rows). ``overlap`` plans step N+1 while the worker computes step N (two steps in
    flight); False waits for each result before planning the next. ``enable_prefix_caching``
    lets requests share the K/V of full blocks with equal hashes (a common prefix).
    ``kv_events_endpoint`` turns on vLLM's KV events (``scheduler.kv_publisher``): the prefix
    cache's changes published there, with a replay socket at ``kv_events_replay_endpoint``.
    ``speculative`` "ngram" drafts up to ``num_speculative_tokens`` tokens per request and step
    from its own context (``scheduler.speculation``); a request's own
    ``num_speculative_tokens`` overrides the number (0 turns it off for that request).
    """

    num_slots: int | None = None
    num_blocks: int | None = None
    token_budget: int = field(
        default=2048,
        metadata={"help": "tokens computed per iteration; longer prompts prefill in chunks"},
    )
    watermark_blocks: int | None = field(
        default=None,
        metadata={"help": "blocks held back at admission", "shown": "1% of the pool"},
    )
    max_model_len: int | None = None
    audit: bool = field(
        default=False,
        metadata={"help": "check every ledger invariant between iterations; a violation stops it"},
    )
    overlap: bool = field(
        default=True,
        metadata={
            "help": "plan step N+1 while the worker computes step N",
            "off": ("--disable-overlap",),
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "share the K/V of full blocks between requests with a common prefix"},
    )

    speculative: str = field(
        default="off",
        metadata={
            "help": "draft tokens from each request's own prompt and output (ngram: prompt "
            "lookup) and verify them in its next step",
            "choices": ("off", "ngram"),
        },
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata={"help": "draft tokens a request verifies per step, at most (with speculative)"},
    )
    speculative_max_running: int = field(
        default=8,
        metadata={
            "help": "no drafts while more requests than this run: each draft is a row of 4-bit "
            "arithmetic (on a GPU, a step without CUDA graphs), and in a busy batch drafts "
            "rarely pay"
        },
    )

    kv_events_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "publish the prefix cache's KV events here, in vLLM's format (binds this "
            "host's tcp://ADDRESS:PORT or ipc://PATH, else connects)",
            "shown": "off",
        },
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "where subscribers ask for missed KV event batches (bound)",
            "shown": "none",
        },
    )
    kv_events_format: str = field(
        default="array",
        metadata={
            "help": "each KV event as vLLM's array (Dynamo, AIBrix, llm-d) or tagged map "
            "(vLLM's newer releases; vllm-router)",
            "choices": FORMATS,
        },
    )
    kv_events_topic: str = field(
        default="",
        metadata={"help": "the KV events' topic, empty by default (llm-d reads kv@POD@MODEL)"},
    )

    @property
    def speculative_tokens(self) -> int:
        """The default draft tokens per request and step (0: speculation off)."""
        return self.num_speculative_tokens if self.speculative == "ngram" else 0

    def __post_init__(self) -> None:
        if self.num_slots is not None and self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.watermark_blocks is not None and self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.speculative not in ("off", "ngram"):
            raise ValueError(f"speculative must be off or ngram, got {self.speculative!r}")
        if self.speculative_max_running < 0:
            raise ValueError(
                f"speculative_max_running must be >= 0, got {self.speculative_max_running}"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
        if self.kv_events_format not in FORMATS:
            raise ValueError(
                f"kv_events_format must be array or map, got {self.kv_events_format!r}"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
