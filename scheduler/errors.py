"""The scheduler's typed errors."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """allocate(n) asked for more blocks than are free. The caller decides what to give back."""


class BlockLedgerError(RuntimeError):
    """A block id was freed twice, freed while not allocated, or is out of range."""


class RequestRejected(ValueError):
    """add_request refused a request: it could never fit, it is too long, or its id is taken."""


class LivelockError(RuntimeError):
    """Work is queued but no iteration can ever make progress again."""


class InvariantViolation(RuntimeError):
    """A ledger disagrees with itself or with the worker's rows. The message names the block,
    slot or request and what is wrong."""
