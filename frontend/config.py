"""FrontendConfig: everything the API process needs, validated once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from frontend.auth import parse_api_keys
from protocol.addresses import Addresses, default_addresses
from protocol.params import MAX_LOGPROBS


def _default_addresses() -> Addresses:
    return default_addresses(os.environ.get("NANOSERVE_RUN_ID", "default"))


@dataclass(frozen=True)
class FrontendConfig:
    """Options of one frontend process.

    ``model`` names the model for the tokenizer (None: the default model); ``tokenizer`` loads
    the tokenizer from elsewhere (a model without one, such as a test checkpoint).
    ``served_model_name`` is the name clients put in ``model`` (default: the model's id).
    ``scheduler_timeout``: silence after which in-flight requests fail and new ones get 503.
    ``stall_timeout``: /health turns 503 when requests run but no step finishes for this long.
    ``api_servers`` processes share ``port`` (SO_REUSEPORT: the kernel spreads connections over
    them), each one of these configs with its own ``api_server_index``.
    ``default_max_tokens`` caps ``max_tokens`` when a request leaves it out (None: fill up to
    the context length, as vLLM does).
    ``disable_any_whitespace`` and ``disable_additional_properties`` (vLLM's names; a request's
    ``structured_outputs`` may override them) say how JSON schemas compile: without free
    whitespace, and with every object that names its properties closed
    (``frontend.json_schema``). ``grammar_compile_timeout``: a grammar that takes longer to
    compile is refused (400).
    """

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    api_servers: int = field(
        default=1,
        metadata={
            "help": "frontend processes sharing the port (SO_REUSEPORT), each with its own "
            "tokenizer; of two or more, a dead one is restarted"
        },
    )
    api_server_index: int = 0  # which of them this process is (``nanoserve.api_servers``)
    model: str | None = None  # the option is WorkerConfig's: one model for both processes
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "load the tokenizer from elsewhere", "shown": "the model's"},
    )
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "the name clients give as model", "shown": "the model's name"},
    )
    addresses: Addresses = field(default_factory=_default_addresses)
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "require a Bearer token on /v1/*; several comma-separated, each a tenant "
            "of its own in the prefix cache",
            "shown": "none",
        },
    )
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger request bodies get 413"})
    max_stop_strings: int = field(
        default=16, metadata={"help": "the most stop strings a request may give"}
    )
    max_stop_string_chars: int = 256
    max_logprobs: int = field(
        default=MAX_LOGPROBS, metadata={"help": "the most logprobs a request may ask for"}
    )
    max_n: int = field(default=16, metadata={"help": "the most choices (n) a request may ask for"})
    default_max_tokens: int | None = field(
        default=None,
        metadata={"help": "cap for requests that give no max_tokens", "shown": "fill the context"},
    )
    disable_any_whitespace: bool = field(
        default=True,
        metadata={
            "help": "JSON under a schema without free whitespace between tokens (a request may "
            "say otherwise in structured_outputs)"
        },
    )
    disable_additional_properties: bool = field(
        default=True,
        metadata={
            "help": "close every JSON object that names its properties and sets no "
            "additionalProperties (a request may say otherwise in structured_outputs)"
        },
    )
    grammar_compile_timeout: float = field(
        default=2.0,
        metadata={"help": "seconds a grammar may take to compile; a slower one gets a 400"},
    )
    drain_timeout: float = field(
        default=30.0, metadata={"help": "seconds in-flight requests may finish after SIGTERM"}
    )
    heartbeat_interval: float = 0.5
    scheduler_timeout: float = field(
        default=2.0,
        metadata={"help": "seconds of scheduler silence before requests fail and new ones get 503"},
    )
    stall_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds without a finished step, while requests run, before /health 503s"
        },
    )
    retry_after_s: int = 1
    log_level: str = field(default="INFO", metadata={"help": "the log level"})

    @property
    def reuse_port(self) -> bool:
        """Whether the port is shared: only then, so that one frontend alone still fails when
        another program holds its port."""
        return self.api_servers > 1

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys ``api_key`` names (comma-separated); empty when none is required."""
        return parse_api_keys(self.api_key)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive = ("max_body_bytes", "max_stop_string_chars", "max_n", "api_servers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.api_server_index < self.api_servers:
            raise ValueError(
                f"api_server_index must be in [0, {self.api_servers}), got {self.api_server_index}"
            )
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            limit = MAX_LOGPROBS
            raise ValueError(f"max_logprobs must be in [0, {limit}], got {self.max_logprobs}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        timeouts = (
            "drain_timeout",
            "heartbeat_interval",
            "scheduler_timeout",
            "stall_timeout",
            "grammar_compile_timeout",
        )
        for name in timeouts:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.scheduler_timeout <= self.heartbeat_interval:
            raise ValueError("scheduler_timeout must be longer than heartbeat_interval")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable the check)")
        parse_api_keys(self.api_key)  # ValueError on an empty key among several
