"""Prefix caching: the allocator's three block states and its index, the hash chain, and the
scheduler sharing full blocks between requests (on the SimWorker, whose tokens hash the K/V it
reads, so a wrong hit changes the text and a hit on K/V never computed raises)."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams
from scheduler.audit import InvariantViolation, audit_all
from scheduler.block_allocator import BlockAllocator
from scheduler.block_hash import block_hash, root_hash
from scheduler.errors import BlockLedgerError
from scheduler.sim_worker import SimWorker
from tests.scheduler.conftest import assert_all_back, make_engine, run_to_end

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
H = [bytes([i]) * 32 for i in range(8)]  # stand-in hashes for the allocator's own tests


# -- the hash chain ------------------------------------------------------------------------------
def test_a_block_hash_covers_its_parent_its_tokens_and_the_salt() -> None:
    root = root_hash(None)
    assert block_hash(root, [1, 2]) == block_hash(root_hash(None), [1, 2])
    assert block_hash(root, [1, 2]) != block_hash(root, [2, 1])
    assert block_hash(block_hash(root, [1, 2]), [3, 4]) != block_hash(root, [3, 4])
    assert root_hash("tenant-a") != root_hash("tenant-b") != root
    assert root_hash("") != root  # an empty salt is still a salt
    assert len(block_hash(root, [1])) == 32


# -- the allocator -------------------------------------------------------------------------------
def test_a_cached_block_is_kept_when_freed_and_taken_back_by_a_hit() -> None:
    pool = BlockAllocator(4, 2)
    a, b = pool.allocate(2)
    assert pool.cache(a, H[0]) and pool.cache(b, H[1])
    pool.free_all([b, a])  # deepest first
    assert pool.num_free == 4 and pool.eviction_queue == [b, a]
    assert pool.uncached_free_blocks == frozenset({2, 3})
    assert pool.lookup([H[0], H[1], H[2]]) == [a, b]
    assert pool.take([a]) == [a] and pool.ref_count(a) == 1 and pool.eviction_queue == [b]
    pool.take([a])  # a second holder of a held block
    assert pool.ref_count(a) == 2 and pool.num_free == 3


def test_uncached_blocks_go_first_then_the_least_recently_freed() -> None:
    pool = BlockAllocator(4, 2)
    blocks = pool.allocate(4)
    for block, digest in zip(blocks, H, strict=False):
        pool.cache(block, digest)
    pool.free_all([blocks[1], blocks[0]])  # a chain of two, deepest first
    pool.free_all([blocks[2]])
    pool.free_all([blocks[3]])
    assert pool.eviction_queue == [blocks[1], blocks[0], blocks[2], blocks[3]]
    assert pool.allocate(1) == [blocks[1]]  # the tail of the oldest chain goes first
    assert pool.lookup([H[0], H[1]]) == [blocks[0]]  # its hash went with it
    assert H[1] not in pool.hash_index and pool.num_cached == 3


def test_a_hash_already_indexed_keeps_its_first_block() -> None:
    pool = BlockAllocator(4, 2)
    a, b = pool.allocate(2)
    assert pool.cache(a, H[0])
    assert not pool.cache(b, H[0])  # computed twice; the first copy is the shared one
    assert pool.cache(a, H[0])  # offering the same block again changes nothing
    pool.free_all([a, b])
    assert pool.uncached_free_blocks == frozenset({b, 2, 3}) and pool.eviction_queue == [a]


def test_clear_cache_forgets_every_hash() -> None:
    pool = BlockAllocator(4, 2)
    a, b = pool.allocate(2)
    pool.cache(a, H[0])
    pool.cache(b, H[1])
    pool.free_all([a])
    assert pool.clear_cache() == 2
    assert pool.lookup([H[0]]) == [] and pool.eviction_queue == [] and not pool.cached_blocks
    assert pool.ref_count(b) == 1 and pool.num_free == 3


def test_cache_misuse_raises_and_changes_nothing() -> None:
    pool = BlockAllocator(4, 2)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockLedgerError, match="block 3 cached but it is not allocated"):
        pool.cache(3, H[0])
    pool.cache(a, H[0])
    with pytest.raises(BlockLedgerError, match=f"block {a} cached under two hashes"):
        pool.cache(a, H[1])
    with pytest.raises(BlockLedgerError, match="block 2 taken as a hit but it is not cached"):
        pool.take([a, 2])
    assert pool.ref_count(a) == 1  # the good id in the bad call was not taken
    with pytest.raises(BlockLedgerError, match="taken twice in one hit"):
        pool.take([a, a])


# -- the scheduler ---------------------------------------------------------------------------------
def _generate(engine, prompts, params=GREEDY, salts=None):
    salts = salts or [None] * len(prompts)
    ids = [f"q{i}" for i in range(len(prompts))]
    for request_id, prompt, salt in zip(ids, prompts, salts, strict=True):
        engine.add_request(request_id, prompt, params, cache_salt=salt)
    outputs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished() or engine.num_in_flight:
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[i] for i in ids]


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_repeated_prompt_computes_only_what_is_not_cached() -> None:
    engine = make_engine(num_blocks=32, block_size=4, num_slots=2)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks, then 2 tokens
    (first,) = _generate(engine, [prompt])
    scheduled = engine.scheduler.tokens_scheduled
    (second,) = _generate(engine, [prompt])
    assert _tokens(second) == _tokens(first)
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 12
    # The second prompt computed its last 2 tokens, then the same 4 decodes as the first.
    assert engine.scheduler.tokens_scheduled - scheduled == 2 + 4
    assert engine.scheduler.cache.hits == 12 and engine.scheduler.cache.queries == 28
    assert_all_back(engine)


def test_a_hit_always_leaves_a_token_to_compute() -> None:
    engine = make_engine(num_blocks=32, block_size=4, num_slots=2)
    prompt = list(range(30, 42))  # 12 tokens: exactly 3 blocks
    _generate(engine, [prompt])
    (again,) = _generate(engine, [prompt])
    assert again[0].num_cached_tokens == 8  # the last block is recomputed for the logits


def test_no_hit_reads_what_the_same_step_computes() -> None:
    # Both arrive together: the second cannot share blocks the first computes in that step.
    engine = make_engine(num_blocks=32, block_size=4, num_slots=2, overlap=False)
    a, b = _generate(engine, [list(range(16)), list(range(16))])
    assert a[0].num_cached_tokens == b[0].num_cached_tokens == 0
    assert _tokens(a) == _tokens(b)


def test_caching_never_changes_the_text_and_saves_compute() -> None:
    stem = list(range(100, 140))  # a shared 10-block system prompt
    prompts = [stem + [200 + i, 300 + i, 400 + i] for i in range(6)] + [stem[:7], stem]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    texts, scheduled = [], []
    for caching in (False, True):
        engine = make_engine(num_blocks=40, block_size=4, num_slots=3, prefix_caching=caching)
        texts.append([_tokens(o) for o in _generate(engine, prompts, params)])
        scheduled.append(engine.scheduler.tokens_scheduled)
        assert_all_back(engine)
    assert texts[0] == texts[1]
    assert scheduled[1] < scheduled[0] // 2


def test_a_preempted_request_hits_its_own_blocks() -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [list(range(i * 50, i * 50 + 12)) for i in range(3)]
    recomputed, texts = [], []
    for caching in (False, True):
        engine = make_engine(num_blocks=14, block_size=4, num_slots=3, prefix_caching=caching)
        texts.append([_tokens(o) for o in _generate(engine, prompts, params)])
        assert engine.scheduler.num_preemptions_total > 0
        recomputed.append(engine.scheduler.tokens_recomputed)
        assert_all_back(engine)
    assert texts[0] == texts[1]
    assert recomputed[1] < recomputed[0]


def test_different_salts_never_share_and_equal_salts_do() -> None:
    engine = make_engine(num_blocks=32, block_size=4, num_slots=2)
    prompt = list(range(50, 63))
    (first,) = _generate(engine, [prompt], salts=["tenant-a"])
    (other,) = _generate(engine, [prompt], salts=["tenant-b"])
    (unsalted,) = _generate(engine, [prompt])
    (same,) = _generate(engine, [prompt], salts=["tenant-a"])
    assert first[0].num_cached_tokens == other[0].num_cached_tokens == 0
    assert unsalted[0].num_cached_tokens == 0
    assert same[0].num_cached_tokens == 12
    assert _tokens(first) == _tokens(other) == _tokens(same)


def test_a_lost_worker_empties_the_cache() -> None:
    engine = make_engine(num_blocks=32, block_size=4, num_slots=2)
    prompt = list(range(70, 83))
    _generate(engine, [prompt])
    assert engine.scheduler.allocator.num_cached == 4  # 17 tokens computed, outputs too
    engine.worker_lost()
    engine.worker = SimWorker(32, 4, 2)  # a new worker: its pool holds nothing computed
    assert engine.scheduler.allocator.num_cached == 0
    (again,) = _generate(engine, [prompt])  # a hit on the old K/V would raise in the SimWorker
    assert again[0].num_cached_tokens == 0
    assert_all_back(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_a_hit_on_held_blocks_counts_only_new_blocks_against_the_watermark(caching: bool) -> None:
    # 10 blocks, reserve 4: a holds 4 blocks; b shares a's 3 full blocks and needs 1 more
    # (1 + 4 <= 6 free), where without the hit it needs 4 (4 + 4 > 6) and must wait.
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = make_engine(
        num_blocks=10, block_size=4, num_slots=2, watermark_blocks=4, prefix_caching=caching
    )
    engine.add_request("a", list(range(13)), long)
    for _ in range(2):
        engine.step()
    engine.add_request("b", list(range(13)), GREEDY)
    engine.step()
    b = engine.scheduler.get("b")
    assert b is not None and (b.slot is not None) == caching
    assert b.num_cached_tokens == (12 if caching else None)
    run_to_end(engine)
    assert_all_back(engine)


# -- the audit of the cache: each check fires when exactly one thing is corrupted -----------------
@pytest.fixture
def shared():
    """a and b run, b sharing a's first 3 blocks; c has finished, its blocks cached and free."""
    engine = make_engine(num_blocks=32, block_size=4, num_slots=3, overlap=False)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("c", list(range(500, 509)), GREEDY)
    engine.add_request("a", list(range(13)), long)
    for _ in range(6):
        engine.step()
    engine.add_request("b", list(range(12)) + [99], long)
    engine.step()
    sched = engine.scheduler
    a, b = sched.get("a"), sched.get("b")
    assert a.block_ids[:3] == b.block_ids[:3] and sched.get("c") is None
    assert sched.allocator.eviction_queue and sched.allocator.ref_count(a.block_ids[0]) == 2
    engine.audit(engine.worker.rows())
    return engine


def _fires(engine, match: str) -> None:
    with pytest.raises(InvariantViolation, match=match):
        audit_all(engine.scheduler)


def test_audit_cached_free_and_allocated(shared) -> None:
    alloc = shared.scheduler.allocator
    block = alloc.eviction_queue[0]
    alloc._ref_counts[block] = 1
    _fires(shared, f"block {block} is both cached-free and allocated")


def test_audit_uncached_and_cached_free(shared) -> None:
    alloc = shared.scheduler.allocator
    block = alloc.eviction_queue[0]
    alloc._free_set.add(block)
    _fires(shared, f"block {block} is both uncached-free and cached-free")


def test_audit_queued_but_not_cached(shared) -> None:
    alloc = shared.scheduler.allocator
    block = alloc.eviction_queue[0]
    del alloc._hash_of[block]
    _fires(shared, f"block {block} is in the eviction queue but not cached")


def test_audit_cached_free_but_not_queued(shared) -> None:
    alloc = shared.scheduler.allocator
    block = alloc.eviction_queue[0]
    del alloc._evictable[block]  # freed onto the uncached list with its hash kept
    alloc._free_set.add(block)
    _fires(shared, f"block {block} is cached and free but not in the eviction queue")


def test_audit_index_names_another_block(shared) -> None:
    alloc = shared.scheduler.allocator
    a = shared.scheduler.get("a")
    alloc._by_hash[a.block_hashes[0]] = a.block_ids[1]
    _fires(shared, f"the hash index names block {a.block_ids[1]} for another hash")


def test_audit_cached_but_not_indexed(shared) -> None:
    alloc = shared.scheduler.allocator
    a = shared.scheduler.get("a")
    del alloc._by_hash[a.block_hashes[1]]
    _fires(shared, f"block {a.block_ids[1]} is cached but not in the hash index")


def test_audit_cached_prefix_beyond_the_computed(shared) -> None:
    b = shared.scheduler.get("b")
    b.num_blocks_cached += 3
    _fires(shared, f"request b has {b.num_blocks_cached} blocks in the cache but has computed")


def test_audit_cached_block_past_the_cached_prefix(shared) -> None:
    a = shared.scheduler.get("a")
    a.num_blocks_cached = 1
    _fires(shared, f"request a holds cached block {a.block_ids[1]} past its cached prefix of 1")


def test_audit_cached_block_at_another_position(shared) -> None:
    b = shared.scheduler.get("b")
    b.block_ids[0], b.block_ids[1] = b.block_ids[1], b.block_ids[0]
    _fires(shared, f"request b holds cached block {b.block_ids[0]} at position 0, where its own")


def test_audit_shared_block_not_cached(shared) -> None:
    alloc = shared.scheduler.allocator
    block = shared.scheduler.get("b").block_ids[2]
    del alloc._by_hash[alloc._hash_of.pop(block)]  # the hash forgotten while two hold it
    _fires(shared, f"block {block} is shared by 2 requests but not cached")


def test_audit_shared_block_reference_count(shared) -> None:
    alloc = shared.scheduler.allocator
    block = shared.scheduler.get("a").block_ids[0]
    alloc._ref_counts[block] = 1
    _fires(shared, f"block {block} has reference count 1 but 2 holders \\(a, b\\)")


def test_audit_a_stale_row_may_name_a_shared_cached_block(shared) -> None:
    shared.abort("b")  # b's row lists a's cached blocks until its slot's release lands
    rows = shared.worker.rows()
    assert any(r.request_id == "b" for r in rows)
    audit_all(shared.scheduler, rows)
