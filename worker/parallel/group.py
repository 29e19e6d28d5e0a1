"""``Group``: the tensor-parallel collectives the worker calls, and ``SOLO``, the group of one.

A worker of one rank calls the same methods on ``SOLO``, where each is the identity (or
nothing), so the single-rank path is exactly the code it was. ``DistributedGroup`` runs them
over a torch.distributed process group: gloo on CPU, NCCL on CUDA.

Steps travel from rank 0 to the others as msgspec bytes in a uint8 tensor (never pickle): a
header broadcast of one int64, the payload's length, then the payload. A negative length is a
keepalive that carries nothing: rank 0 sends one whenever it has been idle for a poll period,
so the other ranks never sit in one collective for longer than the group's timeout allows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KEEPALIVE = -1


class Group:
    """A group of one: every collective is the identity."""

    rank = 0
    size = 1
    local_size = 1  # ranks of this group on this host (they share its memory budget)

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that talks to the scheduler and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's (S, part) scores of its vocabulary range -> (S, vocab_size) on rank 0,
        None elsewhere."""
        return logits

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        return value

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, rank 0's first, on every rank."""
        return [payload]

    def send_message(self, payload: bytes | None) -> None:
        """Rank 0: broadcast one message's bytes (None: a keepalive)."""

    def receive_message(self) -> bytes | None:
        """Other ranks: the next message's bytes, or None for a keepalive."""
        raise RuntimeError("a group of one has no one to receive from")

    def close(self) -> None:
        """Leave the process group."""


SOLO = Group()


class DistributedGroup(Group):
    """This process's rank in an initialised torch.distributed process group; ``device`` is
    where the collectives' tensors live (cpu for gloo, cuda for NCCL)."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        local_size: int,
        device: str,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.size, self.local_size, self.device = rank, size, local_size, device
        self.on_close = on_close  # called first in ``close``: ranks leaving now are no fault

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """See ``Group.all_reduce``."""
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """See ``Group.gather_vocab``. Ranges are padded to one width: gather wants equal
        shapes, and the last range may be short."""
        import torch.distributed as dist

        part = -(-vocab_size // self.size)
        if logits.shape[1] < part:  # (S, part) with the short range's tail zeroed
            logits = torch.nn.functional.pad(logits, (0, part - logits.shape[1]))
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.leader else None
        dist.gather(logits, parts, dst=0)
        if not self.leader:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]  # (S, vocab_size)

    def min_int(self, value: int) -> int:
        """See ``Group.min_int``."""
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """See ``Group.all_gather_bytes``: the lengths first, then every payload padded to the
        longest (all_gather wants equal shapes)."""
        import torch.distributed as dist

        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        dist.all_gather(lengths, length)
        sizes = [int(n.item()) for n in lengths]
        data = torch.zeros(max(sizes), dtype=torch.uint8)
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = data.to(self.device)
        parts = [torch.empty_like(data) for _ in range(self.size)]
        dist.all_gather(parts, data)
        pairs = zip(parts, sizes, strict=True)
        return [part[:size].cpu().numpy().tobytes() for part, size in pairs]

    def send_message(self, payload: bytes | None) -> None:
        """See ``Group.send_message``."""
        import torch.distributed as dist

        length = KEEPALIVE if payload is None else len(payload)
        dist.broadcast(torch.tensor([length], dtype=torch.int64, device=self.device), src=0)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            dist.broadcast(data, src=0)

    def receive_message(self) -> bytes | None:
        """See ``Group.receive_message``."""
        import torch.distributed as dist

        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        length = int(header.item())
        if length < 0:
            return None
        data = torch.empty(length, dtype=torch.uint8, device=self.device)
        if length:
            dist.broadcast(data, src=0)
        return data.cpu().numpy().tobytes()

    def close(self) -> None:
        """See ``Group.close``."""
        import torch.distributed as dist

        if self.on_close is not None:
            self.on_close()
        if dist.is_initialized():
            dist.destroy_process_group()
