"""Compiled decode steps (``--compile``): one inductor graph runs a whole decode step.

An eager decode step is some 400 small operators, and at small batches their dispatch costs
about as much as streaming the weights. ``CompiledDecode`` hands decode-only steps of at most
``MAX_BATCH`` rows to ``torch.compile``: norms, rotary, the attention backend's decode, the
softmax and the SwiGLU become fused C++ loops around the same matmul kernels (the 4-bit ones
included), with no Python between them. The attention is the worker's backend
(``worker.attention``), traced like the rest.

The graph never writes the cache. Each layer attends over its cached positions plus the new
token's own k/v (``AttentionBackend.decode``), and returns the new K/V; one ``index_copy_``
after the graph writes every layer's at once. A write inside the graph would make inductor copy
the whole pool to keep the graph functional. A request verifying draft tokens is a group of
rows over one cached context (``DecodeRows.first``): each row attends over the cached
positions, then the new k/v of its group's rows up to its own, so a verification step runs in
the same graphs as a decode step (where the backend's operator takes groups, ``group_rows``).

Compiling takes minutes per graph, and a step meets one of two (batch 1; 2 to ``MAX_BATCH``: the
4-bit linears choose their kernel by the rows at run time, in ``nanoserve::gguf_linear``, so
the 4-bit limit does not split it), so the worker compiles both at start (``warm_up``).
Inductor caches them on disk, so later starts only load them, and loading is mostly dynamo's
tracing, some seconds a graph. Dynamo traces one decoder layer and reuses that trace for the
others (``_decoder_layer``, a nested compile region), then flattens the graph again for
inductor. Steps with prefills, and bigger decode batches, stay eager.
"""

from __future__ import annotations

import time

import torch

from worker.attention import AttentionBackend, AttentionMetadata, DecodeRows
from worker.kv.cache import KVCache
from worker.model.llama import LlamaModel
from worker.model.ops import TRACED
from worker.model.rope import rotary_cos_sin

# Decode-only steps of at most this many rows (padding included) run compiled: up to it the
# graph beats eager steps (docs/performance.md). Beyond it, the torch backend's gather
# copies, fresh in a graph, would grow to tens of MB a layer; the eager path reuses one scratch
# buffer.
MAX_BATCH = 32


class CompiledDecode:
    """The compiled decode step of one model over one cache."""

    def __init__(self, model: LlamaModel, cache: KVCache, attention: AttentionBackend) -> None:
        _allow_packed_linears()
        _serial_small_kernels()
        self.model, self.cache, self.attention = model, cache, attention
        self._decode = _Decode(attention)
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
                # Kernels ask OpenMP for the thread count at run time (not a count written in at
                # compile time), so the worker can drop to one thread beside a CPU-bound
                # neighbour and come back (worker.cpu.threads), compiled steps included.
                "cpp.dynamic_threads": True,
                # The graph's ~400 kernel and matmul calls are made from C++, not from a
                # Python wrapper whose overhead is a visible share of a small step.
                "cpp_wrapper": True,
                # The oneDNN fusion passes assume weights inductor packed itself (freezing).
                "pattern_matcher": False,
                # No size and stride check of every input and operator output at every call:
                # about 700 a step, each building a stringstream, some 7% of a batch-1 graph's
                # time (py-spy). Dynamo's guards check the step's own inputs; the weights never
                # change after start.
                "size_asserts": False,
                "guard_filter_fn": _guards_to_keep,
            },
        )

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs compiled: decodes only (a token and its drafts included), at
        most ``MAX_BATCH`` rows."""
        return not meta.prefills and meta.num_tokens <= MAX_BATCH

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Like ``LlamaModel.forward`` for an accepted step: input_ids, positions (B,) ->
        hidden states (B, hidden), with the new K/V written into the cache."""
        batch, blocks = input_ids.shape[0], meta.decodes.blocks  # blocks (B, M)
        cos, sin = rotary_cos_sin(self.model.inv_freq, positions, self.attention.dtype)
        args = (input_ids, cos, sin, blocks, meta.decodes.cached, meta.decodes.first)
        if batch > 1:  # one graph for every batch of 2..MAX_BATCH rows; batch 1 has its own
            for tensor in args:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(blocks, 1)
        layers = self.cache.layers()  # (num_layers, 2, n_kv, S, hd)
        torch._dynamo.maybe_mark_dynamic(layers, 3)  # one graph whatever the pool's size
        with torch.compiler.set_stance(self.stance):
            hidden, new_kv = self._graph(self.model, self._decode, layers, *args)
        # new_kv (num_layers, B, 2, n_kv, hd) -> (num_layers * 2, n_kv, B, hd), as the pool (and
        # in its dtype: the graph casts, float16 under float32).
        num_layers, _, two, n_kv, hd = new_kv.shape
        columns = new_kv.permute(0, 2, 3, 1, 4).reshape(num_layers * two, n_kv, batch, hd)
        layers.view(num_layers * two, n_kv, -1, hd).index_copy_(2, meta.write_index, columns)
        self.steps += 1
        return hidden

    def warm_up(self) -> None:
        """Compile every graph a step can meet now: batch 1; batches of 2 and more; and
        ``MAX_BATCH``, which finds the graph of 2 where the 4-bit linears decide in C++ (where
        they do not, as on a CPU without AVX512-BF16, it falls on the other side of their
        limit and gets one of its own)."""
        began = time.perf_counter()
        # Flat graphs for inductor (the cpp wrapper cannot call a subgraph): the layers' reuse
        # only saves dynamo's tracing, the graphs are those of a plain loop over the layers.
        with torch._dynamo.config.patch(inline_invoke_subgraph=True):
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
        # Two blocks, not one: a size-1 dimension would be specialized, not dynamic.
        blocks = torch.full((batch, 2), trash, device=ids.device)  # (B, M)
        meta = AttentionMetadata(
            write_index=torch.full_like(ids, trash * self.cache.block_size),
            decode_tokens=None,
            decode_targets=None,
            decodes=self.attention.decode_rows(
                blocks, torch.zeros_like(ids), torch.arange(batch, device=ids.device)
            ),
            prefills=[],
            num_tokens=batch,
        )
        return ids, ids, meta


def _decode_graph(model, decode, layers, input_ids, cos, sin, blocks, cached, first):
    """The traced step. input_ids (B,), cos/sin (B, 1, hd), blocks (B, M) the rows' padded block
    ids, cached (B,) how many positions each row has cached, first (B,) the first row of each
    row's group (a token and its drafts; a decode is its own) -> hidden (B, hidden) and the new
    K/V (num_layers, B, 2, n_kv, hd)."""
    rows = decode.attention.decode_rows(blocks, cached, first)
    x = model.model.embed_tokens(input_ids)  # (B, hidden)
    new_kv = []
    for index, layer in enumerate(model.model.layers):
        x, kv = _decoder_layer(layer, decode, TRACED, x, cos, sin, layers[index], *rows)
        new_kv.append(kv)
    return model.model.norm(x, TRACED), torch.stack(new_kv).to(layers.dtype)


@torch.compiler.nested_compile_region
def _decoder_layer(layer, decode, ops, x, cos, sin, cache_layer, *rows):
    """One layer of the traced step, with torch's pointwise ops (``ModelOps``' ``TRACED``, which
    inductor fuses): x (B, hidden) -> (B, hidden), and its new K/V (B, 2, n_kv, hd). Dynamo
    traces it once and reuses that trace for each later layer whose inputs match (it checks;
    the weights are inputs, not part of the trace) instead of tracing every layer again; the
    graph is flattened before inductor sees it (``warm_up``)."""
    rows = DecodeRows(*rows)
    new_kv = []

    def attend(q, kv):
        new_kv.append(kv)
        return decode(q, kv, cache_layer, rows)

    x = layer(x, cos, sin, attend, ops)
    return x, new_kv[0]


class _Decode(torch.nn.Module):
    """The attention backend's decode as a module: dynamo reuses a traced layer only for inputs
    that are tensors, constants or modules, and the backend is none of them."""

    def __init__(self, attention: AttentionBackend) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q, kv, cache_layer, rows: DecodeRows) -> torch.Tensor:
        """``AttentionBackend.decode`` without scratch buffers (traced)."""
        return self.attention.decode(q, kv, cache_layer, rows)


def _guards_to_keep(entries: list) -> list[bool]:
    """Dynamo's guard filter: which guards each step checks. Not the model's modules: they never
    change after start, and checking them every step would be wasted work. Not the global state
    either: it holds torch's thread count, which ``worker.cpu.threads`` drops to one beside a
    CPU-bound neighbour, and a failed guard would send every step after it to eager. The
    kernels read the count at run time (``cpp.dynamic_threads``), so one graph serves any count;
    the rest of that state (grad mode, default dtype) is the same in every step the worker runs
    (``torch.inference_mode``)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [
        kept and entry.guard_type != "GLOBAL_STATE"
        for kept, entry in zip(keep, entries, strict=True)
    ]


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


# Fewer elements than this in a loop of fixed size: one thread runs it (the same rule as our own
# kernels' kSerialElements in csrc/).
SERIAL_ELEMENTS = 32768
_SMALL_KERNELS_SERIAL = False


def _serial_small_kernels() -> None:
    """Let inductor's fused loops of a fixed small size run on one thread. With
    ``cpp.dynamic_threads`` inductor gives every loop an OpenMP parallel region, whatever its
    size (it leaves serial or parallel to the runtime, which always forks). A batch-1 step has
    about 250 of them over a few hundred elements each (one row's norm, rotary, SwiGLU), each
    a fork and a join of the threads. Loops whose size depends on the batch (the graph of 2 and
    more rows) keep their region. Process-wide, once: it changes where loops run, never what
    they compute."""
    global _SMALL_KERNELS_SERIAL
    if _SMALL_KERNELS_SERIAL:
        return
    from torch._inductor.codegen import cpp

    chosen_by_inductor = cpp.CppKernel.decide_parallel_depth

    def decide_parallel_depth(self, max_parallel_depth, threads):
        depth = chosen_by_inductor(self, max_parallel_depth, threads)
        start = max_parallel_depth.start_depth
        ranges = self.call_ranges[start : start + max_parallel_depth.parallel_depth]
        fixed = all(not getattr(size, "free_symbols", None) for size in ranges)
        if depth.parallel_depth and fixed and self.size_hint() < SERIAL_ELEMENTS:
            return cpp.ParallelDepth(parallel_depth=0, start_depth=start)
        return depth

    decide_parallel_depth.__wrapped__ = chosen_by_inductor
    cpp.CppKernel.decide_parallel_depth = decide_parallel_depth
    _SMALL_KERNELS_SERIAL = True
