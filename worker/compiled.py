"""Compiled decode steps (``--compile``): one inductor graph runs a whole decode step.

An eager decode step is some 400 small operators, and at small batches their dispatch costs
about as much as streaming the weights. ``CompiledDecode`` hands decode-only steps of at most
``MAX_BATCH`` rows to ``torch.compile``: norms, rotary, the block-id gather, the softmax and the
SwiGLU become fused C++ loops around the same matmul kernels (the 4-bit ones included), with no
Python between them. A bfloat16 pool attends with nanoserve's own kernel instead
(``worker.kernels``, where it builds): it reads the blocks in place, where inductor's version
gathers them into a fresh buffer first; a step took 8.0 against 9.1-12 ms at batch 1, and 55
against 61-74 ms at 32 (a 200-token context).

The graph never writes the cache. Each layer attends over its cached positions plus the new
token's own k/v, and returns the new K/V; one ``index_copy_`` after the graph writes every
layer's at once. A write inside the graph would make inductor copy the whole pool to keep the
graph functional.

Compiling takes one to two minutes per graph on two cores, and a step meets one of three
(batch 1; 2 to the 4-bit limit; above it), so the worker compiles all of them at start
(``warm_up``), before it announces itself. Inductor caches them on disk: later starts take
about 20 s. Steps with prefills, and bigger decode batches, stay eager.
"""

from __future__ import annotations

import time

import torch

from worker.attention import AttentionMetadata, uses_own_kernel
from worker.kv_cache import KVCache
from worker.model import LlamaModel
from worker.rope import rotary_cos_sin

# Decode-only steps of at most this many rows (padding included) run compiled. Measured against
# eager at a 256-token context (bf16, both with the attention kernel): 8.5 vs 13.4 ms at 1 row,
# 16.4 vs 23.6 at 4, 27.0 vs 28.7 at 8, 48.7 vs 65.5 at 32. Beyond it, a float32 pool's graph
# (inductor's fresh gather buffers) would grow to tens of MB a layer; the eager path reuses one
# scratch buffer.
MAX_BATCH = 32


class CompiledDecode:
    """The compiled decode step of one model over one cache."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        _allow_packed_linears()
        self.model, self.cache = model, cache
        # bfloat16 pools attend with nanoserve's own kernel where it builds (worker.kernels).
        spec, pool = model.spec, cache.pool
        self.own_attention = uses_own_kernel(
            pool.dtype, pool.device, spec.head_dim, spec.n_heads, spec.n_kv_heads
        )
        self.steps = 0  # steps run compiled, warm-up included
        self.warm_up_s = 0.0  # how long ``warm_up`` took: compiling, or reading inductor's cache
        # After the warm-up, a step no graph covers runs this same code eagerly rather than
        # stall the worker for minutes of compiling (tests make it "fail_on_recompile").
        self.stance = "default"
        self._graph = torch.compile(
            _decode_graph,
            fullgraph=True,
            # This worker's graphs only: guards skip the modules (below), so another model's
            # graphs must never be candidates.
            isolate_recompiles=True,
            options={
                # Block ids come from the worker's own checked tables; a bounds check per
                # element would cost more than the load it guards.
                "assert_indirect_indexing": False,
                # The graph's ~400 kernel and matmul calls are made from C++, not from a
                # Python wrapper: about 0.5 ms less per step at batch 1.
                "cpp_wrapper": True,
                # The oneDNN fusion passes assume weights inductor packed itself (freezing).
                "pattern_matcher": False,
                # The model's modules never change after start: checking them every step costs
                # about a millisecond.
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            },
        )

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs compiled: decodes only, at most ``MAX_BATCH`` rows."""
        return not meta.prefills and meta.num_tokens <= MAX_BATCH

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Like ``LlamaModel.forward`` for an accepted step: input_ids, positions (B,) ->
        hidden states (B, hidden), with the new K/V written into the cache."""
        batch = input_ids.shape[0]
        blocks = meta.decode_blocks.view(batch, -1)  # (B, M)
        cos, sin = rotary_cos_sin(self.model.inv_freq, positions, self.cache.pool.dtype)
        args = (input_ids, cos, sin, blocks, meta.decode_lengths - 1)
        if batch > 1:  # one graph for every batch of 2..MAX_BATCH rows; batch 1 has its own
            for tensor in args:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(blocks, 1)
        layers = self.cache.layers()  # (num_layers, 2, n_kv, S, hd)
        torch._dynamo.maybe_mark_dynamic(layers, 3)  # one graph whatever the pool's size
        with torch.compiler.set_stance(self.stance):
            hidden, new_kv = self._graph(
                self.model, layers, self.cache.block_size, self.own_attention, *args
            )
        # new_kv (num_layers, B, 2, n_kv, hd) -> (num_layers * 2, n_kv, B, hd), as the pool.
        num_layers, _, two, n_kv, hd = new_kv.shape
        columns = new_kv.permute(0, 2, 3, 1, 4).reshape(num_layers * two, n_kv, batch, hd)
        layers.view(num_layers * two, n_kv, -1, hd).index_copy_(2, meta.write_index, columns)
        self.steps += 1
        return hidden

    def warm_up(self) -> None:
        """Compile every graph a step can meet now: batch 1; batches of 2 and more; and
        ``MAX_BATCH``, which may fall on the other side of the 4-bit linears' limit (usually the
        same graph as 2, then a cache hit)."""
        began = time.perf_counter()
        for batch in (1, 2, MAX_BATCH):
            with torch.inference_mode():
                self(*self.trash_step(batch))
        self.warm_up_s = time.perf_counter() - began
        self.stance = "eager_on_recompile"

    def trash_step(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a decode step of ``batch`` rows that reads and
        writes only the trash block. Build it under inference mode, as the worker builds its
        own tensors: dynamo guards on that."""
        ids = torch.zeros(batch, dtype=torch.long, device=self.cache.pool.device)
        trash = self.cache.trash_block
        meta = AttentionMetadata(
            write_index=torch.full_like(ids, trash * self.cache.block_size),
            decode_tokens=None,
            decode_targets=None,
            decode_blocks=torch.full((batch * 2,), trash, device=ids.device),
            decode_lengths=torch.ones_like(ids),
            decode_bias=torch.zeros(0),
            prefills=[],
            block_size=self.cache.block_size,
            num_tokens=batch,
        )
        return ids, ids, meta


def _decode_graph(
    model, layers, block_size: int, own_attention: bool, input_ids, cos, sin, blocks, cached
):
    """The traced step. input_ids (B,), cos/sin (B, 1, hd), blocks (B, M) the rows' padded block
    ids, cached (B,) how many positions each row has cached -> hidden (B, hidden) and the new
    K/V (num_layers, B, 2, n_kv, hd). ``own_attention``: attend with nanoserve's kernel."""
    if own_attention:

        def attention(q, kv, layer):
            return torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, block_size)
    else:
        positions = torch.arange(blocks.shape[1] * block_size, device=blocks.device)  # (L,)
        slots = blocks[:, positions // block_size] * block_size + positions % block_size  # (B, L)
        bias = torch.zeros(slots.shape, device=slots.device).masked_fill_(
            positions[None, :] >= cached[:, None], float("-inf")
        )  # (B, L) float32

        def attention(q, kv, layer):
            return _attend(q, kv, layer, slots, bias)

    new_kv = []

    def attend_over(layer: torch.Tensor):
        def attend(q, kv):
            new_kv.append(kv)
            return attention(q, kv, layer)

        return attend

    x = model.model.embed_tokens(input_ids)  # (B, hidden)
    attends = [attend_over(layers[index]) for index in range(layers.shape[0])]
    hidden = model.run_layers(x, cos, sin, attends)
    return hidden, torch.stack(new_kv)


def _attend(q, kv, layer, slots, bias) -> torch.Tensor:
    """One query per row over its cached K/V plus its own new k/v; the softmax in float32. For
    float32 pools, and bfloat16 ones where ``worker.kernels`` does not build.
    q (B, nq, hd), kv (B, 2, n_kv, hd), layer (2, n_kv, S, hd), slots and bias (B, L)."""
    batch, nq, hd = q.shape
    n_kv = kv.shape[2]
    # Batched matmuls over a gathered copy. Written instead as products and sums, inductor fused
    # the gather, scores and softmax into one loop nest, but it cost ~70 us per row and layer at
    # a 160-token context and grew with it: 2x slower than this at 4 rows.
    # A single row gathers into float32 and multiplies there: these tiny bmm calls take ~12 us
    # in float32 against ~25 in bf16 (a step: 9.0 against 11.9 ms). From 8 rows on, the bigger
    # float32 copies cost more than that saves (24.7 against 23.1 ms at 8, 82 against 64 at 32).
    dtype = torch.float32 if batch == 1 else q.dtype
    group = nq // n_kv
    keys = layer[0][:, slots].reshape(n_kv * batch, -1, hd).to(dtype)  # (n_kv * B, L, hd)
    values = layer[1][:, slots].reshape(n_kv * batch, -1, hd).to(dtype)
    qg = q.view(batch, n_kv, group, hd).transpose(0, 1)  # (n_kv, B, g, hd)
    k_new = kv[:, 0].transpose(0, 1).float()[:, :, None]  # (n_kv, B, 1, hd)
    v_new = kv[:, 1].transpose(0, 1).float()[:, :, None]
    scores = torch.bmm(qg.reshape(n_kv * batch, group, hd).to(dtype), keys.transpose(1, 2))
    scores = scores.view(n_kv, batch, group, -1).float() * hd**-0.5 + bias[None, :, None]
    own = (qg.float() * k_new).sum(-1, keepdim=True) * hd**-0.5  # (n_kv, B, g, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), own)
    weights, own_weight = (scores - top).exp(), (own - top).exp()
    total = weights.sum(-1, keepdim=True) + own_weight
    mixed = torch.bmm((weights / total).to(dtype).view(n_kv * batch, group, -1), values)
    out = mixed.view(n_kv, batch, group, hd).float() + (own_weight / total) * v_new
    out = out.to(q.dtype)  # (n_kv, B, g, hd)
    return out.transpose(0, 1).reshape(batch, nq, hd)


_PACKED_LINEARS_ALLOWED = False


def _allow_packed_linears() -> None:
    """Let inductor call oneDNN's linear on our pre-packed weights as an opaque kernel. Its own
    lowering assumes weights that inductor packed itself and asserts otherwise. Process-wide,
    once: it only changes how that operator is compiled, never what it computes."""
    global _PACKED_LINEARS_ALLOWED
    if _PACKED_LINEARS_ALLOWED:
        return
    from torch._inductor import lowering

    op = torch.ops.mkldnn._linear_pointwise.default
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op)
    _PACKED_LINEARS_ALLOWED = True
