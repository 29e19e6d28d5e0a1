"""``TritonBackend``: paged attention in nanoserve's own Triton kernels, what CUDA runs.

Decodes and prefills read K/V in place through the block tables
(``worker.attention.triton_kernels``): per layer, one launch for every decode row of the step
and one for every prefill span (fresh prompts, and chunks continuing a cached prefix, whether
the scheduler's chunking or a prefix-cache hit left it there). There is no loop over sequences
and no gather of whole contexts; the new K/V are written first, in one indexed copy per layer,
as every backend does.

Why Triton, and not FlashInfer's or FlashAttention's paged kernels: CI has no GPU, and a Triton
kernel runs there under ``TRITON_INTERPRET=1`` on CPU tensors, so its numerics are tested
against the torch backend with every change (``tests/worker/test_triton_attention.py``).
FlashInfer and FlashAttention run on a GPU only, and neither was measured against this backend:
no GPU was at hand when it was written. ``scripts/bench_attention.py`` times this backend
against the torch one on a GPU; a library's kernel is one more entry of ``BACKENDS`` once a GPU
shows it pays.

The tile sizes and the decode split rule below are reasonable first choices, not measured ones:
no GPU has run them yet.
"""

from __future__ import annotations

import torch

from protocol.blocks import ceil_div
from worker.attention.base import AttentionBackend, Scratch
from worker.attention.metadata import AttentionMetadata, DecodeRows, PrefillBatch, PrefillSpan
from worker.attention.triton_kernels import (
    combine_kernel,
    decode_kernel,
    next_power_of_2,
    prefill_kernel,
)

# The dot products' precision, by the model's dtype (see ``triton_kernels``): a float32 model's
# in full float32, a 16-bit one's in tf32, which holds its values exactly.
PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}
LOG2E = 1.4426950408889634  # the kernels' softmax runs in exp2
MIN_DOT = 16  # tl.dot's least size along any dimension on a GPU
# Decodes split along the context (flash-decoding) while the step has fewer (row, KV head)
# programs than this, one split per SPLIT_POSITIONS cached positions, at most MAX_SPLITS.
SPLIT_BELOW_PROGRAMS = 128
SPLIT_POSITIONS = 256
MAX_SPLITS = 16


class TritonBackend(AttentionBackend):
    """Decode and prefill kernels over the paged pool, batched over the step's rows and spans."""

    name = "triton"

    def __init__(
        self,
        *,
        prefill_kernel: bool = True,
        block_n: int = 64,
        block_m: int = 64,
        split_positions: int = SPLIT_POSITIONS,
        **geometry,
    ) -> None:
        """``block_n``: keys per tile; ``block_m``: (query, head) rows per prefill tile;
        ``split_positions``: cached positions per decode split (tests make these small, so
        that small contexts cross tiles and splits)."""
        super().__init__(**geometry)
        if not prefill_kernel:
            raise ValueError("the triton backend prefills in its own kernel (plan prefill kernel)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads do not group over {self.n_kv_heads}")
        self.group = self.n_heads // self.n_kv_heads
        self.d_pad = max(MIN_DOT, next_power_of_2(self.head_dim))
        self.decode_g_pad = max(MIN_DOT, next_power_of_2(self.group))  # a decode's rows: heads
        self.prefill_g_pad = next_power_of_2(self.group)
        self.block_q = max(1, block_m // self.prefill_g_pad)  # a prefill tile's queries
        self.block_n, self.split_positions = max(MIN_DOT, block_n), split_positions
        self.precision = PRECISION[self.dtype]
        self.scale_log2 = self.head_dim**-0.5 * LOG2E

    def metadata(
        self,
        items: list[tuple[list[int], int, int]],
        *,
        trash_block: int | None = None,
        device: str | None = None,
        groups: list[bool] | None = None,
    ) -> AttentionMetadata:
        """See ``AttentionBackend.metadata``; with the prefill spans in one table too. Its
        decodes take no groups (``group_rows`` 0): a token and its drafts are a prefill span."""
        return AttentionMetadata.build(
            items,
            block_size=self.block_size,
            n_kv_heads=self.n_kv_heads,
            dtype=self.dtype,
            device=device or self.device,
            trash_block=trash_block,
            batch_prefills=True,
        )

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        meta: AttentionMetadata,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``: one decode launch and one prefill launch."""
        self.write(kv, layer, meta)
        if not meta.prefills:
            return self.decode(q, kv, layer, meta.decodes)
        spans = meta.prefill_batch
        if spans is None:
            raise ValueError("the step's metadata has no prefill table: build it with metadata()")
        decodes = meta.decode_targets.numel()  # the real decodes; padded copies are left out
        covered = spans.tokens + decodes == q.shape[0]
        # Zeros where padding tokens get no output: their rows must stay finite.
        out = (torch.empty if covered else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)
        if decodes:
            rows = meta.decodes
            blocks, cached = rows.blocks[:decodes], rows.cached[:decodes]
            self._decode(q, kv, layer, blocks, cached, meta.decode_targets, out)
        self._prefill(q, layer, spans, out)
        return out

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        rows: DecodeRows,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.decode``; reads the cache in place, so needs no scratch."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._decode(q, kv, layer, rows.blocks, rows.cached, None, out)
        return out

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``: the batched kernel over this one span."""
        n = span.end - span.begin
        head = torch.tensor([0, n, span.start], dtype=torch.int32).to(span.blocks.device)
        table = torch.cat([head, span.blocks.to(torch.int32)])[None]  # (1, 3 + M)
        out = torch.empty((n, *q.shape[1:]), dtype=q.dtype, device=q.device)
        self._prefill(q[span.begin : span.end], layer, PrefillBatch(table, n, n), out)
        return out

    def splits(self, rows: int, positions: int) -> int:
        """How many parts each decode row's context is split into: a power of two, from the
        host-known sizes only (rows, and the positions the padded block tables hold)."""
        if rows * self.n_kv_heads >= SPLIT_BELOW_PROGRAMS:
            return 1
        wanted = ceil_div(positions, self.split_positions)
        return min(MAX_SPLITS, next_power_of_2(wanted)) if wanted > 1 else 1

    def _decode(self, q, kv, layer, blocks, cached, tokens, out) -> None:
        """Decode rows ``blocks`` (B, M) with ``cached`` (B,) positions; row i's query is q's
        token ``tokens[i]`` (i where None), and its output goes to the same token of ``out``."""
        batch = blocks.shape[0]
        if batch == 0:
            return
        _unit_last(q, kv, layer, out)
        positions = blocks.shape[1] * self.block_size  # what the padded tables can hold
        splits = self.splits(batch, positions)
        chunk = ceil_div(ceil_div(positions, splits), self.block_n) * self.block_n
        # With one split the kernel writes the output itself and reads no partials.
        parts = self._partials(batch, splits, out.device) if splits > 1 else (out, out, out)
        shared = dict(
            GROUP=self.group, G_PAD=self.decode_g_pad, HEAD_DIM=self.head_dim, D_PAD=self.d_pad
        )
        has_tokens = tokens is not None
        tokens = tokens if has_tokens else cached  # a placeholder the kernel does not read
        decode_kernel[(batch, self.n_kv_heads, splits)](
            q, kv, layer, blocks, cached, tokens, out, *parts,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
            layer.stride(0), layer.stride(1), layer.stride(2), blocks.stride(0),
            out.stride(0), out.stride(1), self.scale_log2, chunk,
            BLOCK_SIZE=self.block_size, BLOCK_N=self.block_n, SPLITS=splits,
            HAS_TOKENS=has_tokens, PRECISION=self.precision, **shared,
        )  # fmt: skip
        if splits > 1:
            combine_kernel[(batch, self.n_kv_heads)](
                *parts, tokens, out, out.stride(0), out.stride(1),
                SPLITS=splits, HAS_TOKENS=has_tokens, **shared,
            )  # fmt: skip

    def _partials(self, batch: int, splits: int, device) -> tuple[torch.Tensor, ...]:
        """Each split's float32 max and sum (B, n_kv, S, G_PAD) and accumulator (B, n_kv, S,
        G_PAD, D_PAD), for ``combine_kernel`` to merge."""
        shape = (batch, self.n_kv_heads, splits, self.decode_g_pad)
        f32 = dict(dtype=torch.float32, device=device)
        return (
            torch.empty(shape, **f32),
            torch.empty(shape, **f32),
            torch.empty(*shape, self.d_pad, **f32),
        )

    def _prefill(self, q, layer, spans: PrefillBatch, out) -> None:
        """Every span of ``spans`` over its cached prefix and itself, into ``out``."""
        _unit_last(q, layer, out)
        table = spans.table
        grid = (table.shape[0], ceil_div(spans.longest, self.block_q), self.n_kv_heads)
        prefill_kernel[grid](
            q, layer, table, out,
            q.stride(0), q.stride(1), layer.stride(0), layer.stride(1), layer.stride(2),
            table.stride(0), out.stride(0), out.stride(1), self.scale_log2,
            GROUP=self.group, G_PAD=self.prefill_g_pad, HEAD_DIM=self.head_dim, D_PAD=self.d_pad,
            BLOCK_SIZE=self.block_size, BLOCK_Q=self.block_q, BLOCK_N=self.block_n,
            PRECISION=self.precision,
        )  # fmt: skip


def _unit_last(*tensors: torch.Tensor) -> None:
    """The kernels step along the last dimension by one element; ValueError otherwise."""
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"attention needs unit stride along head_dim, not {tensor.stride()}")
