"""The scheduler process's view of its peers: the worker it steps and the frontends it serves."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from protocol.messages import RequestOutput, WorkerReady


@dataclass
class WorkerPeer:
    """The one worker we step, as the scheduler sees it."""

    peer: bytes
    ready: WorkerReady
    last_seen: float
    resident_bytes: int = 0  # after its last step
    decode_path: str = ""  # what its decode steps run on, as its last step said
    num_threads: int = 0  # its intra-op threads, as its last step said
    fd: int | None = None  # the connection its messages arrive on, to match monitor events


class Frontends:
    """Every frontend heard from: when it was last heard, and the connection it speaks on."""

    def __init__(self) -> None:
        self.last_heard: dict[bytes, float] = {}  # peer -> monotonic time
        self.fds: dict[bytes, int] = {}

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.last_heard))  # a copy: callers may forget peers as they go

    def __contains__(self, peer: bytes) -> bool:
        return peer in self.last_heard

    def heard(self, peer: bytes, now: float, fd: int | None) -> bool:
        """Record a message from ``peer``; returns whether it was known before."""
        known = peer in self.last_heard
        self.last_heard[peer] = now
        if fd is not None:
            self.fds[peer] = fd
        return known

    def on_fd(self, fd: int) -> list[bytes]:
        """The frontends whose connection is ``fd``."""
        return [peer for peer, known in self.fds.items() if known == fd]

    def silent(self, now: float, limit: float) -> list[tuple[bytes, float]]:
        """(peer, seconds silent) for every frontend silent longer than ``limit``."""
        return [(p, now - t) for p, t in self.last_heard.items() if now - t > limit]

    def forget(self, peer: bytes) -> None:
        """Drop a lost frontend."""
        self.last_heard.pop(peer, None)
        self.fds.pop(peer, None)


def failed(request_id: str, reason: str) -> RequestOutput:
    """A request's end with finish_reason "error" and why."""
    return RequestOutput(
        request_id=request_id, new_token_ids=[], finish_reason="error", error=reason
    )
