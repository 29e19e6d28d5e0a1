"""``ParallelConfig``: how a tensor-parallel worker's ranks are laid out and watched."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelConfig:
    """The group: its size, this host's ranks (empty: all of them), where rank 0's TCP store
    listens (port 0: any free port, when every rank runs on this host), how long a rank may be
    silent, and how long to wait for the store at start. ``worker.parallel.ranks`` runs it."""

    size: int = field(
        default=1,
        metadata={
            "help": "ranks the worker is split across, each with a share of every layer's heads",
            "flag": "--tensor-parallel-size",
        },
    )
    ranks: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "the ranks this host runs (0, 2-3 or 0,1): it runs the first, starts the rest",
            "flag": "--tp-ranks",
            "parse": "ranks",
            "shown": "all",
        },
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata={"help": "rank 0's host, where its TCP store listens", "flag": "--tp-master-addr"},
    )
    master_port: int = field(
        default=0,
        metadata={
            "help": "the TCP store's port (0: any free one); ranks on several hosts need one",
            "flag": "--tp-master-port",
        },
    )
    timeout_s: float = field(
        default=3.0,
        metadata={
            "help": "seconds a rank may be silent before the whole worker stops",
            "flag": "--tp-timeout",
        },
    )
    connect_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds a rank waits for rank 0's store at start",
            "flag": "--tp-connect-timeout",
        },
    )

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.size}")
        bad = [rank for rank in self.ranks if not 0 <= rank < self.size]
        if bad or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(
                f"tensor parallel ranks {list(self.ranks)} not distinct in [0, {self.size})"
            )
        if self.master_port == 0 and len(self.local_ranks) < self.size:
            raise ValueError(
                "ranks on several hosts need NANOSERVE_TP_MASTER_PORT (rank 0's store)"
            )
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("tensor parallel timeouts must be > 0")

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this host runs, lowest first (this process runs the first)."""
        return tuple(sorted(self.ranks)) if self.ranks else tuple(range(self.size))
