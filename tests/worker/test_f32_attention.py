"""``torch.ops.nanoserve.decode_attention_f32`` (``worker/cpu/csrc/decode_attention_f32.cpp``):
decode
attention over a paged float32 or float16 pool in AVX2, built on any CPU with AVX2, FMA and F16C.

It equals float64 softmax attention to float32's rounding, reads the right blocks and nothing
past a row's cached positions, takes the new token from ``kv``, refuses what it cannot do, and
is what a CPU worker's float32 decodes use, with the same tokens as the torch backend's (the
compiled steps' use is in ``test_compiled.py``). Over a float16 pool (``auto``'s float32) it
gives bit for bit what it gives over that pool widened to float32, and a worker with such a pool
stays within float16's rounding of the float32 one."""

from __future__ import annotations

import pytest
import torch

from tests.worker.attention_cases import BLOCK, HEADS, case, grouped, reference
from tests.worker.conftest import make_worker
from tests.worker.kernel_checks import require_kernels
from worker.attention import CpuF32Backend, TorchBackend
from worker.cpu import kernels


@pytest.fixture(autouse=True)
def built(private_cache):
    """Build (or load) the kernels in the tests' private cache, or skip where they cannot be."""
    require_kernels("avx2")


def attend(q, kv, layer, blocks, cached, block_size=BLOCK, first=None):
    return torch.ops.nanoserve.decode_attention_f32(q, kv, layer, blocks, cached, block_size, first)


def _f32_case(n_kv: int, nq: int, hd: int, lengths: list[int], seed: int):
    return case(n_kv, nq, hd, lengths, seed, dtype=torch.float32)


@pytest.mark.parametrize(**HEADS)
def test_it_equals_float64_attention_to_float32_rounding(n_kv, nq, hd):
    lengths = [0, 1, 15, 16, 17, 100, 255]  # empty, within, at and across block edges
    q, kv, layer, blocks, cached = _f32_case(n_kv, nq, hd, lengths, seed=nq + hd)
    assert not q.is_contiguous()
    got = attend(q, kv, layer, blocks, cached)
    want = reference(q, kv, layer, blocks, cached)
    assert got.dtype == torch.float32 and got.shape == q.shape
    # float32 sums of up to 256 products of order 1, and the exp's 2e-7.
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 1e-5 + 1e-5).all(), error.max().item()


@pytest.mark.parametrize(**HEADS)
def test_groups_attend_causally_within_themselves(n_kv, nq, hd):
    """A request's token and its drafts (rows sharing a table and a cached context): each row
    sees the cached positions, then its group's new tokens up to its own, none after."""
    lengths = [17, 17, 17, 40, 100, 100, 100, 100, 100, 0, 0]
    q, kv, layer, blocks, cached = _f32_case(n_kv, nq, hd, lengths, seed=nq + hd + 7)
    blocks, cached, first = grouped(q, kv, layer, blocks, cached, [3, 1, 5, 2])
    got = attend(q, kv, layer, blocks, cached, first=first)
    want = reference(q, kv, layer, blocks, cached, first)
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 1e-5 + 1e-5).all(), error.max().item()
    alone = attend(q, kv, layer, blocks, cached)
    assert torch.equal(alone[[0, 3]], got[[0, 3]]) and not torch.equal(alone[1], got[1])
    half = layer.half()
    assert torch.equal(attend(q, kv, half, blocks, cached, first=first),
                       attend(q, kv, half.float(), blocks, cached, first=first))  # fmt: skip
    with pytest.raises(RuntimeError, match="row 2's group begins at row 3"):
        attend(q, kv, layer, blocks, cached, first=torch.tensor([0, 0, 3, 3, 4, 4, 4, 4, 4, 9, 9]))


@pytest.mark.parametrize(**HEADS)
def test_over_a_float16_pool_it_gives_what_the_widened_pool_gives(n_kv, nq, hd):
    """vcvtph2ps widens each value exactly, and the arithmetic after it is the float32 path's:
    bit for bit the result over the same values held in float32."""
    lengths = [0, 1, 15, 16, 17, 100, 255]
    q, kv, layer, blocks, cached = _f32_case(n_kv, nq, hd, lengths, seed=nq + hd + 1)
    half = layer.half()
    got = attend(q, kv, half, blocks, cached)
    assert torch.equal(got, attend(q, kv, half.float(), blocks, cached))
    want = reference(q, kv, half.float(), blocks, cached)
    assert ((got.double() - want).abs() <= want.abs() * 1e-5 + 1e-5).all()
    # Several threads and prefetches of the next task's blocks read the same float16 values.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend(q, kv, half, blocks, cached), got)
    finally:
        torch.set_num_threads(before)


def test_it_runs_on_several_threads_as_on_one():
    """Enough positions to split over OpenMP threads: the same result as one thread's."""
    q, kv, layer, blocks, cached = _f32_case(3, 9, 64, [300, 700, 40, 511], seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parallel = attend(q, kv, layer, blocks, cached)
        torch.set_num_threads(1)
        serial = attend(q, kv, layer, blocks, cached)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(parallel, serial)
    want = reference(q, kv, layer, blocks, cached)
    assert ((parallel.double() - want).abs() <= want.abs() * 1e-5 + 1e-5).all()


def test_a_sharp_softmax_and_a_nan_behave_as_torchs():
    q, kv, layer, blocks, cached = _f32_case(3, 9, 64, [40, 200], seed=5)
    sharp = q * 30  # scores of hundreds: most weights underflow to 0
    got = attend(sharp, kv, layer, blocks, cached)
    want = reference(sharp, kv, layer, blocks, cached)
    assert ((got.double() - want).abs() <= want.abs() * 1e-5 + 1e-5).all()
    layer = layer.clone()
    layer[0, 1, int(blocks[1, 3]) * BLOCK + 2] = float("nan")  # row 1's position 50, KV head 1
    got = attend(q, kv, layer, blocks, cached)
    assert got[1, 3:6].isnan().all() and not got[1, :3].isnan().any() and not got[0].isnan().any()


def test_a_row_with_nothing_cached_returns_its_own_value_exactly():
    q, kv, layer, blocks, cached = _f32_case(3, 9, 64, [0, 40], seed=1)
    got = attend(q, kv, layer, blocks, cached)
    own = kv[0, 1].repeat_interleave(3, dim=0)  # (nq, hd): each KV head's group
    assert torch.equal(got[0], own)
    assert not torch.equal(got[1], kv[1, 1].repeat_interleave(3, dim=0))


def test_it_reads_the_rows_blocks_and_nothing_past_the_cached_positions():
    q, kv, layer, blocks, cached = _f32_case(3, 9, 64, [20, 33], seed=2)
    before = attend(q, kv, layer, blocks, cached)
    poisoned = layer.clone()
    # Row 0's slots from position 20 on, and every block no row has, become NaN.
    poisoned[:, :, int(blocks[0, 1]) * BLOCK + 4 : int(blocks[0, 1] + 1) * BLOCK] = float("nan")
    used = {int(b) for b in blocks[0, :2]} | {int(b) for b in blocks[1, :3]}
    for block in set(range(48)) - used:
        poisoned[:, :, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    assert torch.equal(attend(q, kv, poisoned, blocks, cached), before)
    # One changed key of row 1's first block changes row 1 only.
    poisoned[0, :, int(blocks[1, 0]) * BLOCK] += 1
    after = attend(q, kv, poisoned, blocks, cached)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])


def test_it_refuses_what_it_cannot_compute():
    q, kv, layer, blocks, cached = _f32_case(3, 9, 64, [5], seed=3)
    with pytest.raises(RuntimeError, match="must be float32"):
        attend(q.bfloat16(), kv, layer, blocks, cached)
    with pytest.raises(RuntimeError, match="layer float32 or float16"):
        attend(q, kv, layer.bfloat16(), blocks, cached)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        attend(q, kv, layer, blocks.int(), cached)
    assert not torch.ops.nanoserve.decode_attention_f32_supports(48, 3)
    assert not torch.ops.nanoserve.decode_attention_f32_supports(64, 9)
    assert torch.ops.nanoserve.decode_attention_f32_supports(64, 3)
    q48, kv48, layer48, blocks48, cached48 = _f32_case(1, 2, 48, [5], seed=4)
    with pytest.raises(RuntimeError, match="needs head_dim 16, 32, 64 or 128"):
        attend(q48, kv48, layer48, blocks48, cached48)
    # Indices that would read outside the tensors are refused, not followed.
    width = blocks.shape[1]
    for bad_cached, match in (([-1], "has -1 cached"), ([width * BLOCK + 1], "its table holds")):
        with pytest.raises(RuntimeError, match=match):
            attend(q, kv, layer, blocks, torch.tensor(bad_cached))
    for bad_block in (-1, 48):
        wrong = blocks.clone()
        wrong[0, 0] = bad_block
        with pytest.raises(RuntimeError, match=f"names block {bad_block} of a pool of 48"):
            attend(q, kv, layer, wrong, cached)
    with pytest.raises(RuntimeError, match="block_size must divide"):
        attend(q, kv, layer, blocks, cached, 0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attend(q, kv[:, :, :0], layer[:, :0], blocks, cached)


def _count_calls(monkeypatch) -> tuple[list, list]:
    """The float32 decode and prefill operators' calls: (B, nq, hd) shapes, and (n, start, the
    K/V dtype) of each prefill span."""
    decodes, prefills = [], []
    decode = torch.ops.nanoserve.decode_attention_f32
    prefill = torch.ops.nanoserve.prefill_attention_f32

    def counting_decode(*args):
        decodes.append(args[0].shape)
        return decode(*args)

    def counting_prefill(q, k, v, start):
        prefills.append((q.shape[0], start, k.dtype))
        return prefill(q, k, v, start)

    monkeypatch.setattr(torch.ops.nanoserve, "decode_attention_f32", counting_decode)
    monkeypatch.setattr(torch.ops.nanoserve, "prefill_attention_f32", counting_prefill)
    return decodes, prefills


def _run_mixed(worker):
    """Chunked prefills beside decodes: "a" prefills in chunks of 5 while "b" and "c" decode."""
    from tests.worker.driver import Driver, Request

    prompts = {"a": list(range(3, 40)), "b": [5, 6, 7], "c": [9, 8, 7, 6]}
    requests = [Request(name, prompt, 6) for name, prompt in prompts.items()]
    return Driver(worker, eos=[]).run(requests, chunk=5)


def test_float32_steps_decode_with_it_and_pick_the_torch_backends_tokens(tiny_dir, monkeypatch):
    """And prefill with ``prefill_attention_f32`` (``test_f32_prefill_attention.py``): fresh
    spans and chunks continuing a cached prefix."""
    decodes, prefills = _count_calls(monkeypatch)
    worker = make_worker(tiny_dir, dtype="float32")
    assert isinstance(worker.attention, CpuF32Backend)  # chosen, and built, at start
    with_kernel = _run_mixed(worker)
    assert len(decodes) > 0 and all(shape[1:] == (4, 16) for shape in decodes)  # (B, nq, hd)
    assert (5, 0, torch.float32) in prefills and (5, 5, torch.float32) in prefills, prefills
    decodes.clear()
    prefills.clear()
    generic = make_worker(tiny_dir, dtype="float32", generic_path=True)
    assert type(generic.attention) is TorchBackend
    without = _run_mixed(generic)
    assert not decodes and not prefills
    for a, b in zip(with_kernel, without, strict=True):
        assert a.output == b.output
        worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
        assert worst < 1e-4, worst


def test_turned_off_by_the_environment_float32_keeps_torch(tiny_dir, monkeypatch):
    monkeypatch.setenv("NANOSERVE_KERNELS", "0")
    kernels.loaded.cache_clear()
    try:
        assert not kernels.loaded()
        assert type(make_worker(tiny_dir, dtype="float32").attention) is TorchBackend
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.loaded.cache_clear()
        assert kernels.loaded()


def test_a_float16_pool_under_float32_stays_within_its_rounding(tiny_dir):
    """``kv_cache_dtype="float16"`` (what ``auto`` picks under its float32): K/V are written
    rounded to float16 (eagerly and by prefill and decode alike) and read back widened; the
    logits stay within that rounding of the float32 pool's, and the pool holds twice the blocks
    in the same memory."""
    exact = make_worker(tiny_dir, dtype="float32", kv_cache_memory=1 << 20, num_blocks=None)
    half = make_worker(
        tiny_dir,
        dtype="float32",
        kv_cache_dtype="float16",
        kv_cache_memory=1 << 20,
        num_blocks=None,
    )
    assert (exact.plan.kv_dtype, half.plan.kv_dtype) == ("float32", "float16")
    assert half.cache.pool.dtype == torch.float16 and half.attention.dtype == torch.float32
    assert half.cache.num_blocks == 2 * exact.cache.num_blocks
    for a, b in zip(_run_mixed(exact), _run_mixed(half), strict=True):
        worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
        assert 0 < worst < 1e-2, worst  # float16's 11 bits, not float32's 24


def test_the_kv_cache_dtype_is_the_models_unless_float16_can_be_read(tiny_dir):
    from worker.config import WorkerConfig

    assert make_worker(tiny_dir, dtype="float32").plan.kv_dtype == "float32"  # explicit: exact
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs"):
        make_worker(tiny_dir, dtype="float32", kv_cache_dtype="float16", generic_path=True)
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs a bfloat16 model"):
        make_worker(tiny_dir, dtype="float32", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        WorkerConfig(kv_cache_dtype="int8")
