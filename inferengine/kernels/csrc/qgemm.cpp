// Block-quantized GEMMs for the CPU: y = x Wᵀ with W kept 4- or 8-bit in blocks of 32 input
// features, x quantized per call to int8 in the same blocks, and integer dot products (AVX2,
// or AVX512-VNNI's dpbusd where the compiler targets it) summed in float32 per block.
//
// Weight layout (built by `cpu_native.pack_q4/pack_q8`): tiles of 8 output rows, one per
// int32 lane, so a block's products for 8 rows accumulate lane by lane with no horizontal
// sums. Within a tile and block, the 32 inputs go in 8 groups of 4 (one 4-byte lane each):
//   q8: int8 [N/8, B, 8 groups, 8 rows, 4], w = scale * q, q in -127..127, with
//       corr int32 [N/8, B, 8] = -128 * Σ q over the block (the VNNI path's x + 128 offset);
//   q4: uint8 [N/8, B, 4 group pairs, 8 rows, 4]: the low nibble of byte (p, r, e) is input
//       4·2p + e of row r, the high nibble input 4·(2p + 1) + e; w = scale * u + offset;
//   scale, offset: float16 or float32 [N/8, B, 8].
// Activations: int8 per block of 32 in one or two terms, x ≈ Σ_t d_t · x_t (see
// `QuantizedActivations`), so
//   Σ_k x_k w_k ≈ Σ_b Σ_t d_tb scale_b Σ_j x_tj u_j + offset_b Σ_j x_j.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace inferengine_cpu;

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;  // output rows per weight tile: one per int32 lane
#if defined(__AVX512VL__)
constexpr int64_t kMaxRows = 4;  // activation rows per micro-kernel call (32 vector registers)
#else
constexpr int64_t kMaxRows = 2;  // (16 vector registers)
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define IE_VNNI 1
#define IE_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define IE_VNNI 1
#define IE_DPBUSD _mm256_dpbusd_avx_epi32
#else
#define IE_VNNI 0
#endif

inline void store1(float* p, float v) { *p = v; }
inline void store1(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

// Four bytes at p in every int32 lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + Σ over each lane's four u8·s8 products.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if IE_VNNI
  return IE_DPBUSD(acc, u, s);
#else
  // Pairs of products fit int16 here: at most 2 * 127 * 127 (q8) or 2 * 15 * 127 (q4).
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// x in int8 per block of 32, in `terms` parts: x ≈ d1 · x1 + d2 · x2, where x1 = round(x / d1)
// with d1 = max|x| / 127 and x2 the same of what x1 leaves (so about 15 bits of the block's
// largest value, against 8 for one term). Values (+128, as uint8, where `unsigned_values`)
// [rows, terms, K], scales [rows, terms, B], and Σ_t d_t · Σ x_t per block [rows, B].
struct QuantizedActivations {
  int64_t rows = 0, blocks = 0, terms = 1;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
};

// Eight lanes' largest |v| as one float.
inline float max_abs(const __m256 (&v)[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// v (32 values) → round(v / d) in int8 at q, with d = max|v| / 127; v becomes what is left
// (v − d · round(v / d)). Returns (d, Σ round(v / d)).
inline std::pair<float, int32_t> quantize_term(__m256 (&v)[4], bool unsigned_values, int8_t* q) {
  const float d = max_abs(v) / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 mul = _mm256_set1_ps(inv), dv = _mm256_set1_ps(d);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    // Round to nearest, ties to even (the MXCSR default), as torch.round does.
    n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], mul));
    v[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(n[i]), dv, v[i]);
  }
  // int32 -> int8 with the packs' lane interleave undone by one permute.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (unsigned_values) p = _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  return {d, _mm_cvtsi128_si32(s)};
}

template <typename T>
void quantize_row(const T* x, int64_t blocks, int64_t terms, bool unsigned_values, int8_t* q,
                  float* scale, float* scaled_sum) {
  const int64_t k = blocks * kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + b * kBlock + 8 * i);
    float total = 0.0f;
    for (int64_t t = 0; t < terms; ++t) {
      const auto [d, sum] = quantize_term(v, unsigned_values, q + t * k + b * kBlock);
      scale[t * blocks + b] = d;
      total += d * static_cast<float>(sum);
    }
    scaled_sum[b] = total;
  }
}

template <typename T>
void quantize_activations(const T* x, int64_t rows, int64_t k, int64_t terms,
                          bool unsigned_values, QuantizedActivations& out) {
  out.rows = rows;
  out.blocks = k / kBlock;
  out.terms = terms;
  out.q.resize(rows * terms * k);
  out.scale.resize(rows * terms * out.blocks);
  out.scaled_sum.resize(rows * out.blocks);
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(x + r * k, out.blocks, terms, unsigned_values, out.q.data() + r * terms * k,
                   out.scale.data() + r * terms * out.blocks,
                   out.scaled_sum.data() + r * out.blocks);
    }
  };
  if (rows * k >= (1 << 16)) {
    at::parallel_for(0, rows, 1, quantize);
  } else {
    quantize(0, rows);
  }
}

// Where a tile's results go: rows m0.. of y (leading dimension ldy), columns n0..n0+valid-1.
template <typename T>
struct Output {
  T* y;
  int64_t ldy, n0, valid;
  const T* bias;
};

template <int R, typename T>
inline void store_tile(const __m256 (&acc)[R], int64_t m0, const Output<T>& out) {
  for (int i = 0; i < R; ++i) {
    float v[kTile];
    _mm256_storeu_ps(v, acc[i]);
    T* row = out.y + (m0 + i) * out.ldy + out.n0;
    for (int64_t r = 0; r < out.valid; ++r) {
      store1(row + r, v[r] + (out.bias ? widen(out.bias[out.n0 + r]) : 0.0f));
    }
  }
}

// Each of `N` (row, term) pairs' block sums, start + Σ_g dot(acc, w[g], x's group g), with
// every sum split over independent accumulators so the dot products' latency overlaps (a
// chain of 8 dependent dpbusd would bound one row at a block per ~40 cycles).
template <int N, typename Dot>
inline void block_sums(const __m256i (&w)[8], const int8_t* const (&x)[N], __m256i start, Dot dot,
                       __m256i (&sums)[N]) {
  constexpr int kChains = N >= 8 ? 1 : N >= 4 ? 2 : 4;
  __m256i part[N][kChains];
  for (int r = 0; r < N; ++r) {
    part[r][0] = start;
    for (int c = 1; c < kChains; ++c) part[r][c] = _mm256_setzero_si256();
  }
  for (int g = 0; g < 8; ++g) {
    for (int r = 0; r < N; ++r) {
      part[r][g % kChains] = dot(part[r][g % kChains], w[g], broadcast4(x[r] + 4 * g));
    }
  }
  for (int r = 0; r < N; ++r) {
    sums[r] = part[r][0];
    for (int c = 1; c < kChains; ++c) sums[r] = _mm256_add_epi32(sums[r], part[r][c]);
  }
}

// The (row, term) pairs' int8 values of block b, and their scales.
template <int R, int Terms>
inline void block_inputs(const QuantizedActivations& x, int64_t m0, int64_t b,
                         const int8_t* (&values)[R * Terms], float (&scales)[R * Terms]) {
  const int64_t k = x.blocks * kBlock;
  for (int i = 0; i < R; ++i) {
    for (int t = 0; t < Terms; ++t) {
      const int64_t row = (m0 + i) * Terms + t;
      values[i * Terms + t] = x.q.data() + row * k + b * kBlock;
      scales[i * Terms + t] = x.scale[row * x.blocks + b];
    }
  }
}

// One tile (8 output rows) against `R` activation rows from `m0`.
template <int R, int Terms, typename S, typename T>
void q4_tile(const uint8_t* wq, const S* wscale, const S* woffset, int64_t blocks,
             const QuantizedActivations& x, int64_t m0, const Output<T>& out) {
  constexpr int N = R * Terms;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  // Weights are unsigned nibbles, activations signed: dpbusd takes them as they are.
  auto dot = [](__m256i acc, __m256i w, __m256i xv) { return dot_u8s8(acc, w, xv); };
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i* wb = reinterpret_cast<const __m256i*>(wq + b * kTile * 16);
    __m256i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(wb + p);
      w[2 * p] = _mm256_and_si256(raw, low);
      w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    const int8_t* xv[N];
    float dx[N];
    block_inputs<R, Terms>(x, m0, b, xv, dx);
    __m256i sums[N];
    block_sums<N>(w, xv, _mm256_setzero_si256(), dot, sums);
    const __m256 scale = load8(wscale + b * kTile);
    const __m256 offset = load8(woffset + b * kTile);
    for (int i = 0; i < R; ++i) {
      for (int t = 0; t < Terms; ++t) {
        const int r = i * Terms + t;
        const __m256 sc = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), sc, acc[i]);
      }
      acc[i] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.scaled_sum[(m0 + i) * blocks + b]), acc[i]);
    }
  }
  store_tile<R>(acc, m0, out);
}

template <int R, int Terms, typename S, typename T>
void q8_tile(const int8_t* wq, const int32_t* corr, const S* wscale, int64_t blocks,
             const QuantizedActivations& x, int64_t m0, const Output<T>& out) {
  constexpr int N = R * Terms;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
#if IE_VNNI
  // x arrives as xq + 128 (unsigned); the block's −128 Σ w starts each sum.
  auto dot = [](__m256i acc, __m256i w, __m256i xv) { return IE_DPBUSD(acc, xv, w); };
#else
  // u8 · s8 products as |x| against w with x's sign moved onto it.
  auto dot = [](__m256i acc, __m256i w, __m256i xv) {
    return dot_u8s8(acc, _mm256_sign_epi8(xv, xv), _mm256_sign_epi8(w, xv));
  };
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i* wb = reinterpret_cast<const __m256i*>(wq + b * kTile * kBlock);
    __m256i w[8];
    for (int g = 0; g < 8; ++g) w[g] = _mm256_loadu_si256(wb + g);
#if IE_VNNI
    const __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + b * kTile));
#else
    const __m256i start = _mm256_setzero_si256();
#endif
    const int8_t* xv[N];
    float dx[N];
    block_inputs<R, Terms>(x, m0, b, xv, dx);
    __m256i sums[N];
    block_sums<N>(w, xv, start, dot, sums);
    const __m256 scale = load8(wscale + b * kTile);
    for (int i = 0; i < R; ++i) {
      for (int t = 0; t < Terms; ++t) {
        const int r = i * Terms + t;
        const __m256 sc = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), sc, acc[i]);
      }
    }
  }
  store_tile<R>(acc, m0, out);
}

void check_weights(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                   int64_t block_bytes, at::ScalarType q_type, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == block_bytes &&
                  q.scalar_type() == q_type,
              "weights must be packed tiles [N/8, K/32, ", block_bytes, "]");
  TORCH_CHECK(x.size(1) == q.size(1) * kBlock, "x has ", x.size(1), " features, weights ",
              q.size(1) * kBlock);
  TORCH_CHECK(n > q.size(0) * kTile - kTile && n <= q.size(0) * kTile,
              "out_features ", n, " does not fit ", q.size(0), " tiles of ", kTile, " rows");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == q.size(0) * q.size(1) * kTile &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scales must be float16 or float32 [N/8, K/32, 8]");
}

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n) {
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous vector of the output features in x's dtype");
  }
}

// Runs `tile(t, m0, rows)` over every (tile, row chunk): tiles split across threads, each
// thread walking its tiles' row chunks so a tile's weights stay in L1 between chunks.
template <typename F>
void for_each_tile(int64_t tiles, int64_t rows, F&& tile) {
  const int64_t grain = std::max<int64_t>(1, 16 / std::max<int64_t>(1, rows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        tile(t, m0, std::min(kMaxRows, rows - m0));
      }
    }
  });
}

// Calls f(R, Terms) with the chunk's row count (1..kMaxRows) and the activations' terms (1, 2)
// as compile-time constants (std::integral_constant), so the micro-kernels unroll over them.
template <typename F>
void with_constants(int64_t rows, int64_t terms, F&& f) {
  auto rows_then = [&](auto t) {
    switch (rows) {
      case 1: return f(std::integral_constant<int, 1>{}, t);
      case 2: return f(std::integral_constant<int, 2>{}, t);
      case 3: return f(std::integral_constant<int, 3>{}, t);
      default: return f(std::integral_constant<int, 4>{}, t);
    }
  };
  terms == 2 ? rows_then(std::integral_constant<int, 2>{})
             : rows_then(std::integral_constant<int, 1>{});
}

// x quantized (`unsigned_x`: as x + 128), then tile(t, m0, R, Terms, x, out) for every tile
// of 8 output rows and chunk of up to kMaxRows activation rows.
template <typename T, typename Tile>
void run_tiles(const at::Tensor& x, int64_t tiles, int64_t terms, bool unsigned_x,
               const c10::optional<at::Tensor>& bias, at::Tensor& y, Tile&& tile) {
  thread_local QuantizedActivations xq;
  const int64_t rows = x.size(0), n = y.size(1);
  quantize_activations(x.data_ptr<T>(), rows, x.size(1), terms, unsigned_x, xq);
  const QuantizedActivations& xa = xq;
  for_each_tile(tiles, rows, [&](int64_t t, int64_t m0, int64_t r) {
    const Output<T> out{y.data_ptr<T>(), n, t * kTile, std::min(kTile, n - t * kTile),
                        bias ? bias->data_ptr<T>() : nullptr};
    with_constants(r, terms, [&](auto R, auto Terms) { tile(t, m0, R, Terms, xa, out); });
  });
}

template <typename S, typename T>
void run_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
            const at::Tensor& offset, const c10::optional<at::Tensor>& bias, int64_t terms,
            at::Tensor& y) {
  const int64_t blocks = q.size(1);
  run_tiles<T>(x, q.size(0), terms, false, bias, y,
               [&](int64_t t, int64_t m0, auto R, auto Terms, const QuantizedActivations& xa,
                   const Output<T>& out) {
                 q4_tile<decltype(R)::value, decltype(Terms)::value>(
                     q.data_ptr<uint8_t>() + t * blocks * kTile * 16,
                     scale.data_ptr<S>() + t * blocks * kTile,
                     offset.data_ptr<S>() + t * blocks * kTile, blocks, xa, m0, out);
               });
}

template <typename S, typename T>
void run_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& corr,
            const at::Tensor& scale, const c10::optional<at::Tensor>& bias, int64_t terms,
            at::Tensor& y) {
  const int64_t blocks = q.size(1);
  run_tiles<T>(x, q.size(0), terms, IE_VNNI, bias, y,
               [&](int64_t t, int64_t m0, auto R, auto Terms, const QuantizedActivations& xa,
                   const Output<T>& out) {
                 q8_tile<decltype(R)::value, decltype(Terms)::value>(
                     q.data_ptr<int8_t>() + t * blocks * kTile * kBlock,
                     corr.data_ptr<int32_t>() + t * blocks * kTile,
                     scale.data_ptr<S>() + t * blocks * kTile, blocks, xa, m0, out);
               });
}

// Calls f(S{}, T{}) with S the scales' element type and T the activations'.
template <typename F>
void dispatch_types(const at::Tensor& x, const at::Tensor& scale, F&& f) {
  const bool half = scale.scalar_type() == at::kHalf;
  if (x.scalar_type() == at::kFloat) {
    half ? f(c10::Half{}, float{}) : f(float{}, float{});
  } else {
    half ? f(c10::Half{}, c10::BFloat16{}) : f(float{}, c10::BFloat16{});
  }
}

at::Tensor qlinear_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const at::Tensor& offset, const c10::optional<at::Tensor>& bias,
                      int64_t out_features, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2");
  check_weights(x, q, scale, kTile * 16, at::kByte, out_features);
  TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == scale.scalar_type() &&
                  offset.is_contiguous(),
              "offsets must match the scales");
  check_bias(bias, x, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  dispatch_types(x, scale, [&](auto s, auto t) {
    run_q4<decltype(s), decltype(t)>(x, q, scale, offset, bias, terms, y);
  });
  return y;
}

at::Tensor qlinear_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& corr,
                      const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                      int64_t out_features, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2");
  check_weights(x, q, scale, kTile * kBlock, at::kChar, out_features);
  TORCH_CHECK(corr.scalar_type() == at::kInt && corr.is_contiguous() &&
                  corr.numel() == scale.numel(),
              "corr must be int32 [N/8, K/32, 8]");
  check_bias(bias, x, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  dispatch_types(x, scale, [&](auto s, auto t) {
    run_q8<decltype(s), decltype(t)>(x, q, corr, scale, bias, terms, y);
  });
  return y;
}

// The activations' int8 form, for tests: (x_t int8 [M, terms, K], d_t [M, terms, K/32],
// Σ_t d_t · Σ x_t [M, K/32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& x, int64_t terms) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be a contiguous [M, K] matrix with K a multiple of 32");
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2");
  QuantizedActivations xq;
  if (x.scalar_type() == at::kFloat) {
    quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1), terms, false, xq);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    quantize_activations(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), terms, false, xq);
  }
  const int64_t blocks = x.size(1) / kBlock;
  at::Tensor q = at::empty({x.size(0), terms, x.size(1)}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({x.size(0), terms, blocks}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({x.size(0), blocks}, x.options().dtype(at::kFloat));
  std::memcpy(q.data_ptr(), xq.q.data(), xq.q.size());
  std::memcpy(d.data_ptr(), xq.scale.data(), xq.scale.size() * sizeof(float));
  std::memcpy(s.data_ptr(), xq.scaled_sum.data(), xq.scaled_sum.size() * sizeof(float));
  return {q, d, s};
}

std::string isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferengine_cpu, m) {
  m.def(
      "qlinear_q4(Tensor x, Tensor q, Tensor scale, Tensor offset, Tensor? bias, "
      "int out_features, int terms) -> Tensor",
      &qlinear_q4);
  m.def(
      "qlinear_q8(Tensor x, Tensor q, Tensor corr, Tensor scale, Tensor? bias, "
      "int out_features, int terms) -> Tensor",
      &qlinear_q8);
  m.def("quantize_blocks(Tensor x, int terms) -> (Tensor, Tensor, Tensor)", &quantize_blocks);
  m.def("isa() -> str", &isa);
}
