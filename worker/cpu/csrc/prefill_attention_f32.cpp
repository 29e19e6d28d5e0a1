// nanoserve::prefill_attention_f32: causal attention of a prefill span's float32 queries over
// its K/V, the float32 prefills of the CPU-kernel attention backend
// (worker/attention/cpu_kernel.py). It needs only AVX2, FMA and F16C, as decode_attention_f32.
//
// torch's SDPA (its CPU flash kernel) took 456 us a layer for a 128-token prompt of
// SmolLM2's heads (9 query, 3 KV, head_dim 64) on a 2-core Zen 3, this 201: SDPA computes the
// masked upper triangle too. Here a task is 4 query rows of one KV head (all its query heads);
// each query vector scores only the positions it may see, by tiles of 32 keys that stay in L1
// while every vector of the task passes over them, takes an exact softmax (the max
// subtracted), then the weighted sum of the values by the same tiles. Tasks are dealt to the
// threads light and heavy in turn, so both get the same work.
//
// Shapes: q (n, nq, hd) the span's queries, at positions start .. start + n - 1; k and v
// (m, n_kv, hd), m >= start + n, position-major, float32 (a fresh prompt's own k and v) or
// float16 (a float16 pool's blocks, widened as they are read) -> out (n, nq, hd) float32. Query
// row i sees positions 0 .. start + i. Every tensor's last dimension must be contiguous; the
// others may be strided views.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd_avx2.h"

#include <cmath>
#include <vector>

namespace {

using nanoserve_avx2::exp_neg;
using nanoserve_avx2::load8;
using nanoserve_avx2::reduce_add;
using nanoserve_avx2::sum4;

constexpr int64_t kSerialWork = 8192;  // (position, KV head) pairs below which one thread runs

template <typename T>
struct Views {
  const float* q;
  const T *k, *v;
  float* out;
  int64_t q_row, q_head, k_pos, k_head, v_pos, v_head;  // strides, in elements
  int64_t nq, n_kv, start;
};

constexpr int64_t kRows = 4;   // query rows a task takes: with a group's heads, the vectors
                               // that share each tile of keys and values
constexpr int64_t kTile = 32;  // positions a tile: 8 KiB of float32 keys, held in L1 while
                               // every query vector of the task passes over it

// One query vector's scores over positions [first, last), q in registers, four positions at a
// time: four independent accumulators cover the FMA's latency.
template <typename T, int C>
inline void score(const __m256 (&q)[C], const T* keys, int64_t stride, int64_t first,
                  int64_t last, float* s) {
  int64_t t = first;
  for (; t + 4 <= last; t += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < 4; ++p)
        acc[p] = _mm256_fmadd_ps(q[c], load8(keys + (t + p) * stride + c * 8), acc[p]);
    _mm_storeu_ps(s + t, sum4(acc[0], acc[1], acc[2], acc[3]));
  }
  for (; t < last; ++t) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) acc = _mm256_fmadd_ps(q[c], load8(keys + t * stride + c * 8), acc);
    s[t] = reduce_add(acc);
  }
}

// Exact softmax of s[0, length) in place, unnormalized; returns 1 / the sum. s has room for
// length rounded up to 8.
inline float softmax(float* s, int64_t length) {
  const int64_t padded = (length + 7) / 8 * 8;
  for (int64_t t = length; t < padded; ++t) s[t] = -INFINITY;  // never weighed: exp gives 0
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, 0b01001110));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, 0b10110001));
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  return 1.f / reduce_add(total);
}

// Query rows [row0, row0 + rows) of every query head of KV head `kv_head`, head_dim = 8 * C.
// Positions go by tiles: each tile of keys, then of values, serves all the task's query vectors
// (up to kRows x the group) from L1. scratch: their scores, then their running sums.
template <typename T, int C>
void attend(const Views<T>& w, int64_t kv_head, int64_t row0, int64_t rows,
            std::vector<float>& scratch) {
  const int64_t group = w.nq / w.n_kv, vectors = group * rows;
  const int64_t longest = w.start + row0 + rows;  // the last row's positions
  const int64_t stride = (longest + 7) / 8 * 8;
  scratch.resize(vectors * (stride + C * 8 + 1));
  float* scores = scratch.data();                 // (vectors, stride)
  float* sums = scores + vectors * stride;        // (vectors, hd)
  float* inverse = sums + vectors * C * 8;        // (vectors,)
  const T* keys = w.k + kv_head * w.k_head;
  const T* values = w.v + kv_head * w.v_head;
  const float scale = 1.f / std::sqrt(static_cast<float>(C * 8));
  // Vector x is query row row0 + x / group, head kv_head * group + x % group.
  auto length = [&](int64_t x) { return w.start + row0 + x / group + 1; };
  for (int64_t first = 0; first < longest; first += kTile) {
    for (int64_t x = 0; x < vectors; ++x) {
      const int64_t last = std::min(first + kTile, length(x));
      if (last <= first) continue;
      __m256 q[C];  // (hd,) scaled, in registers while the tile's keys pass it
      const float* qx =
          w.q + (row0 + x / group) * w.q_row + (kv_head * group + x % group) * w.q_head;
      for (int c = 0; c < C; ++c)
        q[c] = _mm256_mul_ps(_mm256_loadu_ps(qx + c * 8), _mm256_set1_ps(scale));
      score<T, C>(q, keys, w.k_pos, first, last, scores + x * stride);
    }
  }
  for (int64_t x = 0; x < vectors; ++x) inverse[x] = softmax(scores + x * stride, length(x));
  for (int64_t x = 0; x < vectors * C * 8; x += 8) _mm256_storeu_ps(sums + x, _mm256_setzero_ps());
  for (int64_t first = 0; first < longest; first += kTile) {
    for (int64_t x = 0; x < vectors; ++x) {
      const int64_t last = std::min(first + kTile, length(x));
      if (last <= first) continue;
      const float* p = scores + x * stride;
      __m256 out[C];  // C accumulators, one broadcast weight a position
      for (int c = 0; c < C; ++c) out[c] = _mm256_loadu_ps(sums + x * C * 8 + c * 8);
      for (int64_t t = first; t < last; ++t) {
        const __m256 weight = _mm256_broadcast_ss(p + t);
        const T* value = values + t * w.v_pos;
        for (int c = 0; c < C; ++c) out[c] = _mm256_fmadd_ps(weight, load8(value + c * 8), out[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(sums + x * C * 8 + c * 8, out[c]);
    }
  }
  for (int64_t x = 0; x < vectors; ++x) {
    float* dst = w.out + ((row0 + x / group) * w.nq + kv_head * group + x % group) * (C * 8);
    const __m256 inv = _mm256_set1_ps(inverse[x]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(dst + c * 8, _mm256_mul_ps(_mm256_loadu_ps(sums + x * C * 8 + c * 8), inv));
  }
}

template <typename T>
using AttendFn = void (*)(const Views<T>&, int64_t, int64_t, int64_t, std::vector<float>&);

// The instance for this head_dim (16, 32, 64 or 128), or null.
template <typename T>
AttendFn<T> pick(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend<T, 2>;
    case 32: return attend<T, 4>;
    case 64: return attend<T, 8>;
    case 128: return attend<T, 16>;
    default: return nullptr;
  }
}

bool supported(int64_t head_dim) { return pick<float>(head_dim) != nullptr; }

// Every (KV head, block of kRows query rows) task over the threads. Row i sees start + i + 1
// positions, so blocks are taken first, last, second, second to last...: a contiguous range of
// tasks then holds light and heavy blocks alike, where in order the last thread would get the
// longest rows.
template <typename T>
void run(const Views<T>& w, int64_t n, int64_t hd, bool serial) {
  const AttendFn<T> fn = pick<T>(hd);
  const int64_t n_kv = w.n_kv, blocks = (n + kRows - 1) / kRows;
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t turn = task / n_kv, kv_head = task % n_kv;
      const int64_t block = turn % 2 == 0 ? turn / 2 : blocks - 1 - turn / 2;
      const int64_t row0 = block * kRows;
      fn(w, kv_head, row0, std::min(kRows, n - row0), scratch);
    }
  };
  if (serial)
    work(0, blocks * n_kv);
  else
    at::parallel_for(0, blocks * n_kv, 1, work);
}

template <typename T>
Views<T> views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               int64_t start) {
  return Views<T>{q.data_ptr<float>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<float>(),
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  q.size(1), k.size(1), start};
}

at::Tensor prefill_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 int64_t start) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "prefill_attention_f32: q (n, nq, hd), k and v (m, n_kv, hd)");
  const int64_t n = q.size(0), nq = q.size(1), hd = q.size(2), m = k.size(0), n_kv = k.size(1);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf),
              "prefill_attention_f32: q must be float32, k and v both float32 or float16");
  TORCH_CHECK(v.size(0) == m && v.size(1) == n_kv && k.size(2) == hd && v.size(2) == hd &&
                  n_kv > 0,
              "prefill_attention_f32: shapes do not match");
  TORCH_CHECK(nq % n_kv == 0 && supported(hd),
              "prefill_attention_f32: needs head_dim 16, 32, 64 or 128 and whole groups of query "
              "heads, got ", hd, " and ", nq, " / ", n_kv);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention_f32: the head dimension must be contiguous");
  // The last row reads positions up to start + n - 1: they must exist, or it reads outside k.
  TORCH_CHECK(start >= 0 && start + n <= m, "prefill_attention_f32: ", n,
              " queries from position ", start, " need ", start + n, " positions of K/V, got ", m);
  at::Tensor out = at::empty({n, nq, hd}, q.options());
  if (n == 0) return out;
  // Under about 0.1 ms of work, waking the other OpenMP threads costs more than they save.
  const int64_t positions = n * start + n * (n + 1) / 2;
  const bool serial = positions * n_kv < kSerialWork;
  if (k.scalar_type() == at::kHalf)
    run(views<c10::Half>(q, k, v, out, start), n, hd, serial);
  else
    run(views<float>(q, k, v, out, start), n, hd, serial);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("prefill_attention_f32(Tensor q, Tensor k, Tensor v, int start) -> Tensor");
  // Whether prefill_attention_f32 takes this head_dim.
  lib.def("prefill_attention_f32_supports(int head_dim) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("prefill_attention_f32", &prefill_attention_f32);
}
