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
    assert len(counts) == 58 and len(lengths) == 48
    assert padded_count(5) == 5 and padded_count(8) == 8 and padded_count(9) == 12
    assert padded_count(1) == 1 and padded_count(65) == 80
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
    # Nine decodes (T=9 -> 12) with contexts of 9..17 tokens (5 blocks -> 8, i.e. 32 positions).
    items = [([10 * r + b for b in range(5)], 8 + r, 1) for r in range(9)]
    meta = _meta(items, trash_block=99)
    assert meta.num_tokens == 12 and meta.decode_tokens is None
    assert meta.write_index[:9].tolist() == _meta(items, None).write_index.tolist()
    assert all(99 * 4 <= i < 100 * 4 for i in meta.write_index[9:].tolist())
    assert meta.decodes.blocks.numel() == 12 * 8 and meta.decodes.bias.shape == (2 * 12, 1, 32)
    # Padding decodes attend over the first decode's blocks and context, never the trash.
    blocks = meta.decodes.blocks.view(12, 8)
    assert all(torch.equal(blocks[r], blocks[0]) for r in range(9, 12))
    assert 99 not in meta.decodes.blocks.view(-1).tolist()
    assert meta.decodes.first.tolist() == list(range(12))  # every row its own group


def test_mixed_step_pads_its_decode_batch_and_keeps_the_real_targets():
    items = [([1, 2, 3], 0, 10)] + [([10 * r + b for b in range(3)], 5, 1) for r in range(1, 10)]
    meta = _meta(items, trash_block=99)
    assert meta.num_tokens == 20  # 10 prompt tokens + 9 decodes = 19 -> 20
    assert meta.decode_targets.tolist() == list(range(10, 19))
    assert meta.decode_tokens.tolist() == [*range(10, 19), 10, 10, 10]
    assert len(meta.prefills) == 1 and meta.prefills[0].end == 10
    assert meta.decodes.first.tolist() == list(range(12))


def test_a_token_and_its_drafts_are_one_group_of_decode_rows_where_the_backend_takes_them():
    # A prompt chunk, a decode, a token with three drafts, another decode.
    items = [([1, 2, 3], 0, 6), ([4, 5], 5, 1), ([6, 7, 8, 11], 9, 4), ([9, 10], 6, 1)]
    grouped = AttentionMetadata.build(
        items, block_size=4, n_kv_heads=2, dtype=torch.float32, device="cpu", trash_block=99,
        groups=[False, False, True, False], group_rows=17,
    )  # fmt: skip
    assert len(grouped.prefills) == 1  # the prompt's chunk alone
    assert grouped.decode_targets.tolist() == [6, 7, 8, 9, 10, 11]
    # Rows 1 to 4 are the group: each sees the cached 9 positions, then rows 1 to itself.
    assert grouped.decodes.first.tolist()[:6] == [0, 1, 1, 1, 1, 5]
    assert grouped.decodes.cached.tolist()[:6] == [5, 9, 9, 9, 9, 6]
    assert grouped.write_index[7:11].tolist() == [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 11 * 4]
    # Where the backend takes no groups (group_rows 0), the same item is a prefill span.
    plain = AttentionMetadata.build(
        items, block_size=4, n_kv_heads=2, dtype=torch.float32, device="cpu", trash_block=99,
        groups=[False, False, True, False],
    )  # fmt: skip
    assert [(span.begin, span.end) for span in plain.prefills] == [(0, 6), (7, 11)]


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
