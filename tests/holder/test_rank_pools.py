"""A tensor-parallel group's pools, without a model: the holder keeps one pool per rank (its
own file, generation and geometry, rank and group size in the header), fences each rank's pool
on its own last process, and refuses a rank of another group size. The ranks agree: the group's
pools are shared only if every rank's is, of one size. The leader's checksum of a block covers
every rank's shard, so flipping one byte of one rank's pool changes it."""

from __future__ import annotations

import mmap
import os
import zlib

import msgspec
import pytest
import torch

from holder.process import Holder
from protocol.kv_pool import HEADER_BYTES, PROTOCOL_VERSION, AttachPool, PoolGeometry, unpack_header
from worker.kv.cache import KVCache
from worker.kv.shared import Attachment, PeerPools, RankPool, _map, agree, private

SHAPE = dict(num_layers=2, n_kv_heads=1, head_dim=8, block_size=4, num_blocks=6)


def geometry(rank: int, world_size: int = 2, **change) -> PoolGeometry:
    return PoolGeometry(**{**SHAPE, "dtype": "float32", **change}, rank=rank, world_size=world_size)


def request(rank: int, pid: int | None = None, **change) -> AttachPool:
    return AttachPool(
        protocol_version=PROTOCOL_VERSION, geometry=geometry(rank, **change), pid=pid or os.getpid()
    )


@pytest.fixture
def holder(tmp_path):
    holder = Holder("unit-" + os.urandom(4).hex(), directory=tmp_path)
    try:
        yield holder
    finally:
        holder.close()


def test_each_rank_has_a_pool_of_its_own(holder, tmp_path) -> None:
    zero, one = holder.attach(request(0)), holder.attach(request(1))
    assert zero.path != one.path and zero.pool_id != one.pool_id
    assert (zero.generation, one.generation) == (1, 1)
    assert holder.attach(request(1)).generation == 2  # rank 1's attach bumps rank 1's alone
    assert holder.attach(request(0)).generation == 2
    with open(one.path, "rb") as file:
        header = unpack_header(file.read(HEADER_BYTES))
    assert header == (geometry(1), one.pool_id, 2)
    holder.close()
    assert not list(tmp_path.iterdir())  # every rank's file goes


def test_a_rank_of_another_group_size_is_refused(holder) -> None:
    holder.attach(request(0))
    refused = holder.attach(request(0, world_size=3))
    assert refused.refusal == "geometry" and not refused.path
    assert "rank 0 of 2" in refused.reason and "rank 0 of 3" in refused.reason


def test_each_ranks_pool_is_fenced_on_its_own_last_process(holder) -> None:
    holder.attach(request(0))
    one = holder.attach(request(1))
    with open(one.path, "r+b") as file:  # this process maps rank 1's pool, not rank 0's
        mapping = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
    try:
        other = os.getppid()
        refused = holder.attach(request(1, pid=other))
        assert refused.refusal == "in_use" and f"pid {os.getpid()}" in refused.reason
        assert holder.attach(request(0, pid=other)).generation == 2
    finally:
        mapping.close()
    assert holder.attach(request(1, pid=other)).generation == 2


def mapped(holder: Holder, rank: int) -> Attachment:
    """Rank ``rank``'s pool, granted and mapped as a worker maps it."""
    grant = holder.attach(request(rank))
    return _map(grant.path, grant.geometry, grant.pool_id, grant.generation, grant.geometry, False)


def report(attachment: Attachment) -> RankPool:
    return RankPool(
        path=attachment.path,
        pool_id=attachment.pool_id,
        generation=attachment.generation,
        geometry=attachment.geometry,
        fallback=attachment.fallback,
        reason=attachment.reason,
    )


class TwoRanks:
    """Rank 0 of a group of two, whose rank 1 reports ``other``: ``agree``'s collective."""

    rank, size = 0, 2

    def __init__(self, other: RankPool) -> None:
        self.other = other

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return [payload, msgspec.msgpack.encode(self.other)]


def test_the_group_is_shared_only_if_every_rank_is(holder) -> None:
    zero, one = mapped(holder, 0), mapped(holder, 1)
    both = agree(TwoRanks(report(one)), zero)
    assert both.mapping is not None
    assert [rank.pool_id for rank in both.ranks] == [zero.pool_id, one.pool_id]
    assert not both.reused  # generation 1 everywhere: nothing to re-attach
    again = mapped(holder, 0)
    refused = private("in_use", "worker pid 7 still maps the pool")
    alone = agree(TwoRanks(report(refused)), again)
    assert (alone.mapping, alone.fallback) == (None, "in_use")
    assert alone.reason == "rank 1: worker pid 7 still maps the pool"
    assert again.mapping.closed  # rank 0 does not keep a pool its group does not share
    one.mapping.close()
    zero.mapping.close()


def test_ranks_pools_of_different_sizes_are_not_shared(holder) -> None:
    zero = mapped(holder, 0)
    other = report(zero)
    other = msgspec.structs.replace(other, geometry=geometry(1, num_blocks=9))
    split = agree(TwoRanks(other), zero)
    assert split.fallback == "geometry" and "rank 0: 6, rank 1: 9" in split.reason


def cache(attachment: Attachment) -> KVCache:
    return KVCache(**SHAPE, dtype=torch.float32, device="cpu", attachment=attachment)


def test_the_leaders_checksum_covers_every_ranks_shard(holder) -> None:
    zero, one = mapped(holder, 0), mapped(holder, 1)
    leader, follower = cache(zero), cache(one)
    torch.manual_seed(0)
    for pool in (leader.pool, follower.pool):
        pool[:, :, :, 1:4] = torch.randn_like(pool[:, :, :, 1:4])
    leader.peers = PeerPools((report(zero), report(one)), 0)

    def shard(kv: KVCache, block: int) -> bytes:
        return kv.pool[:, :, :, block].contiguous().view(torch.uint8).numpy().tobytes()

    sums = {block: leader.checksum(block) for block in (1, 2, 3)}
    assert sums[3] == zlib.crc32(shard(follower, 3), zlib.crc32(shard(leader, 3)))
    own = zlib.crc32(shard(leader, 3))
    follower.pool[1, 1, 0, 3, 2, 5] += 1.0  # one element of rank 1's V, layer 1, block 3
    assert leader.checksum(3) != sums[3] and zlib.crc32(shard(leader, 3)) == own
    assert {block: leader.checksum(block) for block in (1, 2)} == {1: sums[1], 2: sums[2]}


def test_a_peer_pool_whose_header_is_not_its_grant_is_refused(holder) -> None:
    zero, one = mapped(holder, 0), mapped(holder, 1)
    stale = msgspec.structs.replace(report(one), generation=one.generation + 1)
    with pytest.raises(RuntimeError, match="rank 1's pool .* is not its grant"):
        PeerPools((report(zero), stale), 0)


def test_the_leaders_range_sums_cover_every_ranks_shard_of_the_slots(holder) -> None:
    """A partial block's sum (slots [first, end)) continues over every rank's shard of those
    slots only: a change in another rank's slot inside the range changes it, one outside the
    range does not."""
    zero, one = mapped(holder, 0), mapped(holder, 1)
    leader, follower = cache(zero), cache(one)
    torch.manual_seed(0)
    for pool in (leader.pool, follower.pool):
        pool[:, :, :, 1:4] = torch.randn_like(pool[:, :, :, 1:4])
    alone = leader.range_sums([(3, 1, 3)])
    leader.peers = PeerPools((report(zero), report(one)), 0)
    (before,) = leader.range_sums([(3, 1, 3)])
    assert before[:3] == (3, 1, 3) and before != alone[0]
    follower.pool[1, 1, 0, 3, 3, 5] += 1.0  # rank 1's V, layer 1, block 3, slot 3: outside
    assert leader.range_sums([(3, 1, 3)]) == [before]
    follower.pool[1, 1, 0, 3, 2, 5] += 1.0  # slot 2: inside the range
    assert leader.range_sums([(3, 1, 3)]) != [before]
