"""``TritonBackend`` (``worker/attention/triton_backend.py``), its kernels run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``): what CI can check of the attention CUDA
runs. Where torch sees a GPU, the same tests run the compiled kernels on it instead.

Its decodes and its steps of decodes, fresh prefills and chunked prefills after a cached prefix
(several head groupings, block sizes, contexts across block edges, padded rows writing into the
trash block) equal float64 attention and the torch backend within each dtype's rounding; split
decodes equal unsplit ones; it reads only the positions a row holds (a NaN-poisoned pool gives
bit for bit the same output); and a worker whose plan runs it picks the torch plan's tokens,
with prefix-cache hits too. Speed is for a GPU (``scripts/bench_attention.py``), never asserted.

The interpreter is slow, so the shapes are small and the tiles smaller still (``block_n`` 16,
``block_m`` 16), so that small contexts cross several tiles and splits.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported (its own library of kernels: tl.zeros,
# tl.max, ...) and when triton.jit wraps ours: tests/conftest.py sets it for the session, before
# anything imports triton, where there is no GPU.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

from protocol.messages import SamplingParams  # noqa: E402
from tests.worker.conftest import hf_greedy, hf_model, make_worker  # noqa: E402
from tests.worker.driver import Driver, Request  # noqa: E402
from worker.attention import AttentionMetadata, DecodeRows, TorchBackend  # noqa: E402

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 40  # the pool's blocks; one more, the trash block, follows them
# Each dtype's tolerance against float64: float32's sums, or one unit in the last place of a
# 16-bit output (the interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
HEADS = dict(
    argnames="n_kv, nq, hd",
    argvalues=[(2, 4, 16), (1, 8, 32), (4, 4, 64), (3, 9, 64)],
    ids=["tiny-gqa", "mqa", "mha", "group3"],
)


@pytest.fixture(scope="module")
def triton_backend():
    """The backend's module, its kernels interpreted (on CPU) or compiled (on a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module("worker.attention.triton_backend")
    kernels = importlib.import_module("worker.attention.triton_kernels")
    if isinstance(kernels.decode_kernel, InterpretedFunction) == ON_GPU:
        pytest.fail(f"Triton interprets: {not ON_GPU} expected (TRITON_INTERPRET set too late)")
    return module


def backends(module, n_kv, nq, hd, block_size, dtype, **tiles):
    """(the Triton backend with small tiles, the torch backend) for these heads."""
    geometry = dict(
        n_heads=nq, n_kv_heads=n_kv, head_dim=hd, block_size=block_size, dtype=dtype, device=DEVICE
    )
    tiles = dict(block_n=16, block_m=16) | tiles
    return module.TritonBackend(**tiles, **geometry), TorchBackend(**geometry)


def pool(n_kv, hd, block_size, dtype, gen) -> torch.Tensor:
    """One layer of a random pool, (2, n_kv, (NUM_BLOCKS + 1) * block_size, hd)."""
    shape = (2, n_kv, (NUM_BLOCKS + 1) * block_size, hd)
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


def queries(tokens, n_kv, nq, hd, dtype, gen):
    """q (T, nq, hd) and kv (T, 2, n_kv, hd), strided views of one qkv output as the model's."""
    qkv = torch.randn(tokens, nq + 2 * n_kv, hd, generator=gen).to(DEVICE, dtype)
    return qkv[:, :nq], qkv[:, nq:].view(tokens, 2, n_kv, hd)


def tables(lengths, block_size, gen) -> list[list[int]]:
    """A block table per row, for ``lengths`` positions each, from shuffled disjoint blocks."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    out = []
    for n in lengths:
        used = -(-n // block_size)
        out.append([free.pop() for _ in range(used)])
    return out


def decode_rows(blocks, cached, block_size, n_kv, dtype) -> DecodeRows:
    """The rows' tables padded with their first block, as the worker pads them."""
    width = max(map(len, blocks))
    padded = torch.tensor([table + [table[0]] * (width - len(table)) for table in blocks])
    rows = DecodeRows.of(padded, torch.tensor(cached), block_size, n_kv, dtype)
    return rows.to(DEVICE)


def reference(q, layer, items, block_size) -> torch.Tensor:
    """float64 attention of every item's new tokens over its positions [0, start + n) of
    ``layer`` (the new K/V already written), causal: (sum of n, nq, hd), on the CPU."""
    q, layer = q.cpu(), layer.cpu()
    nq, n_kv = q.shape[1], layer.shape[1]
    group, outs, offset = nq // n_kv, [], 0
    for table, start, n in items:
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start + n)]
        keys, values = layer[:, :, slots].double()  # (n_kv, L, hd) each
        heads = torch.arange(nq) // group
        scores = q[offset : offset + n].double().transpose(0, 1) @ keys[heads].transpose(1, 2)
        causal = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        scores = scores.masked_fill(~causal, float("-inf")) / q.shape[2] ** 0.5
        outs.append((torch.softmax(scores, -1) @ values[heads]).transpose(0, 1))
        offset += n
    return torch.cat(outs)


def assert_close(got, want, dtype, what=""):
    """Within ``dtype``'s tolerance of ``want``, relative to its size."""
    got, want = got.cpu().double(), want.cpu().double()
    error = (got - want).abs()
    bound = want.abs() * TOLERANCE[dtype] + TOLERANCE[dtype]
    assert (error <= bound).all(), (what, (error - bound).max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(**HEADS)
def test_decodes_equal_float64_and_the_torch_backend(triton_backend, n_kv, nq, hd, dtype):
    """Rows with nothing cached, within a block, at and across its edges, over block size 16."""
    gen = torch.Generator().manual_seed(nq * hd)
    triton, torch_backend = backends(triton_backend, n_kv, nq, hd, 16, dtype)
    cached = [0, 1, 15, 16, 17, 40]
    blocks = tables([n + 1 for n in cached], 16, gen)
    rows = decode_rows(blocks, cached, 16, n_kv, dtype)
    layer = pool(n_kv, hd, 16, dtype, gen)
    q, kv = queries(len(cached), n_kv, nq, hd, dtype, gen)
    got = triton.decode(q, kv, layer, rows)
    assert got.dtype == dtype and got.shape == q.shape
    written = layer.clone()  # the reference reads each row's new token from the pool
    for row, (table, n) in enumerate(zip(blocks, cached, strict=True)):
        written[:, :, table[n // 16] * 16 + n % 16] = kv[row]
    items = [(table, n, 1) for table, n in zip(blocks, cached, strict=True)]
    assert_close(got, reference(q, written, items, 16), dtype)
    assert_close(got, torch_backend.decode(q, kv, layer, rows), dtype, "torch")
    # A row with nothing cached gets its own value, exactly.
    group = nq // n_kv
    assert torch.equal(got[0], kv[0, 1].repeat_interleave(group, dim=0))


def test_split_decodes_equal_unsplit_ones(triton_backend):
    """Splits of 16 positions: rows of 3, 17 and 70 cached positions over 1, 2 and 5 of 8
    splits (the empty ones merge as nothing), against one split."""
    gen = torch.Generator().manual_seed(3)
    split, whole = (
        backends(triton_backend, 2, 4, 16, 4, torch.float32, split_positions=n)[0]
        for n in (16, 4096)
    )
    cached = [3, 17, 70]
    rows = decode_rows(tables([n + 1 for n in cached], 4, gen), cached, 4, 2, torch.float32)
    layer = pool(2, 16, 4, torch.float32, gen)
    q, kv = queries(3, 2, 4, 16, torch.float32, gen)
    assert rows.blocks.shape == (3, 18)
    assert split.splits(3, 72) == 8 and whole.splits(3, 72) == 1
    got, want = split.decode(q, kv, layer, rows), whole.decode(q, kv, layer, rows)
    assert_close(got, want, torch.float32)
    assert not torch.equal(got, want)  # the sums ran in another order: it did split


def step(n_kv, nq, hd, block_size, dtype, seed):
    """A mixed step's parts: two decodes, a fresh prefill, a chunk continuing mid-block and one
    after whole cached blocks (a prefix-cache hit), padded with the trash block. Returns the
    items, q, kv and the pool layer."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    # (start, new tokens) per item; the decodes first, as the scheduler orders them
    shapes = [(bs + 1, 1), (3, 1), (0, 11), (5, 6), (2 * bs, 2 * bs + 3)]
    blocks = tables([start + n for start, n in shapes], bs, gen)
    items = [(table, start, n) for table, (start, n) in zip(blocks, shapes, strict=True)]
    tokens = sum(n for _, n in shapes)
    q, kv = queries(tokens + 3, n_kv, nq, hd, dtype, gen)  # and 3 padding tokens' worth
    return items, q, kv, pool(n_kv, hd, bs, dtype, gen)


MIXED = dict(
    argnames="heads, block_size, dtype",
    argvalues=[
        ((2, 4, 16), 4, torch.float32),
        ((3, 9, 64), 16, torch.bfloat16),
        ((1, 8, 32), 12, torch.float32),  # a block size that is no power of two
        ((4, 4, 64), 8, torch.float16),
        ((2, 4, 16), 4, torch.bfloat16),
    ],
    ids=["gqa-f32", "group3-bf16", "mqa-bs12-f32", "mha-f16", "gqa-bf16"],
)


@pytest.mark.parametrize(**MIXED)
def test_a_mixed_step_equals_float64_and_the_torch_backend(
    triton_backend, heads, block_size, dtype
):
    n_kv, nq, hd = heads
    items, q, kv, layer = step(n_kv, nq, hd, block_size, dtype, seed=nq + block_size)
    triton, torch_backend = backends(triton_backend, n_kv, nq, hd, block_size, dtype)
    meta = triton.metadata(items, trash_block=NUM_BLOCKS)
    real = sum(n for _, _, n in items)
    assert meta.num_tokens > real and meta.prefill_batch is not None  # padded, batched
    q, kv = q[: meta.num_tokens], kv[: meta.num_tokens]
    ours, theirs = layer.clone(), layer.clone()
    got = triton.forward(q, kv, ours, meta)
    want = torch_backend.forward(q, kv, theirs, meta)
    assert torch.equal(ours, theirs)  # the same writes, the padding's into the trash block
    trash = slice(NUM_BLOCKS * block_size, (NUM_BLOCKS + 1) * block_size)
    assert not torch.equal(ours[:, :, trash], layer[:, :, trash])
    assert_close(got[:real], reference(q, ours, items, block_size), dtype)
    assert_close(got[:real], want[:real], dtype, "torch")
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padding rows stay finite


def test_a_decode_only_step_pads_its_rows_into_the_trash_block(triton_backend):
    """Nine decodes padded to twelve: the padding tokens write the trash block and attend as
    copies of the first row; the real rows are the unpadded step's."""
    n_kv, nq, hd, bs, dtype = 2, 4, 16, 4, torch.float32
    gen = torch.Generator().manual_seed(5)
    cached = [3, 4, 9, 13, 1, 2, 6, 7, 11]
    blocks = tables([n + 1 for n in cached], bs, gen)
    items = [(table, n, 1) for table, n in zip(blocks, cached, strict=True)]
    triton, _ = backends(triton_backend, n_kv, nq, hd, bs, dtype)
    meta = triton.metadata(items, trash_block=NUM_BLOCKS)
    assert meta.num_tokens == 12 and not meta.prefills and meta.decodes.blocks.shape[0] == 12
    layer = pool(n_kv, hd, bs, dtype, gen)
    q, kv = queries(12, n_kv, nq, hd, dtype, gen)
    padded, plain = layer.clone(), layer.clone()
    got = triton.forward(q, kv, padded, meta)
    alone = triton.forward(q[:9], kv[:9], plain, triton.metadata(items))
    assert torch.equal(got[:9], alone) and got.isfinite().all()
    trash = NUM_BLOCKS * bs  # padding token i writes the trash block's slot i % bs
    assert torch.equal(padded[:, :, trash + 1 : trash + 4], kv[9:12].permute(1, 2, 0, 3))
    assert torch.equal(padded[:, :, : NUM_BLOCKS * bs], plain[:, :, : NUM_BLOCKS * bs])


def test_one_span_alone_gives_what_the_batch_gives(triton_backend):
    """``prefill`` (the interface's one span) runs the batched kernel over that span only."""
    items, q, kv, layer = step(2, 4, 16, 4, torch.float32, seed=7)
    triton, torch_backend = backends(triton_backend, 2, 4, 16, 4, torch.float32)
    meta = triton.metadata(items)
    batched = triton.forward(q[: meta.num_tokens], kv[: meta.num_tokens], layer, meta)
    for span in meta.prefills:  # the new K/V are in the pool: forward wrote them
        alone = triton.prefill(q, kv, layer, span)
        assert torch.equal(alone, batched[span.begin : span.end])
        assert_close(alone, torch_backend.prefill(q, kv, layer, span), torch.float32)


def poisoned(layer, items, block_size) -> torch.Tensor:
    """``layer`` with NaN at every slot no item's positions [0, start + n) name."""
    keep = torch.zeros(layer.shape[2], dtype=torch.bool, device=layer.device)
    for table, start, n in items:
        for p in range(start + n):
            keep[table[p // block_size] * block_size + p % block_size] = True
    return layer.masked_fill(~keep[None, None, :, None], float("nan"))


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decodes"])
def test_it_reads_only_the_positions_each_row_holds(triton_backend, decode_only):
    """Every other slot NaN, the unused tails of the rows' last blocks, the padded tables'
    repeats and the trash block included: the same output, bit for bit. One changed key of
    one row's prefix changes that row's output only."""
    n_kv, nq, hd, bs = 2, 4, 16, 4
    items, q, kv, layer = step(n_kv, nq, hd, bs, torch.float32, seed=11)
    items = items[:2] if decode_only else items
    triton, _ = backends(triton_backend, n_kv, nq, hd, bs, torch.float32, split_positions=8)
    meta = triton.metadata(items, trash_block=NUM_BLOCKS)
    q, kv = q[: meta.num_tokens], kv[: meta.num_tokens]
    real = sum(n for _, _, n in items)
    clean = triton.forward(q, kv, layer.clone(), meta)[:real]
    dirty = poisoned(layer, items, bs)
    got = triton.forward(q, kv, dirty, meta)[:real]
    assert torch.equal(got, clean)
    table, start, _ = items[-1]
    dirty[0, 1, table[0] * bs] += 1  # the last item's first key, KV head 1
    changed = triton.forward(q, kv, dirty, meta)[:real]
    differs = (changed != clean).flatten(1).any(1)  # (T,) per token
    last = real - items[-1][2]
    assert not differs[:last].any() and differs[last:].all()


def triton_plan(tiny_dir):
    """The tiny model's generic float32 plan (plain torch throughout), with Triton's attention."""
    generic = make_worker(tiny_dir, generic_path=True, device=DEVICE).plan
    return generic, dataclasses.replace(generic, attention="triton", prefill="kernel")


def test_a_worker_on_the_triton_plan_picks_the_torch_plans_tokens(triton_backend, tiny_dir):
    """Chunked prefills beside decodes, through the worker's own steps (bucketed, padding into
    the trash block, the pool poisoned with NaN): the same greedy tokens as the torch plan's,
    logits within float32's rounding."""
    generic, plan = triton_plan(tiny_dir)
    # "a" prefills in chunks of 6 beside the others' decodes; then five rows decode
    prompts = {"a": list(range(3, 30)), "b": [5, 6, 7], "c": [9, 8, 7, 6], "d": [4], "e": [8, 9]}
    workers = [make_worker(tiny_dir, plan=chosen) for chosen in (plan, generic)]
    assert type(workers[0].attention) is triton_backend.TritonBackend
    runs = []
    for worker in workers:
        requests = [Request(name, prompt, 8) for name, prompt in prompts.items()]
        runs.append(Driver(worker, eos=[]).run(requests, chunk=6))
    for ours, theirs in zip(*runs, strict=True):
        assert ours.output == theirs.output
        worst = max(
            (a - b).abs().max().item() for a, b in zip(ours.logits, theirs.logits, strict=True)
        )
        assert worst < 1e-4, worst


def test_prefix_cache_hits_on_the_triton_plan_give_transformers_tokens(triton_backend, tiny_dir):
    """Requests that start on another's cached blocks, one after another, then together."""
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine

    stem = [1, *range(40, 52)]  # 13 tokens: 3 whole blocks of 4
    prompts, greedy = [stem + [7, 8], stem + [200]], SamplingParams(max_tokens=4, temperature=0)
    model = hf_model(tiny_dir)
    expected = [hf_greedy(model, prompt, 4, [2]) for prompt in prompts]
    engine = Engine.for_worker(
        make_worker(tiny_dir, plan=triton_plan(tiny_dir)[1]),
        SchedulerConfig(token_budget=64, audit=True, enable_prefix_caching=True),
    )
    outs = [engine.generate([prompt], greedy)[0] for prompt in prompts]
    assert [o.new_token_ids for o in outs] == expected and outs[1].num_cached_tokens == 12
    together = engine.generate(prompts, greedy)
    assert [o.new_token_ids for o in together] == expected
    assert all(o.num_cached_tokens == 12 for o in together)


def test_the_metadata_tables_every_prefill_span_only_when_asked():
    items = [([3, 4], 0, 5), ([7], 2, 1), ([9, 1, 2], 4, 5)]
    plain = AttentionMetadata.build(
        items, block_size=4, n_kv_heads=1, dtype=torch.float32, device="cpu"
    )
    assert plain.prefill_batch is None
    batched = AttentionMetadata.build(
        items, block_size=4, n_kv_heads=1, dtype=torch.float32, device="cpu", batch_prefills=True
    )
    table = batched.prefill_batch.table
    assert table.dtype == torch.int32
    # begin, length, start, then the blocks of [0, start + length), padded with the first
    assert table.tolist() == [[0, 5, 0, 3, 4, 3], [6, 5, 4, 9, 1, 2]]
    assert (batched.prefill_batch.longest, batched.prefill_batch.tokens) == (5, 10)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the benchmark runs")
def test_the_benchmark_says_in_one_line_that_it_needs_a_gpu():
    """``scripts/bench_attention.py`` times the two backends on CUDA; on CPU it refuses."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_attention.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], done.stderr
