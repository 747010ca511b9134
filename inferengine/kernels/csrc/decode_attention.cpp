// Decode attention on the CPU: one query token per sequence, over its paged K/V, with the new
// token's rotary embedding and K/V store done in the same pass.
//
// For each (sequence b, KV head h), in parallel:
//   1. rotate the new key (NeoX halves of the first `rotary_dim` dims, cos | sin rows of
//      `cos_sin` at `positions[b]`) and store it and the value at flat slot `slots[b]` of the
//      cache [2, num_blocks, block_size, Hkv, D] (skipped for slot < 0);
//   2. rotate the query heads h·G .. h·G + G − 1 (G = Hq / Hkv) into float32;
//   3. scores over the sequence's `seq_lens[b]` positions (those inside the sliding window),
//      scaled, optionally soft-capped (cap · tanh(s / cap)), softmax in float32, and the
//      weighted sum of values.
// K/V pages stay in the cache's dtype (float32, bfloat16 or float16) and are widened as read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace inferengine_cpu;

// Σ_j e^(s_j − mx), with s_j replaced by e^(s_j − mx).
inline float exp_in_place(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  float rest = 0.0f;
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    rest += s[j];
  }
  return hsum(total) + rest;
}

// x (head_dim values, widened) rotated into `out`: for i < rotary_dim / 2,
// out[i] = x[i] cos_i − x[i + half] sin_i and out[i + half] = x[i + half] cos_i + x[i] sin_i.
template <typename T>
void rotate(const T* x, const float* cos_sin, int64_t rotary_dim, int64_t head_dim, float* out) {
  const int64_t half = rotary_dim / 2;
  if (cos_sin == nullptr) {
    for (int64_t i = 0; i < head_dim; ++i) out[i] = widen(x[i]);
    return;
  }
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[i + half]);
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i] + a * sin[i];
  }
  for (int64_t i = rotary_dim; i < head_dim; ++i) out[i] = widen(x[i]);
}

struct Shape {
  int64_t batch, num_heads, num_kv_heads, head_dim, block_size, rotary_dim;
  int64_t q_stride, k_stride, v_stride;  // between sequences' rows of q, k, v
  int64_t table_stride;                  // between sequences' rows of the block table
};

// Eight keys' dot products with q (D values, D % 8 == 0) as one vector: eight independent
// accumulators, then a transposing reduction instead of eight horizontal sums.
template <typename CT>
inline __m256 dot8(const float* q, const CT* const* rows, int64_t D) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, load8(rows[r] + i), a[r]);
  }
  // hadd pairs: lanes (r0 r0 r1 r1 | r0 r0 r1 r1) ..., then fold the 128-bit halves.
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = (r0 r1 r2 r3 | r0 r1 r2 r3) partial halves; same for s4567.
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

template <typename CT>
inline float dot1(const float* q, const CT* row, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(row + i), a);
  return hsum(a);
}

// out[g][c·8 .. c·8 + 8·S) = Σ_j p[g][j] · v_j over the S vectors from chunk c, for G heads:
// G · S accumulators stay in registers while the keys stream by.
template <int G, int S, typename CT>
inline void weighted_values(const float* p, int64_t n, const CT* const* rows, int64_t c,
                            float* out, int64_t D) {
  __m256 acc[G][S];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < S; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 v[S];
    for (int i = 0; i < S; ++i) v[i] = load8(rows[j] + (c + i) * 8);
    for (int g = 0; g < G; ++g) {
      const __m256 pg = _mm256_set1_ps(p[g * n + j]);
      for (int i = 0; i < S; ++i) acc[g][i] = _mm256_fmadd_ps(pg, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < S; ++i) _mm256_storeu_ps(out + g * D + (c + i) * 8, acc[g][i]);
}

template <int G, typename CT>
inline void weighted_values_all(const float* p, int64_t n, const CT* const* rows, float* out,
                                int64_t D) {
  constexpr int S = G <= 3 ? 8 : G <= 6 ? 4 : 2;  // G · S <= 24 accumulators
  int64_t c = 0;
  for (; c + S <= D / 8; c += S) weighted_values<G, S>(p, n, rows, c, out, D);
  for (; c < D / 8; ++c) weighted_values<G, 1>(p, n, rows, c, out, D);
}

// out[g] = Σ_j p[g][j] · v_j (value rows at `rows`), any G and D.
template <typename CT>
void weighted_sum(const float* p, int64_t n, const CT* const* rows, int64_t G, int64_t D,
                  float* out) {
  if (D % 8 == 0) {
    switch (G) {
      case 1: return weighted_values_all<1>(p, n, rows, out, D);
      case 2: return weighted_values_all<2>(p, n, rows, out, D);
      case 3: return weighted_values_all<3>(p, n, rows, out, D);
      case 4: return weighted_values_all<4>(p, n, rows, out, D);
      case 5: return weighted_values_all<5>(p, n, rows, out, D);
      case 6: return weighted_values_all<6>(p, n, rows, out, D);
      case 7: return weighted_values_all<7>(p, n, rows, out, D);
      case 8: return weighted_values_all<8>(p, n, rows, out, D);
      default: break;
    }
  }
  std::fill(out, out + G * D, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) out[g * D + i] += p[g * n + j] * widen(rows[j][i]);
}

template <typename QT, typename CT>
void attend_one(const Shape& s, int64_t b, int64_t h, const QT* q, const QT* k, const QT* v,
                CT* cache, int64_t cache_half, const int64_t* slots, const int32_t* block_table,
                const int32_t* seq_lens, const int64_t* positions, const float* cos_sin,
                int64_t cos_sin_stride, float scale, int64_t window, float soft_cap, QT* out,
                std::vector<float>& scratch, std::vector<const CT*>& key_rows) {
  const int64_t D = s.head_dim, G = s.num_heads / s.num_kv_heads;
  const float* cs = cos_sin ? cos_sin + positions[b] * cos_sin_stride : nullptr;
  const int64_t slot = slots ? slots[b] : -1;
  const int64_t len = seq_lens[b];
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = std::max<int64_t>(0, len - first);
  scratch.resize(G * D + G * n + G * D + D);
  float* qf = scratch.data();     // [G, D] rotated queries
  float* scores = qf + G * D;     // [G, n]
  float* acc = scores + G * n;    // [G, D]
  float* rotated = acc + G * D;   // [D] the new key
  if (slot >= 0) {
    rotate(k + b * s.k_stride + h * D, cs, s.rotary_dim, D, rotated);
    const QT* vs = v + b * s.v_stride + h * D;
    CT* kd = cache + (slot * s.num_kv_heads + h) * D;
    CT* vd = cache + cache_half + (slot * s.num_kv_heads + h) * D;
    for (int64_t i = 0; i < D; ++i) {
      kd[i] = narrow<CT>(rotated[i]);
      vd[i] = narrow<CT>(widen(vs[i]));
    }
  }
  QT* o = out + (b * s.num_heads + h * G) * D;
  if (n == 0) {
    std::fill(o, o + G * D, narrow<QT>(0.0f));
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    rotate(q + b * s.q_stride + (h * G + g) * D, cs, s.rotary_dim, D, qf + g * D);
  }
  // The sequence's key rows for this head, page by page (values sit `cache_half` further).
  key_rows.resize(n);
  const int32_t* table = block_table + b * s.table_stride;
  const int64_t row_stride = s.num_kv_heads * D;
  for (int64_t j = first; j < len; ++j) {
    const int64_t page = table[j / s.block_size];
    key_rows[j - first] = cache + ((page * s.block_size + j % s.block_size) * s.num_kv_heads + h) * D;
  }
  const CT* const* rows = key_rows.data();
  const bool vector = D % 8 == 0;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    float* sg = scores + g * n;
    int64_t j = 0;
    if (vector) {
      for (; j + 8 <= n; j += 8) _mm256_storeu_ps(sg + j, dot8(qg, rows + j, D));
      for (; j < n; ++j) sg[j] = dot1(qg, rows[j], D);
    } else {
      for (; j < n; ++j) {
        float dot = 0.0f;
        for (int64_t i = 0; i < D; ++i) dot += qg[i] * widen(rows[j][i]);
        sg[j] = dot;
      }
    }
    for (j = 0; j < n; ++j) sg[j] *= scale;
    if (soft_cap > 0.0f) {
      for (j = 0; j < n; ++j) sg[j] = soft_cap * std::tanh(sg[j] / soft_cap);
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    const float inv = 1.0f / exp_in_place(sg, n, mx);
    for (j = 0; j < n; ++j) sg[j] *= inv;
  }
  for (int64_t j = 0; j < n; ++j) key_rows[j] += cache_half;  // now the value rows
  weighted_sum(scores, n, rows, G, D, acc);
  for (int64_t i = 0; i < G * D; ++i) o[i] = narrow<QT>(acc[i]);
}

template <typename QT, typename CT>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         at::Tensor& cache, const c10::optional<at::Tensor>& slots, const at::Tensor& block_table,
         const at::Tensor& seq_lens, const c10::optional<at::Tensor>& positions,
         const c10::optional<at::Tensor>& cos_sin, double scale, int64_t window, double soft_cap,
         at::Tensor& out) {
  const int64_t cache_half = cache.numel() / 2;
  const int64_t* slot_ptr = slots ? slots->data_ptr<int64_t>() : nullptr;
  const int64_t* pos_ptr = positions ? positions->data_ptr<int64_t>() : nullptr;
  const float* cs_ptr = cos_sin ? cos_sin->data_ptr<float>() : nullptr;
  const int64_t cs_stride = cos_sin ? cos_sin->size(1) : 0;
  // Small steps (a few short sequences) run on this thread: a parallel region costs more
  // than it saves below a few thousand key rows.
  int64_t rows = 0;
  for (int64_t b = 0; b < s.batch; ++b) rows += seq_lens.data_ptr<int32_t>()[b];
  const int64_t items = s.batch * s.num_kv_heads;
  const int64_t grain = rows * s.num_kv_heads < 4096 ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    thread_local std::vector<const CT*> key_rows;
    for (int64_t item = begin; item < end; ++item) {
      attend_one<QT, CT>(s, item / s.num_kv_heads, item % s.num_kv_heads, q.data_ptr<QT>(),
                         k.data_ptr<QT>(), v.data_ptr<QT>(), cache.data_ptr<CT>(), cache_half,
                         slot_ptr, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         pos_ptr, cs_ptr, cs_stride, static_cast<float>(scale), window,
                         static_cast<float>(soft_cap), out.data_ptr<QT>(), scratch, key_rows);
    }
  });
}

template <typename QT>
void dispatch_cache(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::Tensor& cache, const c10::optional<at::Tensor>& slots,
                    const at::Tensor& block_table, const at::Tensor& seq_lens,
                    const c10::optional<at::Tensor>& positions,
                    const c10::optional<at::Tensor>& cos_sin, double scale, int64_t window,
                    double soft_cap, at::Tensor& out) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      return run<QT, float>(s, q, k, v, cache, slots, block_table, seq_lens, positions, cos_sin,
                            scale, window, soft_cap, out);
    case at::kBFloat16:
      return run<QT, c10::BFloat16>(s, q, k, v, cache, slots, block_table, seq_lens, positions,
                                    cos_sin, scale, window, soft_cap, out);
    case at::kHalf:
      return run<QT, c10::Half>(s, q, k, v, cache, slots, block_table, seq_lens, positions,
                                cos_sin, scale, window, soft_cap, out);
    default:
      TORCH_CHECK(false, "the KV cache must be float32, bfloat16 or float16");
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor kv_cache, const c10::optional<at::Tensor>& slots,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            const c10::optional<at::Tensor>& positions,
                            const c10::optional<at::Tensor>& cos_sin, double scale,
                            int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [B, heads, D]");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k, v must have contiguous heads (rows may be strided)");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "the KV cache must be a contiguous [2, blocks, block_size, Hkv, D] tensor");
  const Shape s{q.size(0), q.size(1), kv_cache.size(3), kv_cache.size(4), kv_cache.size(2),
                cos_sin ? cos_sin->size(1) : 0,
                q.stride(0), k.stride(0), v.stride(0), block_table.stride(0)};
  TORCH_CHECK(q.size(2) == s.head_dim && k.size(1) == s.num_kv_heads &&
                  s.num_heads % s.num_kv_heads == 0 && k.size(0) >= s.batch,
              "q, k and the KV cache disagree on heads or head size");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  seq_lens.is_contiguous() && seq_lens.numel() == s.batch &&
                  block_table.size(0) >= s.batch,
              "block_table and seq_lens must be int32, one row per query");
  if (slots) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->numel() >= s.batch,
                "slots must be int64, one per query");
  }
  if (cos_sin) {
    TORCH_CHECK(positions && positions->scalar_type() == at::kLong &&
                    positions->numel() >= s.batch && cos_sin->scalar_type() == at::kFloat &&
                    cos_sin->is_contiguous() && s.rotary_dim % 2 == 0 &&
                    s.rotary_dim <= s.head_dim,
                "rotary needs int64 positions and a float32 [positions, rotary_dim] cos|sin table");
  }
  at::Tensor out = at::empty({s.batch, s.num_heads, s.head_dim}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_cache<float>(s, q, k, v, kv_cache, slots, block_table, seq_lens, positions, cos_sin,
                          scale, sliding_window, soft_cap, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_cache<c10::BFloat16>(s, q, k, v, kv_cache, slots, block_table, seq_lens, positions,
                                  cos_sin, scale, sliding_window, soft_cap, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kHalf, "q must be float32, bfloat16 or float16");
    dispatch_cache<c10::Half>(s, q, k, v, kv_cache, slots, block_table, seq_lens, positions,
                              cos_sin, scale, sliding_window, soft_cap, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferengine_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor? slots, "
      "Tensor block_table, Tensor seq_lens, Tensor? positions, Tensor? cos_sin, float scale, "
      "int sliding_window, float soft_cap) -> Tensor",
      &decode_attention);
}
