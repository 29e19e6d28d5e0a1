"""The scheduler's typed errors (the auditor's InvariantViolation lives in audit.py)."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """allocate(n) asked for more blocks than are free. The caller decides what to give back."""


class BlockLedgerError(RuntimeError):
    """A block id was freed twice, freed while not allocated, or is out of range."""


class RequestRejected(ValueError):
    """add_request refused a request: it could never fit, it is too long, or its id is taken."""


class LivelockError(RuntimeError):
    """Work is queued but no iteration can ever make progress again."""
