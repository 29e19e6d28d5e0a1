"""Triton kernels of the paged attention backend (``worker.attention.triton_backend``).

Three kernels, each reading K/V in place through the block tables, one launch per layer each:

- ``decode_kernel``: program (row, KV head, split). A row's query heads that share the KV head
  attend together (GQA: each cached key is read once per group, not once per query head) over
  the split's share of the row's cached positions, with an online softmax; split 0 then folds
  in the row's own new k/v. With one split it writes the output; with several
  (flash-decoding, for few rows over long contexts) each writes its partial max, sum and
  accumulator, and ``combine_kernel`` merges them.
- ``prefill_kernel``: program (span, tile of the span's queries, KV head), over every prefill
  span of the step at once: causal within the span, over its cached prefix too (a chunked
  prefill, or a prefill after a prefix-cache hit), all through the span's blocks.

Numerics: K, V and q are widened to float32 as they are loaded, every sum runs in float32, and
only the output is rounded to the model's dtype. The dot products run at ``precision``:
"ieee" (full float32) for a float32 model, which must match transformers' greedy tokens;
"tf32" for 16-bit ones, whose values tf32 holds exactly, so q.k is as exact as a bfloat16 MMA's
with float32 accumulation (the probabilities are rounded to tf32's 10 bits, not bfloat16's 7).
The same code therefore runs under ``TRITON_INTERPRET=1`` on CPU tensors, where numpy has no
bfloat16 arithmetic (it loads, stores and widens bfloat16 correctly, but rounds a float32 to
bfloat16 by truncation where a GPU rounds to nearest: one bfloat16 unit in the last place).

Offsets into the pool are int64: one layer of a large GPU pool holds more than 2**31 elements.

Only the interpreter has run these kernels so far: no GPU has compiled them yet. On one,
``tests/worker/test_triton_attention.py`` runs the same checks on the compiled kernels, and
``scripts/bench_attention.py`` times them against the torch backend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(
    q, k_base, blocks_row, pos, valid, d, d_ok, stride_ls, scale_log2,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Scores (rows, BLOCK_N) of q (rows, D_PAD) against the keys at positions ``pos``
    (BLOCK_N,), in the log2 domain (times log2(e) / sqrt(head_dim)), and the keys' pool slots.
    Only ``valid`` positions are read: block ids and keys alike."""
    block = tl.load(blocks_row + pos // BLOCK_SIZE, mask=valid, other=0)  # (BLOCK_N,)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    keys = tl.load(
        k_base + slot[None, :] * stride_ls + d[:, None],
        mask=d_ok[:, None] & valid[None, :],
        other=0.0,
    ).to(tl.float32)  # (D_PAD, BLOCK_N)
    return tl.dot(q, keys, input_precision=PRECISION) * scale_log2, slot


@triton.jit
def _accumulate(
    scores, v_base, slot, valid, d, d_ok, stride_ls, m_i, l_i, acc, PRECISION: tl.constexpr
):
    """One online-softmax step: fold ``scores`` (rows, BLOCK_N; -inf where masked) and the
    values at ``slot`` into the running max ``m_i``, sum ``l_i`` (rows,) and accumulator
    ``acc`` (rows, D_PAD)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)  # 0 on the first step (m_i is -inf, m_new finite)
    p = tl.exp2(scores - m_new[:, None])
    values = tl.load(
        v_base + slot[:, None] * stride_ls + d[None, :],
        mask=valid[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_N, D_PAD)
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def decode_kernel(
    q_ptr, kv_ptr, layer_ptr, blocks_ptr, cached_ptr, tokens_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qt, stride_qh, stride_kvt, stride_kv2, stride_kvh,
    stride_l2, stride_lh, stride_ls, stride_bb, stride_ot, stride_oh,
    scale_log2, chunk,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    HAS_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s query heads of KV head ``head`` over cached positions
    [split * chunk, (split + 1) * chunk), then (split 0) its own new k/v."""
    row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token = row
    if HAS_TOKENS:  # a mixed step: the row's query is this token of the batch
        token = tl.load(tokens_ptr + row).to(tl.int32)
    cached = tl.load(cached_ptr + row).to(tl.int32)  # the loop's bounds in one integer type
    g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = head * GROUP + g  # (G_PAD,) the query heads of this KV head
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (G_PAD, D_PAD); padded heads are zeros, so their scores stay finite
    k_base = layer_ptr + head.to(tl.int64) * stride_lh
    v_base = k_base + stride_l2
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    low = split * chunk
    high = tl.minimum(low + chunk, cached)
    for n0 in range(low, high, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < high
        scores, slot = _scores(
            q, k_base, blocks_ptr + row * stride_bb, pos, valid, d, d_ok, stride_ls, scale_log2,
            BLOCK_SIZE, PRECISION,
        )  # fmt: skip
        scores = tl.where(valid[None, :], scores, float("-inf"))  # (G_PAD, BLOCK_N)
        m_i, l_i, acc = _accumulate(
            scores, v_base, slot, valid, d, d_ok, stride_ls, m_i, l_i, acc, PRECISION
        )
    if split == 0:  # the new token: from kv, where a compiled step has not written it
        new = kv_ptr + token * stride_kvt + head * stride_kvh + d
        k_new = tl.load(new, mask=d_ok, other=0.0).to(tl.float32)  # (D_PAD,)
        v_new = tl.load(new + stride_kv2, mask=d_ok, other=0.0).to(tl.float32)
        s_new = tl.sum(q * k_new[None, :], 1) * scale_log2  # (G_PAD,)
        m_new = tl.maximum(m_i, s_new)
        alpha, p_new = tl.exp2(m_i - m_new), tl.exp2(s_new - m_new)
        acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]
        l_i = l_i * alpha + p_new
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:  # an empty split leaves max -inf, sum 0 and a zero accumulator
        part = (row * tl.num_programs(1) + head) * SPLITS + split
        tl.store(part_m_ptr + part * G_PAD + g, m_i)
        tl.store(part_l_ptr + part * G_PAD + g, l_i)
        tl.store(part_acc_ptr + (part * G_PAD + g[:, None]) * D_PAD + d[None, :], acc)


@triton.jit
def combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, tokens_ptr, out_ptr, stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS: tl.constexpr, HAS_TOKENS: tl.constexpr,
):  # fmt: skip
    """Merge the splits of (row, KV head): rescale each to the largest max, sum, divide."""
    row, head = tl.program_id(0), tl.program_id(1)
    token = row
    if HAS_TOKENS:
        token = tl.load(tokens_ptr + row).to(tl.int32)
    s, g, d = tl.arange(0, SPLITS), tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    part = (row * tl.num_programs(1) + head) * SPLITS + s  # (SPLITS,)
    m = tl.load(part_m_ptr + part[:, None] * G_PAD + g[None, :])  # (SPLITS, G_PAD)
    sums = tl.load(part_l_ptr + part[:, None] * G_PAD + g[None, :])
    m_all = tl.max(m, 0)  # finite: split 0 holds the new token
    w = tl.exp2(m - m_all[None, :])  # (SPLITS, G_PAD)
    acc = tl.load(
        part_acc_ptr + (part[:, None, None] * G_PAD + g[None, :, None]) * D_PAD + d[None, None, :]
    )
    out = tl.sum(acc * w[:, :, None], 0) / tl.sum(sums * w, 0)[:, None]  # (G_PAD, D_PAD)
    heads = head * GROUP + g
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :],
    )


@triton.jit
def prefill_kernel(
    q_ptr, layer_ptr, spans_ptr, out_ptr,
    stride_qt, stride_qh, stride_l2, stride_lh, stride_ls, stride_span, stride_ot, stride_oh,
    scale_log2,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Queries [tile * BLOCK_Q, (tile + 1) * BLOCK_Q) of span ``span`` (its row of ``spans``:
    begin, length, start, then its block ids), with every query head of KV head ``head``:
    rows of the tile are (query, head in group) pairs, BLOCK_Q * G_PAD of them."""
    span, tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table = spans_ptr + span * stride_span
    begin, length, start = tl.load(table), tl.load(table + 1), tl.load(table + 2)
    r, d = tl.arange(0, BLOCK_Q * G_PAD), tl.arange(0, D_PAD)
    query, g = tile * BLOCK_Q + r // G_PAD, r % G_PAD  # (M,) each
    row_ok, d_ok = (query < length) & (g < GROUP), d < HEAD_DIM
    heads = head * GROUP + g
    q = tl.load(
        q_ptr + (begin + query)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (M, D_PAD)
    position = start + query  # (M,) absolute: a query sees keys at positions <= its own
    # Keys up to the tile's last query; none for a tile past the span's end (its grid is the
    # step's longest span's).
    end = start + tl.minimum((tile + 1) * BLOCK_Q, length)
    end = tl.where(tile * BLOCK_Q < length, end, 0)
    k_base = layer_ptr + head.to(tl.int64) * stride_lh
    v_base = k_base + stride_l2
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        scores, slot = _scores(
            q, k_base, table + 3, pos, valid, d, d_ok, stride_ls, scale_log2, BLOCK_SIZE, PRECISION
        )
        # Every row sees position 0 at least, so its running max is finite after one tile.
        causal = valid[None, :] & (pos[None, :] <= position[:, None])  # (M, BLOCK_N)
        scores = tl.where(causal, scores, float("-inf"))
        m_i, l_i, acc = _accumulate(
            scores, v_base, slot, valid, d, d_ok, stride_ls, m_i, l_i, acc, PRECISION
        )
    l_i = tl.where(l_i > 0, l_i, 1.0)  # 0 in a tile past the span's end, which stores nothing
    tl.store(
        out_ptr + (begin + query)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (tl.arange's sizes must be powers of two)."""
    return triton.next_power_of_2(n)
