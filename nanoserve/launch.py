"""The options that fill no process's config: where the processes meet, and how one runs.

They are declared as the configs are (``nanoserve.options`` reads the fields' metadata), and
the process commands read them from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from protocol.addresses import Addresses, default_addresses

TRANSPORTS = ("ipc", "tcp")


@dataclass(frozen=True)
class Sockets:
    """The scheduler's endpoints: named by a run id in a private directory (ipc) or by ports on
    127.0.0.1 (tcp). A frontend may be given them outright instead."""

    run_id: str = field(
        default="default",
        metadata={"help": "suffix of the socket names, so several servers can share a machine"},
    )
    transport: str = field(
        default="ipc",
        metadata={
            "help": "ipc (a private 0700 directory) or tcp (127.0.0.1 only)",
            "choices": TRANSPORTS,
        },
    )
    base_port: int = field(
        default=5610, metadata={"help": "the first of the scheduler's three tcp ports (tcp only)"}
    )
    frontend_address: str | None = field(
        default=None,
        metadata={
            "help": "the scheduler's frontend endpoint, given outright",
            "shown": "from --run-id",
            "processes": ("frontend",),
            "serve": False,  # serve starts the scheduler where --run-id says
        },
    )
    monitor_address: str | None = field(
        default=None,
        metadata={
            "help": "the scheduler's monitor feed for the web page",
            "shown": "from --run-id (none with --frontend-address)",
            "processes": ("frontend",),
            "serve": False,
        },
    )

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be ipc or tcp, got {self.transport!r}")
        if not 1 <= self.base_port <= 65535 - 2:
            raise ValueError(f"base_port must be in [1, 65533], got {self.base_port}")

    def addresses(self) -> Addresses:
        """The endpoints (for ipc, in a private directory this creates where it is missing)."""
        addresses = default_addresses(self.run_id, self.transport, self.base_port)
        if self.frontend_address:  # another scheduler's: its feed only where named too
            addresses = Addresses(frontend=self.frontend_address, worker=addresses.worker)
        if self.monitor_address:
            addresses = dataclasses.replace(addresses, monitor=self.monitor_address)
        return addresses


@dataclass(frozen=True)
class Running:
    """How a process runs, beside its config."""

    pin_cpu: bool = field(
        default=True,
        metadata={
            "help": "run on the last CPU the process may use, away from the worker's threads "
            "(nanoserve/cpus.py)",
            "processes": ("scheduler", "frontend"),
        },
    )
    worker_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds requests wait for a lost worker to come back before they fail",
            "processes": ("scheduler",),
        },
    )
    debug_step_delay: float = field(
        default=0.0,
        metadata={
            "help": "sleep this many seconds in every step (tests only)",
            "processes": ("worker",),
        },
    )

    def __post_init__(self) -> None:
        if self.worker_timeout <= 0:
            raise ValueError(f"worker_timeout must be > 0, got {self.worker_timeout}")
        if self.debug_step_delay < 0:
            raise ValueError(f"debug_step_delay must be >= 0, got {self.debug_step_delay}")
