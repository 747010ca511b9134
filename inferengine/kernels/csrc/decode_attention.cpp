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
  int64_t batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, rotary_dim;
  int64_t q_stride, k_stride, v_stride;  // between sequences' rows of q, k, v
  int64_t table_stride;                  // between sequences' rows of the block table
};

template <typename QT, typename CT>
void attend_one(const Shape& s, int64_t b, int64_t h, const QT* q, const QT* k, const QT* v,
                CT* cache, int64_t cache_half, const int64_t* slots, const int32_t* block_table,
                const int32_t* seq_lens, const int64_t* positions, const float* cos_sin,
                int64_t cos_sin_stride, float scale, int64_t window, float soft_cap, QT* out,
                std::vector<float>& scratch) {
  const int64_t D = s.head_dim, G = s.num_heads / s.num_kv_heads;
  const float* cs = cos_sin ? cos_sin + positions[b] * cos_sin_stride : nullptr;
  const int64_t slot = slots ? slots[b] : -1;
  if (slot >= 0) {
    scratch.resize(std::max<size_t>(scratch.size(), D));
    float* rotated = scratch.data();
    rotate(k + b * s.k_stride + h * D, cs, s.rotary_dim, D, rotated);
    const QT* vs = v + b * s.v_stride + h * D;
    CT* kd = cache + (slot * s.num_kv_heads + h) * D;
    CT* vd = cache + cache_half + (slot * s.num_kv_heads + h) * D;
    for (int64_t i = 0; i < D; ++i) {
      kd[i] = narrow<CT>(rotated[i]);
      vd[i] = narrow<CT>(widen(vs[i]));
    }
  }
  const int64_t len = seq_lens[b];
  QT* o = out + (b * s.num_heads + h * G) * D;
  if (len <= 0) {
    std::fill(o, o + G * D, narrow<QT>(0.0f));
    return;
  }
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  scratch.resize(G * D + G * n + G * D);
  float* qf = scratch.data();           // [G, D] rotated queries
  float* scores = qf + G * D;           // [G, n]
  float* acc = scores + G * n;          // [G, D]
  for (int64_t g = 0; g < G; ++g) {
    rotate(q + b * s.q_stride + (h * G + g) * D, cs, s.rotary_dim, D, qf + g * D);
  }
  const int32_t* table = block_table + b * s.table_stride;
  const int64_t row_stride = s.num_kv_heads * D;  // between a page's token rows
  // Calls f(j, key row) for j in [first, len), page by page (no division per key).
  auto for_each_row = [&](auto&& f) {
    for (int64_t p = first / s.block_size; p * s.block_size < len; ++p) {
      const CT* rows = cache + (static_cast<int64_t>(table[p]) * s.block_size * s.num_kv_heads + h) * D;
      const int64_t lo = std::max(first, p * s.block_size), hi = std::min(len, (p + 1) * s.block_size);
      for (int64_t j = lo; j < hi; ++j) f(j - first, rows + (j - p * s.block_size) * row_stride);
    }
  };
  const bool vector = D % 8 == 0;
  for_each_row([&](int64_t j, const CT* kr) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float dot = 0.0f;
      if (vector) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(kr + i), a);
        dot = hsum(a);
      } else {
        for (int64_t i = 0; i < D; ++i) dot += qg[i] * widen(kr[i]);
      }
      float score = dot * scale;
      if (soft_cap > 0.0f) score = soft_cap * std::tanh(score / soft_cap);
      scores[g * n + j] = score;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    const float total = exp_in_place(sg, n, mx);
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  std::fill(acc, acc + G * D, 0.0f);
  for_each_row([&](int64_t j, const CT* kr) {
    const CT* vr = kr + cache_half;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + j];
      float* ag = acc + g * D;
      if (vector) {
        const __m256 pv = _mm256_set1_ps(p);
        for (int64_t i = 0; i < D; i += 8) {
          _mm256_storeu_ps(ag + i, _mm256_fmadd_ps(pv, load8(vr + i), _mm256_loadu_ps(ag + i)));
        }
      } else {
        for (int64_t i = 0; i < D; ++i) ag[i] += p * widen(vr[i]);
      }
    }
  });
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
  at::parallel_for(0, s.batch * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      attend_one<QT, CT>(s, item / s.num_kv_heads, item % s.num_kv_heads, q.data_ptr<QT>(),
                         k.data_ptr<QT>(), v.data_ptr<QT>(), cache.data_ptr<CT>(), cache_half,
                         slot_ptr, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         pos_ptr, cs_ptr, cs_stride, static_cast<float>(scale), window,
                         static_cast<float>(soft_cap), out.data_ptr<QT>(), scratch);
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
                block_table.size(1), cos_sin ? cos_sin->size(1) : 0,
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
