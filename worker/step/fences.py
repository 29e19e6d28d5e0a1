"""Fences: when the device has finished the work queued so far.

A step's host-to-device copy, its forward and its sampling are queued on the device and the
host goes on; a ``Fence`` recorded after them says when they are done. On CUDA it is an event
on the current stream; on the CPU every operator has finished when it returns, so a fence is
done from the start. The plan's device picks the kind (``FENCES``), so nothing asks which
device it runs on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Fence(ABC):
    """A point in the device's queue of work."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the work before the fence has finished (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the work before the fence has finished."""


class DoneFence(Fence):
    """The CPU's: its work is finished when the call that queued it returns."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class CudaFence(Fence):
    """A CUDA event recorded on the current stream. Only verified on a GPU."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


# The plan's device -> what records a fence there.
FENCES: dict[str, type[Fence]] = {"cpu": DoneFence, "cuda": CudaFence}
