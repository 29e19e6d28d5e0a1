"""Packed step inputs: every number one step needs, in one host buffer, sent in one copy.

A step's inputs are many small arrays (token ids, positions, where each token's K/V goes,
block tables, the sampled rows' parameters...). Sent one by one, each would be a host-to-device
copy of its own, and each copy from pageable memory blocks the host. ``HostPack`` lays them end
to end in one byte buffer (each at a 64-byte boundary, so any dtype can be viewed there),
``upload`` sends the used bytes in one ``to(device, non_blocking=True)``, and ``Packed`` hands
out views of the device copy by name.

The buffers come from ``Staging``: a few reused ones, pinned where the plan says
(``Plan.pin_memory``; pinning needs CUDA, so the CPU runs the same code unpinned, and its
"upload" is the host buffer itself). A buffer is written again only once the copy that read it
has finished (its ``Fence``).

``download`` is the way back: the step's outputs (sampled ids, logprobs) joined into one byte
tensor on the device and copied into one host buffer without blocking; its fence says when the
host may read them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.step.fences import FENCES, Fence

ALIGN = 64  # bytes: every array starts at a multiple of it (a cache line; any element size)
_GROWTH = 2  # a buffer too small is replaced by one this many times the bytes asked for


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """A ring of reused host byte buffers (pinned with ``pin``) for ``device``'s packs."""

    def __init__(self, device: str, pin: bool, slots: int = 3, initial: int = 1 << 16) -> None:
        self.device, self.pin = device, pin
        self.fence_kind = FENCES[torch.device(device).type]
        self._buffers = [self._allocate(initial) for _ in range(slots)]
        self._fences: list[Fence | None] = [None] * slots
        self._next = 0
        self.uploads = 0  # host-to-device copies made (one per pack)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def pack(self) -> HostPack:
        """An empty pack for the next step."""
        return HostPack(self)

    def buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next buffer in the ring, of at least ``nbytes``, once the copy that last read it
        has finished: (its index, the buffer)."""
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        fence = self._fences[index]
        if fence is not None:
            fence.wait()  # long done in practice: two later steps have been queued since
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = self._allocate(_GROWTH * nbytes)
        return index, self._buffers[index]

    def sent(self, index: int) -> None:
        """The buffer ``index`` has been read by a copy queued just now."""
        self._fences[index] = self.fence_kind()
        self.uploads += 1


class Packed:
    """The device copy of a pack: named views, in the dtypes and shapes they were added with."""

    def __init__(self, data: torch.Tensor, layout: dict[str, tuple[int, torch.dtype, tuple]]):
        self.data = data  # (bytes,) uint8 on the device
        self._layout = layout

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, dtype, shape = self._layout[name]
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)

    def __contains__(self, name: str) -> bool:
        return name in self._layout

    def get(self, name: str) -> torch.Tensor | None:
        """The view named ``name``, or None if the pack has none."""
        return self[name] if name in self._layout else None


class HostPack:
    """One step's inputs, added by name, then uploaded together."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self._items: list[tuple[str, object, torch.dtype, tuple]] = []
        self._names: set[str] = set()
        self._nbytes = 0

    def add(
        self,
        name: str,
        values: Sequence | np.ndarray | torch.Tensor,
        dtype: torch.dtype = torch.int64,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Add an array: a list of numbers, or a CPU tensor (then in its own dtype, ``dtype``
        ignored). ``shape`` defaults to the values' own (a list is 1-D)."""
        if name in self._names:
            raise ValueError(f"the pack already holds {name!r}")
        if isinstance(values, torch.Tensor):
            dtype, shape = values.dtype, tuple(values.shape) if shape is None else shape
            count = values.numel()
        else:
            count = len(values) if not isinstance(values, np.ndarray) else values.size
            shape = (count,) if shape is None else shape
        if int(np.prod(shape, dtype=np.int64)) != count:
            raise ValueError(f"{name!r}: {count} values do not make the shape {shape}")
        self._names.add(name)
        self._items.append((name, values, dtype, tuple(shape)))
        self._nbytes += _aligned(count * torch.empty((), dtype=dtype).element_size())

    def upload(self) -> Packed:
        """Write every array into a staging buffer and send the bytes in one copy."""
        index, buffer = self.staging.buffer(max(self._nbytes, ALIGN))
        as_numpy = buffer.numpy()
        layout: dict[str, tuple[int, torch.dtype, tuple]] = {}
        offset = 0
        for name, values, dtype, shape in self._items:
            size = torch.empty((), dtype=dtype).element_size()
            count = int(np.prod(shape, dtype=np.int64))
            if isinstance(values, torch.Tensor):
                target = buffer[offset : offset + count * size].view(dtype)
                target.copy_(values.reshape(-1))
            elif count:
                array = np.asarray(values, dtype=_NUMPY[dtype]).reshape(-1)
                as_numpy[offset : offset + count * size] = array.view(np.uint8)
            layout[name] = (offset, dtype, shape)
            offset += _aligned(count * size)
        used = buffer[: max(offset, ALIGN)]
        data = used.to(self.staging.device, non_blocking=True)
        self.staging.sent(index)
        return Packed(data, layout)


# The dtypes lists are packed in (tensors may be any dtype: they are copied as they are).
_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}


def download(tensors: list[torch.Tensor], pin: bool) -> tuple[list[torch.Tensor], Fence]:
    """Device tensors -> host tensors of the same dtypes and shapes, in one copy that does not
    block the host, and the fence after which they may be read."""
    if not tensors:
        return [], FENCES["cpu"]()
    device = tensors[0].device
    pieces, spans, offset = [], [], 0
    for tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        pad = _aligned(raw.numel()) - raw.numel()
        pieces.append(raw)
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        spans.append((offset, raw.numel()))
        offset += raw.numel() + pad
    joined = torch.cat(pieces)  # (bytes,) on the device: one copy back instead of several
    host = torch.empty(joined.numel(), dtype=torch.uint8, pin_memory=pin)
    host.copy_(joined, non_blocking=True)
    fence = FENCES[device.type]()
    out = [
        host[start : start + n].view(tensor.dtype).view(tensor.shape)
        for (start, n), tensor in zip(spans, tensors, strict=True)
    ]
    return out, fence
