// What nanoserve's two decode attention kernels share (decode_attention.cpp, bfloat16, and
// decode_attention_f32.cpp, float32 over a float32 or float16 pool): the checks of their
// arguments, the walk over a row's blocks with its prefetches, the task a thread prefetches next,
// and the loop that deals (row, KV head) tasks to the threads. The arithmetic, which differs by
// instruction set, stays in each kernel.
//
// Shapes: q (B, nq, hd), kv (B, 2, n_kv, hd) the new token's k and v, layer (2, n_kv, S, hd)
// one layer of the pool, blocks (B, M) each row's block ids, cached (B,) how many positions each
// row has cached, first (B,) or none: the row whose new token each row's group begins with.
//
// Groups: a request verifying draft tokens has a row for each of its new tokens, at positions
// cached, cached + 1, ..., all over the same cached context. Row r attends over its cached
// positions, then over the new k/v of rows first[r] to r, in order: causal within the group,
// which the pool cannot give since a compiled step writes no K/V until its graph is done.
// Without first, each row is its own group (first[r] = r).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <xmmintrin.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace nanoserve_decode {

constexpr int64_t kSerialWork = 8192;  // (position, KV head) pairs below which one thread runs

// The task a thread runs after this one: its table, keys, values and cached count (no table:
// none). T: the pool's element.
template <typename T>
struct Later {
  const int64_t* table = nullptr;
  const T *keys = nullptr, *values = nullptr;
  int64_t cached = 0;
};

// Asks for one position's hd values to be brought into L1 (a hint: never faults).
template <typename T>
inline void prefetch_row(const T* p, int64_t hd) {
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + byte, _MM_HINT_T0);
}

// And into L2.
template <typename T>
inline void prefetch_row_l2(const T* p, int64_t hd) {
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + byte, _MM_HINT_T1);
}

// Calls f(t, pointer to position t's row) for t = 0..cached-1 by blocks (no division per
// position), then for the group's new tokens (``fresh``, in the query's dtype: ``count`` rows
// ``stride`` elements apart), at t = cached.. . ``phase`` 0 reads the keys, 1 the values.
//
// Blocks lie anywhere in the pool, so the hardware prefetcher loses the stream at every block
// boundary: while reading position i of block j this prefetches position i of the next block
// in keys-then-values order into L1. One block ahead is too short to hide the memory's latency
// behind a block's work, so it also asks for position i of block j of the ``later`` task (the
// same phase) into L2: a batch-32 step's K/V (about 100 MB) come from memory, and 30 layers'
// calls at 200 positions, alternating in one process, took 170 -> 136 us a layer (blocks in
// order), 310 -> 236 us (blocks shuffled).
template <typename T, typename V, typename Fresh, typename F>
inline void for_each_position(const V& v, const int64_t* table, int64_t cached, const T* keys,
                              const T* values, int phase, const Fresh* fresh, int64_t count,
                              int64_t stride, const Later<T>& later, F&& f) {
  const int64_t bs = v.block_size, hd = v.hd, used = (cached + bs - 1) / bs;
  const T* base = phase == 0 ? keys : values;
  const T* later_base = phase == 0 ? later.keys : later.values;
  for (int64_t first = 0, j = 0; first < cached; first += bs, ++j) {
    const T* block = base + table[j] * bs * hd;
    const int64_t ahead = phase * used + j + 1;  // the next block, values after keys
    const T* next = ahead < used       ? keys + table[ahead] * bs * hd
                    : ahead < 2 * used ? values + table[ahead - used] * bs * hd
                                       : nullptr;
    const int64_t count = std::min(bs, cached - first);
    const T* far =
        later.table && first < later.cached ? later_base + later.table[j] * bs * hd : nullptr;
    const int64_t far_count = far ? std::min(bs, later.cached - first) : 0;
    for (int64_t i = 0; i < count; ++i) {
      if (next) prefetch_row(next + i * hd, hd);
      if (i < far_count) prefetch_row_l2(far + i * hd, hd);
      f(first + i, block + i * hd);
    }
    // A partial last key block leaves the rest of the first value block to ask for.
    if (next)
      for (int64_t i = count; i < bs; ++i) prefetch_row(next + i * hd, hd);
  }
  for (int64_t g = 0; g < count; ++g) f(cached + g, fresh + g * stride);
}

// How many rows before ``row`` its group holds (their new tokens come before its own).
template <typename V>
inline int64_t earlier_in_group(const V& v, int64_t row) {
  return v.first ? row - v.first[row] : 0;
}

// The groups' first rows as a pointer for the kernel (null: no groups), after checking that
// each row's group begins at or before it.
inline const int64_t* check_groups(const char* op, const std::optional<at::Tensor>& first,
                                   int64_t batch) {
  if (!first.has_value()) return nullptr;
  TORCH_CHECK(first->scalar_type() == at::kLong && first->dim() == 1 && first->size(0) == batch &&
                  first->stride(0) == 1,
              op, ": first must be contiguous int64 (B,)");
  const int64_t* rows = first->data_ptr<int64_t>();
  for (int64_t row = 0; row < batch; ++row)
    TORCH_CHECK(rows[row] >= 0 && rows[row] <= row, op, ": row ", row, "'s group begins at row ",
                rows[row]);
  return rows;
}

// The ranks of the arguments, before anything reads their sizes.
inline void check_ranks(const char* op, const at::Tensor& q, const at::Tensor& kv,
                        const at::Tensor& layer, const at::Tensor& blocks,
                        const at::Tensor& cached) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && layer.dim() == 4 && blocks.dim() == 2 &&
                  cached.dim() == 1,
              op, ": q (B, nq, hd), kv (B, 2, n_kv, hd), layer (2, n_kv, S, hd), blocks (B, M), "
              "cached (B,)");
}

// Everything else but the dtypes: shapes, strides, the heads the kernel takes (``supported``),
// and every block each row reads, which must lie in its table and in the pool (a bad index here
// would read outside the tensors, and the worker must not die of its input). Returns the
// (position, KV head) pairs the call attends over, for the choice of one thread or all.
inline int64_t check_tables(const char* op, const at::Tensor& q, const at::Tensor& kv,
                            const at::Tensor& layer, const at::Tensor& blocks,
                            const at::Tensor& cached, int64_t block_size,
                            bool (*supported)(int64_t, int64_t), const int64_t* first) {
  const int64_t batch = q.size(0), nq = q.size(1), hd = q.size(2), n_kv = layer.size(1);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && cached.scalar_type() == at::kLong &&
                  blocks.stride(1) == 1 && cached.stride(0) == 1,
              op, ": blocks and cached must be contiguous int64");
  TORCH_CHECK(kv.size(0) == batch && kv.size(1) == 2 && kv.size(2) == n_kv && kv.size(3) == hd &&
                  layer.size(0) == 2 && layer.size(3) == hd && blocks.size(0) == batch &&
                  cached.size(0) == batch && n_kv > 0,
              op, ": shapes do not match");
  TORCH_CHECK(nq % n_kv == 0 && supported(hd, nq / n_kv), op,
              ": needs head_dim 16, 32, 64 or 128 and 1 to 8 query heads per KV head, got ", hd,
              " and ", nq, " / ", n_kv);
  TORCH_CHECK(q.stride(2) == 1 && kv.stride(3) == 1 && layer.stride(3) == 1 &&
                  layer.stride(2) == hd,
              op, ": the head dimension must be contiguous, and the pool's rows");
  TORCH_CHECK(block_size > 0 && layer.size(2) % block_size == 0, op,
              ": block_size must divide the pool's ", layer.size(2), " slots");
  const int64_t width = blocks.size(1), pool_blocks = layer.size(2) / block_size;
  const int64_t* ids = blocks.data_ptr<int64_t>();
  const int64_t* lengths = cached.data_ptr<int64_t>();
  int64_t positions = 0;
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t used = (lengths[row] + block_size - 1) / block_size;
    TORCH_CHECK(lengths[row] >= 0 && used <= width, op, ": row ", row, " has ", lengths[row],
                " cached positions; its table holds ", width * block_size);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t id = ids[row * blocks.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < pool_blocks, op, ": row ", row, " names block ", id,
                  " of a pool of ", pool_blocks);
    }
    positions += lengths[row] + 1 + (first ? row - first[row] : 0);
  }
  return positions * n_kv;
}

// Every (row, KV head) task of ``v`` over the threads, each told the next task of its range:
// ``attend(v, row, head, scores, later)``. Under about 0.1 ms of work (``work`` below
// kSerialWork pairs: 10 ns a position and KV head, one thread), waking the other OpenMP threads
// costs more than they save, so a batch-1 decode step's calls stay on this thread. T: the pool's
// element; V: the kernel's views (blocks, cached, layer, their strides, n_kv).
template <typename T, typename V, typename Attend>
void run_tasks(const V& v, int64_t batch, int64_t work, Attend attend) {
  const int64_t n_kv = v.n_kv;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      Later<T> later;  // the next task of this thread's range
      if (task + 1 < end) {
        const int64_t r = (task + 1) / n_kv, h = (task + 1) % n_kv;
        later.table = v.blocks + r * v.blocks_row;
        later.keys = v.layer + h * v.layer_head;
        later.values = later.keys + v.layer_part;
        later.cached = v.cached[r];
      }
      attend(v, task / n_kv, task % n_kv, scores, later);
    }
  };
  if (work < kSerialWork)
    run(0, batch * n_kv);
  else
    at::parallel_for(0, batch * n_kv, 1, run);
}

}  // namespace nanoserve_decode
