// Row-wise CPU kernels around the matmuls: RMSNorm (with the residual add folded in) and the
// gated activation, each one op instead of the many small torch ops they replace. They round
// where the torch path rounds: a bfloat16 model's sum, normalized row and product with the
// weight are each rounded to bfloat16, as `layers/norm.py` and `layers/activation.py` do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

using namespace inferengine_cpu;

// One row: r = x (+ residual, stored into residual), out = w · (r / rms(r)).
template <typename T, typename W>
void norm_row(T* x, T* residual, const W* w, int64_t n, float eps, T* out) {
  const bool vector = n % 8 == 0;
  T* r = x;
  if (residual != nullptr) {
    r = residual;
    if (vector) {
      for (int64_t i = 0; i < n; i += 8) {
        store8(residual + i, _mm256_add_ps(load8(x + i), load8(residual + i)));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) residual[i] = narrow<T>(widen(x[i]) + widen(residual[i]));
    }
  }
  float ss = 0.0f;
  if (vector) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = load8(r + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum(acc);
  } else {
    for (int64_t i = 0; i < n; ++i) ss += widen(r[i]) * widen(r[i]);
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (vector) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 normed = round_through(out, _mm256_mul_ps(load8(r + i), iv));
      store8(out + i, _mm256_mul_ps(normed, load8(w + i)));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(r[i]) * inv)));
    }
  }
}

template <typename T, typename W>
void run_norm(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& w,
              double eps, at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const W* wp = w.data_ptr<W>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       norm_row(xp + i * n, rp ? rp + i * n : nullptr, wp, n,
                                static_cast<float>(eps), op + i * n);
                     }
                   });
}

// norm(x) into a new tensor; with a residual, residual += x and x = norm(residual), in place
// (as the CUDA kernel does), returning x.
at::Tensor rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
                  x.size(-1) == weight.size(0),
              "x must be contiguous with the weight's size as its last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "the weight must be in x's dtype");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "the residual must match x");
  }
  at::Tensor out = residual ? x : at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    run_norm<float, float>(x, residual, weight, eps, out);
  } else {
    run_norm<c10::BFloat16, c10::BFloat16>(x, residual, weight, eps, out);
  }
  return out;
}

template <typename T>
void silu_mul_row(const T* x, int64_t d, T* out) {
  const T* gate = x;
  const T* up = x + d;
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(out + i, _mm256_mul_ps(round_through(out, silu), load8(up + i)));
  }
  for (; i < d; ++i) {
    const float g = widen(gate[i]);
    out[i] = narrow<T>(widen(narrow<T>(g / (1.0f + std::exp(-g)))) * widen(up[i]));
  }
}

// [..., 2d] → silu(gate) · up with gate the first half.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "x must be contiguous [..., 2d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t d = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(1, 2 * d);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, x.options());
  auto run = [&](auto* xp, auto* op) {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t i = begin; i < end; ++i) silu_mul_row(xp + i * 2 * d, d, op + i * d);
                     });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferengine_cpu, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> Tensor",
        &rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
