"""Padding a step to bucketed sizes: few shapes ever, and the padding never touches real rows."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from protocol.messages import SamplingParams, StepInput, StepItem
from tests.worker.conftest import make_worker
from worker.attention import AttentionMetadata
from worker.shapes import padded_count, padded_length


def test_buckets_cover_every_size_and_are_few():
    counts = {padded_count(n) for n in range(1, 4097)}
    lengths = {padded_length(n) for n in range(1, 8193)}
    for n in range(1, 4097):
        assert n <= padded_count(n) and padded_count(padded_count(n)) == padded_count(n)
    for n in range(1, 8193):
        assert n <= padded_length(n) and padded_length(padded_length(n)) == padded_length(n)
    assert len(counts) == 55 and len(lengths) == 48
    assert padded_count(1) == 1 and padded_count(5) == 8 and padded_count(65) == 80
    assert padded_length(1) == 32 and padded_length(257) == 320


def _meta(items, trash_block):
    return AttentionMetadata.build(
        items,
        block_size=4,
        n_kv_heads=2,
        dtype=torch.float32,
        device="cpu",
        trash_block=trash_block,
    )


def test_decode_step_pads_with_decodes_that_write_only_the_trash_block():
    # Five decodes (T=5 -> 8) with contexts of 9..13 tokens (4 blocks -> 8, i.e. 32 positions).
    items = [([10 * r + b for b in range(4)], 8 + r, 1) for r in range(5)]
    meta = _meta(items, trash_block=99)
    assert meta.num_tokens == 8 and meta.decode_tokens is None
    assert meta.write_index[:5].tolist() == _meta(items, None).write_index.tolist()
    assert all(99 * 4 <= i < 100 * 4 for i in meta.write_index[5:].tolist())
    assert meta.decodes.blocks.numel() == 8 * 8 and meta.decodes.bias.shape == (2 * 8, 1, 32)
    # Padding decodes attend over the first decode's blocks and context, never the trash.
    blocks = meta.decodes.blocks.view(8, 8)
    assert all(torch.equal(blocks[r], blocks[0]) for r in range(5, 8))
    assert 99 not in meta.decodes.blocks.view(-1).tolist()


def test_mixed_step_pads_its_decode_batch_and_keeps_the_real_targets():
    items = [([1, 2, 3], 0, 10)] + [([10 * r + b for b in range(3)], 5, 1) for r in range(1, 6)]
    meta = _meta(items, trash_block=99)
    assert meta.num_tokens == 16  # 10 prompt tokens + 5 decodes = 15 -> 16
    assert meta.decode_targets.tolist() == [10, 11, 12, 13, 14]
    assert meta.decode_tokens.tolist() == [10, 11, 12, 13, 14, 10, 10, 10]
    assert len(meta.prefills) == 1 and meta.prefills[0].end == 10


def test_padded_worker_step_writes_only_real_positions_and_the_trash_block(tiny_dir):
    worker = make_worker(tiny_dir, num_slots=8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [[1, 5 + r, 30 + r] for r in range(5)]  # 3 tokens: one block each
    items = [
        StepItem(
            request_id=f"r{r}",
            slot=r,
            new_blocks=[r],
            token_ids=p,
            start=0,
            params=greedy,
            prompt_len=len(p),
            fresh=True,
        )
        for r, p in enumerate(prompts)
    ]
    first = worker.execute(StepInput(step_id=1, items=items))
    assert len(first.samples) == 5  # T=15 -> 16: one padding token
    pool = worker.cache.pool  # (layers, 2, n_kv, blocks + 1, block_size, hd), poisoned with NaN
    real = pool[:, :, :, :5]
    untouched = pool[:, :, :, 5 : worker.cache.trash_block]
    assert not real.isnan().any() and untouched.isnan().all()
    assert not pool[:, :, :, worker.cache.trash_block].isnan().all()


def test_the_onednn_cache_is_bounded_when_a_worker_starts_not_on_import(tiny_dir, monkeypatch):
    """Its bound is what keeps the bucketed shapes' primitives resident: set by ``Worker``,
    before any forward; importing the package leaves the environment alone."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    code = "import os, worker.worker, worker.compiled.decode; print(os.environ.get({!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code.format("ONEDNN_PRIMITIVE_CACHE_CAPACITY")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "None"
    make_worker(tiny_dir)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
