"""The shared KV pool: its file's header, and the messages between a worker and the pool holder.

The pool holder (``holder/``) owns the K/V pool, so the pool outlives the worker that
computes into it: a CPU pool as a file in /dev/shm (mode 0600, in a name only this user's
processes use), a CUDA pool as device memory it exports through a CUDA IPC handle
(``DeviceHandle``). A worker asks the holder for a pool of its geometry (``AttachPool``); the
holder answers with the file's path or the handle, the pool's id and its generation, bumped at
every attach (``PoolGranted``), or with the reason it will not share one (the worker then
allocates a private pool).

A CPU pool's file is a header page, then the pool's bytes. The header says what the bytes are:
``MAGIC``, the geometry (with the tensor-parallel rank whose share of the KV heads it holds, and
the group's size), the pool id and the generation. The worker checks it against the
grant before it trusts a byte, so a file replaced or resized behind its back is refused.
"""

from __future__ import annotations

import struct

import msgspec

from protocol.messages import PROTOCOL_VERSION, Message

MAGIC = b"NSKVPOOL"
HEADER_BYTES = 4096  # one page: the pool's bytes start page-aligned
# magic, layout version, layers, KV heads, head dim, block size, blocks, generation, id, dtype,
# rank, world size
_HEADER = struct.Struct("<8sIIIIIQQ16s16sII")
LAYOUT_VERSION = 2


class PoolGeometry(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """What a pool's bytes are: (num_layers, 2, n_kv_heads, num_blocks + 1, block_size,
    head_dim) elements of ``dtype`` (the block past ``num_blocks`` is the worker's trash). A
    tensor-parallel rank's pool holds that rank's KV heads: ``rank`` of a group of
    ``world_size`` (0 of 1 for a worker of one rank)."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    def layout(self) -> tuple[int, int, int, int, str, int, int, str]:
        """Everything but the block count: what a pool of another size still shares."""
        return (
            self.num_layers,
            self.n_kv_heads,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.rank,
            self.world_size,
            self.device,
        )

    def describe(self) -> str:
        """One line for a log: the geometry's fields."""
        group = f", rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
        return (
            f"{self.num_layers} layers x {self.n_kv_heads} KV heads x {self.head_dim}, "
            f"{self.num_blocks} blocks of {self.block_size}, {self.dtype}{group}"
            + ("" if self.device.startswith("cpu") else f", on {self.device}")
        )


class AttachPool(Message):
    """A worker (a tensor-parallel rank: ``geometry.rank``) asks for its shared pool.
    ``any_size``: its block count came from a memory budget, not from the user, so a pool of
    the same layout and another size will do."""

    protocol_version: int
    geometry: PoolGeometry
    pid: int
    any_size: bool = False


class DeviceHandle(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """A CUDA pool's export, as ``torch.UntypedStorage._share_cuda_`` gives it and
    ``_new_shared_cuda`` takes it: the allocation's IPC handle and where the pool's bytes lie in
    it, the reference counter torch keeps for the exporter, and the event a user waits on before
    it reads. Bytes and integers only: nothing between processes is pickled."""

    device: int
    handle: bytes
    size: int  # the pool's bytes
    offset: int  # where they start in the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def args(self) -> tuple:
        """The arguments of ``torch.UntypedStorage._new_shared_cuda``, in order."""
        return (
            self.device,
            self.handle,
            self.size,
            self.offset,
            self.ref_counter_handle,
            self.ref_counter_offset,
            self.event_handle,
            self.event_sync_required,
        )


class PoolGranted(Message):
    """The holder's answer: ``path`` to map (a CPU pool) or ``device_handle`` to open (a CUDA
    pool); neither, and no ``geometry``: refused, and ``reason`` says why. Then the pool's id
    (new with every pool the holder creates), its generation after this attach and its geometry
    (the block count may differ from the one asked with ``any_size``)."""

    protocol_version: int
    path: str = ""
    pool_id: str = ""
    generation: int = 0
    geometry: PoolGeometry | None = None
    reason: str = ""
    refusal: str = ""  # the reason's kind, a metric label: "geometry", "in_use", "protocol"
    device_handle: DeviceHandle | None = None


ToHolder = AttachPool
FromHolder = PoolGranted


def element_size(dtype: str) -> int:
    """Bytes of one element of a K/V dtype, by name."""
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
    if dtype not in sizes:
        raise ValueError(f"no K/V dtype {dtype!r}")
    return sizes[dtype]


def pool_bytes(geometry: PoolGeometry) -> int:
    """The pool's bytes after the header (the trash block included)."""
    g = geometry
    blocks = g.num_blocks + 1
    return (
        g.num_layers * 2 * g.n_kv_heads * blocks * g.block_size * g.head_dim * element_size(g.dtype)
    )


def pack_header(geometry: PoolGeometry, pool_id: str, generation: int) -> bytes:
    """The header page's first bytes for this pool."""
    g = geometry
    return _HEADER.pack(
        MAGIC,
        LAYOUT_VERSION,
        g.num_layers,
        g.n_kv_heads,
        g.head_dim,
        g.block_size,
        g.num_blocks,
        generation,
        pool_id.encode()[:16],
        g.dtype.encode()[:16],
        g.rank,
        g.world_size,
    )


def unpack_header(data: bytes) -> tuple[PoolGeometry, str, int]:
    """(geometry, pool id, generation) from a header; ValueError if it is not one."""
    fields = _HEADER.unpack_from(data)
    magic, version, layers, heads, head_dim, block_size, blocks = fields[:7]
    generation, pid, dtype, rank, world_size = fields[7:]
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise ValueError(f"not a nanoserve KV pool (magic {magic!r}, layout {version})")
    geometry = PoolGeometry(
        num_layers=layers,
        n_kv_heads=heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype.rstrip(b"\0").decode(),
        num_blocks=blocks,
        rank=rank,
        world_size=world_size,
    )
    return geometry, pid.rstrip(b"\0").decode(), generation


__all__ = ["PROTOCOL_VERSION", "AttachPool", "DeviceHandle", "PoolGranted", "PoolGeometry"]
