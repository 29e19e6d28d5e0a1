"""Block hashes for prefix caching: what a full block of K/V depends on, as 32 bytes.

A block's K/V is a function of every token up to its end, so its hash chains over its parent's
hash (which covers every earlier token), its own token ids and the request's extra keys (the
cache salt: requests with different salts never share a block). The root of a chain is the hash
of the extra keys alone, so the salt reaches every block through the chain.

BLAKE2b, a cryptographic hash: Python's ``hash()`` is seeded per process, 64 bits wide and
collides on purpose-built inputs, and a collision here would serve one request another's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 32
_ROOT_PERSON = b"nanoserve-root"  # BLAKE2b personalisation: a root can never equal a block hash
_BLOCK_PERSON = b"nanoserve-block"


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: the hash of its extra keys."""
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.blake2b(salt, digest_size=DIGEST_SIZE, person=_ROOT_PERSON).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block: its parent's hash, then its token ids as 64-bit integers."""
    digest = hashlib.blake2b(parent, digest_size=DIGEST_SIZE, person=_BLOCK_PERSON)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
