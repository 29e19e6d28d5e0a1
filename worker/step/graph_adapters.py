"""How a decode graph is captured and replayed: the only part of ``worker.step.graphs`` that differs
by device, chosen by the plan's device (``ADAPTERS``).

``CudaGraphs`` captures each bucket's function into a CUDA graph (all of them in one memory
pool, biggest first, so they share it) and replays it; ``EagerReplay``, on the CPU, keeps the
function and runs it again, on the same persistent buffers. Everything else of the graph runner
(buckets, padding, buffers) is the same code on both, and is tested on the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import torch


class GraphAdapter(ABC):
    """Captures a function once per key, and replays it."""

    @abstractmethod
    def capture(self, key: Hashable, body: Callable[[], None]) -> None:
        """Record ``body`` (which reads and writes only persistent buffers) for ``key``."""

    @abstractmethod
    def replay(self, key: Hashable) -> None:
        """Run what was captured for ``key``, on the buffers' current contents."""

    @abstractmethod
    def free_memory(self) -> int | None:
        """The device's free bytes (None where the adapter holds no device memory)."""


class EagerReplay(GraphAdapter):
    """The CPU's: the function itself, run again at every replay."""

    def __init__(self) -> None:
        self.bodies: dict[Hashable, Callable[[], None]] = {}

    def capture(self, key: Hashable, body: Callable[[], None]) -> None:
        self.bodies[key] = body

    def replay(self, key: Hashable) -> None:
        self.bodies[key]()

    def free_memory(self) -> int | None:
        return None


class CudaGraphs(GraphAdapter):
    """CUDA graphs sharing one memory pool. Only verified on a GPU."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def capture(self, key: Hashable, body: Callable[[], None]) -> None:
        # A first run off the capture, on a side stream (as torch's docs do): libraries set up
        # their workspaces there, not inside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the process's other threads (the pool's, the fence
        # waiter's) do not break this thread's capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()
        self.pool = graph.pool()
        self.graphs[key] = graph

    def replay(self, key: Hashable) -> None:
        self.graphs[key].replay()

    def free_memory(self) -> int | None:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]


# The plan's device -> how its decode graphs are kept.
ADAPTERS: dict[str, type[GraphAdapter]] = {"cpu": EagerReplay, "cuda": CudaGraphs}
