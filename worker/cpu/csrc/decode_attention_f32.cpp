// nanoserve::decode_attention_f32: one decode query per row over its paged float32 or float16
// K/V, the decodes of the cpu-f32 attention backend (worker/attention/cpu_f32.py), eager and
// compiled. It needs only AVX2, FMA and F16C, so it is built on CPUs without AVX-512
// too, where `auto` serves float32 over a float16 pool (worker/cpu/kernels.py).
//
// The torch backend builds this attention from a gather of every cached K/V into a copy, two
// batched matmuls and a softmax: on a 2-core Zen 3, 81 of a batch-32 decode step's 220 ms at
// 256 positions, for 360 MiB of K/V that one pass reads in about 13 ms. Here each (row, KV
// head) pair reads its blocks in place once: scores, an exact softmax (the max subtracted, the
// new token included), then the weighted sum of the values, all in float32. A float16 pool
// (`auto`'s, as llama.cpp's default f16 K/V) halves the bytes: vcvtph2ps widens 8 values a load.
//
// Shapes: q (B, nq, hd), kv (B, 2, n_kv, hd) the new token's k and v, layer (2, n_kv, S, hd)
// one layer of the pool, blocks (B, M) each row's block ids, cached (B,) how many positions
// each row has cached, first (B,) or none each row's group's first row (a request's draft tokens:
// decode_common.h) -> out (B, nq, hd), all float32 but layer (float32 or float16), blocks,
// cached and first (int64). q and kv may be strided views (of the qkv matmul's output); their last
// dimension must be contiguous.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decode_common.h"
#include "simd_avx2.h"

#include <cmath>
#include <vector>

namespace {

using nanoserve_avx2::exp_neg;
using nanoserve_avx2::load8;
using nanoserve_avx2::sum4;

using nanoserve_decode::for_each_position;
using nanoserve_decode::prefetch_row;
using nanoserve_decode::Later;

// T: the pool's element, float or c10::Half.
template <typename T>
struct Views {
  const float *q, *kv;
  const T* layer;
  const int64_t *blocks, *cached;
  const int64_t* first;  // each row's group's first row, or null (see decode_common.h)
  float* out;
  int64_t q_row, q_head, kv_row, kv_part, kv_head;  // strides, in elements
  int64_t layer_part, layer_head, blocks_row;
  int64_t nq, n_kv, hd, block_size;
};

// Lane l of the result: op over every lane of v congruent to l modulo W (W = 4 or 8).
template <int W, typename Op>
inline __m256 fold(__m256 v, Op op) {
  if constexpr (W == 4) v = op(v, _mm256_permute2f128_ps(v, v, 1));
  return v;
}

// One row's G query heads of one KV head, head_dim = 8 * C.
//
// Scores are kept position-major, W floats per position (G rounded up to 4 or 8; the spare
// heads score 0 and are never read): an 8-float vector then holds whole positions, so the
// softmax of all G heads runs on full vectors. scratch: W * (cached + 1) rounded up.
template <typename T, int G, int C>
void attend(const Views<T>& v, int64_t row, int64_t head, std::vector<float>& scratch,
            const Later<T>& later) {
  constexpr int W = G <= 4 ? 4 : 8;
  constexpr int64_t kPerVector = 8 / W;  // positions per 8-float vector
  const int64_t cached = v.cached[row];
  const int64_t earlier = nanoserve_decode::earlier_in_group(v, row);
  const int64_t length = cached + earlier + 1;  // the group's new tokens last, the row's own last
  const int64_t padded = (length + kPerVector - 1) / kPerVector * kPerVector;
  const float scale = 1.f / std::sqrt(static_cast<float>(C * 8));
  scratch.resize(W * padded);
  float* s = scratch.data();
  const T* keys = v.layer + head * v.layer_head;
  const T* values = keys + v.layer_part;
  const float* k_new = v.kv + (row - earlier) * v.kv_row + head * v.kv_head;
  const float* v_new = k_new + v.kv_part;
  const int64_t* table = v.blocks + row * v.blocks_row;
  if (cached > 0)  // the first block: for_each_position prefetches the others
    for (int64_t i = 0; i < std::min(v.block_size, cached); ++i)
      prefetch_row(keys + table[0] * v.block_size * v.hd + i * v.hd, v.hd);
  // Scores: one dot product per (position, query head); the group shares each key's load. At
  // G * C over 16 the queries do not fit AVX2's 16 registers and are read from L1.
  __m256 q[G][C];  // the group's queries, scaled
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      q[g][c] = _mm256_mul_ps(
          _mm256_loadu_ps(v.q + row * v.q_row + (head * G + g) * v.q_head + c * 8),
          _mm256_set1_ps(scale));
  for_each_position(v, table, cached, keys, values, 0, k_new, earlier + 1, v.kv_row, later,
                    [&](int64_t t, const auto* key) {
    __m256 acc[W];
    for (int g = 0; g < W; ++g) acc[g] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m256 k = load8(key + c * 8);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(q[g][c], k, acc[g]);
    }
    for (int g = 0; g < W; g += 4)
      _mm_storeu_ps(s + t * W + g, sum4(acc[g], acc[g + 1], acc[g + 2], acc[g + 3]));
  });
  for (int64_t i = length * W; i < padded * W; ++i) s[i] = -INFINITY;  // never weighed
  // Softmax of every head at once: lane l of a vector is head l % W.
  const int64_t vectors = padded * W / 8;
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < vectors; ++i) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i * 8));
  top = fold<W>(top, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); });
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < vectors; ++i) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i * 8), top));
    _mm256_storeu_ps(s + i * 8, e);
    total = _mm256_add_ps(total, e);
  }
  total = fold<W>(total, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), total);
  for (int64_t i = 0; i < vectors; ++i)
    _mm256_storeu_ps(s + i * 8, _mm256_mul_ps(_mm256_loadu_ps(s + i * 8), inv));
  // Weighted sum of the values.
  __m256 out[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) out[g][c] = _mm256_setzero_ps();
  for_each_position(v, table, cached, keys, values, 1, v_new, earlier + 1, v.kv_row, later,
                    [&](int64_t t, const auto* value) {
    __m256 weight[G];
    for (int g = 0; g < G; ++g) weight[g] = _mm256_broadcast_ss(s + t * W + g);
    for (int c = 0; c < C; ++c) {
      const __m256 val = load8(value + c * 8);
      for (int g = 0; g < G; ++g) out[g][c] = _mm256_fmadd_ps(weight[g], val, out[g][c]);
    }
  });
  for (int g = 0; g < G; ++g) {
    float* dst = v.out + (row * v.nq + head * G + g) * (C * 8);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(dst + c * 8, out[g][c]);
  }
}

template <typename T>
using AttendFn = void (*)(const Views<T>&, int64_t, int64_t, std::vector<float>&,
                          const Later<T>&);

template <typename T, int C>
AttendFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return attend<T, 1, C>;
    case 2: return attend<T, 2, C>;
    case 3: return attend<T, 3, C>;
    case 4: return attend<T, 4, C>;
    case 5: return attend<T, 5, C>;
    case 6: return attend<T, 6, C>;
    case 7: return attend<T, 7, C>;
    case 8: return attend<T, 8, C>;
    default: return nullptr;
  }
}

// The instance for this head_dim (16, 32, 64 or 128) and query heads per KV head (1 to 8), or
// null.
template <typename T>
AttendFn<T> pick(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 16: return pick_group<T, 2>(group);
    case 32: return pick_group<T, 4>(group);
    case 64: return pick_group<T, 8>(group);
    case 128: return pick_group<T, 16>(group);
    default: return nullptr;
  }
}

bool supported(int64_t head_dim, int64_t group) { return pick<float>(head_dim, group) != nullptr; }

template <typename T>
Views<T> views(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& layer,
               const at::Tensor& blocks, const at::Tensor& cached, const int64_t* groups,
               at::Tensor& out, int64_t block_size) {
  return Views<T>{q.data_ptr<float>(), kv.data_ptr<float>(), layer.data_ptr<T>(),
                  blocks.data_ptr<int64_t>(), cached.data_ptr<int64_t>(), groups,
                  out.data_ptr<float>(),
                  q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
                  layer.stride(0), layer.stride(1), blocks.stride(0),
                  q.size(1), layer.size(1), q.size(2), block_size};
}

at::Tensor decode_attention_f32(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& layer,
                                const at::Tensor& blocks, const at::Tensor& cached,
                                int64_t block_size, const std::optional<at::Tensor>& first) {
  nanoserve_decode::check_ranks("decode_attention_f32", q, kv, layer, blocks, cached);
  const int64_t* groups =
      nanoserve_decode::check_groups("decode_attention_f32", first, q.size(0));
  const int64_t batch = q.size(0), nq = q.size(1), hd = q.size(2), n_kv = layer.size(1);
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  (layer.scalar_type() == at::kFloat || layer.scalar_type() == at::kHalf),
              "decode_attention_f32: q and kv must be float32, layer float32 or float16");
  const int64_t work = nanoserve_decode::check_tables("decode_attention_f32", q, kv, layer,
                                                      blocks, cached, block_size, &supported,
                                                      groups);
  at::Tensor out = at::empty({batch, nq, hd}, q.options());
  const int64_t group = nq / n_kv;
  if (layer.scalar_type() == at::kHalf)
    nanoserve_decode::run_tasks<c10::Half>(views<c10::Half>(q, kv, layer, blocks, cached, groups,
                                                            out, block_size),
                                           batch, work, pick<c10::Half>(hd, group));
  else
    nanoserve_decode::run_tasks<float>(views<float>(q, kv, layer, blocks, cached, groups, out,
                                                    block_size),
                                       batch, work, pick<float>(hd, group));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def(
      "decode_attention_f32(Tensor q, Tensor kv, Tensor layer, Tensor blocks, Tensor cached, "
      "int block_size, Tensor? first=None) -> Tensor");
  // Whether decode_attention_f32 takes this head_dim and number of query heads per KV head.
  lib.def("decode_attention_f32_supports(int head_dim, int group) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("decode_attention_f32", &decode_attention_f32);
}
