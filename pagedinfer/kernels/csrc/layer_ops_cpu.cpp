// Fused elementwise ops of a Llama layer on CPU: RMSNorm, residual
// add + RMSNorm, SiLU-and-mul (GELU-tanh-and-mul for Gemma's MLP) and in-place rotary
// embedding.
//
// At batch 1 a decode step is ~40 tiny ops per layer, each costing more in dispatch than in
// arithmetic; these replace ~25 of them with 4 calls. Every op widens to float32, computes in
// float32 and rounds once to the activation dtype (torch's chain of bf16 ops rounds after
// each op, so results differ from it by bf16 rounding, never more; in float32 they differ by
// summation order). See model/llama.py.
#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace {

using pagedinfer::kVec;
#if defined(__AVX512F__)
using pagedinfer::load16;
using pagedinfer::exp16;
using pagedinfer::store16;
using pagedinfer::tanh16;
#endif

constexpr int64_t kRowGrain = 16;  // rows per parallel task: small steps stay on one thread

template <typename T>
float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    total += v * v;
  }
  return total;
}

// out[i] = x[i] * inv_rms * w[i], rounded once.
template <typename T>
void scale_row(const T* x, const T* w, float inv_rms, int64_t n, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    const __m512 r = _mm512_set1_ps(inv_rms);
    for (; i + 16 <= n; i += 16)
      store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), r), load16(w + i)));
  }
#endif
  for (; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(x[i]) * inv_rms * static_cast<float>(w[i]));
}

// residual[i] = round(x[i] + residual[i]) in place.
template <typename T>
void add_into(const T* x, T* residual, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    for (; i + 16 <= n; i += 16)
      store16(residual + i, _mm512_add_ps(load16(x + i), load16(residual + i)));
  }
#endif
  for (; i < n; ++i)
    residual[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
}

// out = silu(gate) * up for one row (gate = x[:d], up = x[d:]).
template <typename T>
void silu_and_mul_row(const T* x, int64_t d, T* out) {
  const T* up = x + d;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= d; i += 16) {
      const __m512 g = load16(x + i);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      store16(out + i, _mm512_mul_ps(silu, load16(up + i)));
    }
  }
#endif
  for (; i < d; ++i) {
    const float g = static_cast<float>(x[i]);
    out[i] = static_cast<T>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

// out = gelu_tanh(gate) * up for one row, with torch's F.gelu(approximate="tanh") order of
// operations: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
template <typename T>
void gelu_tanh_and_mul_row(const T* x, int64_t d, T* out) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const T* up = x + d;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    const __m512 beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
    for (; i + 16 <= d; i += 16) {
      const __m512 g = load16(x + i);
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
      const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, cube)));
      const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh16(inner)));
      store16(out + i, _mm512_mul_ps(gelu, load16(up + i)));
    }
  }
#endif
  for (; i < d; ++i) {
    const float g = static_cast<float>(x[i]);
    const float inner = kBeta * (g + kKappa * (g * g * g));
    out[i] = static_cast<T>(0.5f * g * (1.f + std::tanh(inner)) * static_cast<float>(up[i]));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
}

}  // namespace

// out = x / rms(x) * weight, per row.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float inv = 1.f / std::sqrt(sum_squares(xp + r * n, n) / n + static_cast<float>(eps));
        scale_row(xp + r * n, wp, inv, n, op + r * n);
      }
    });
  });
  return out;
}

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match the input");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_into(xp + r * n, rp + r * n, n);
        const float inv = 1.f / std::sqrt(sum_squares(rp + r * n, n) / n + static_cast<float>(eps));
        scale_row(rp + r * n, wp, inv, n, xp + r * n);
      }
    });
  });
}

// [rows, 2 * d] (gate | up) -> [rows, d] = silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "expected a contiguous [rows, 2 * d] tensor");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(xp + r * 2 * d, d, op + r * d);
    });
  });
  return out;
}

// [rows, 2 * d] (gate | up) -> [rows, d] = gelu_tanh(gate) * up (Gemma's MLP).
torch::Tensor gelu_tanh_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "expected a contiguous [rows, 2 * d] tensor");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) gelu_tanh_and_mul_row(xp + r * 2 * d, d, op + r * d);
    });
  });
  return out;
}

// In place on the first `num_heads` heads of each row of x [rows, >= num_heads * head_dim]
// (q and k heads side by side in the fused qkv output): rotate-half RoPE with float32
// tables cos/sin [max_position, head_dim] indexed by positions [rows] (int64).
void rotary_embedding(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                      torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, width] with unit inner stride");
  TORCH_CHECK(x.size(1) >= num_heads * head_dim && head_dim % 2 == 0, "bad head layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0),
              "positions must be int64 [rows]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim,
              "cos/sin must be contiguous float32 [max_position, head_dim]");
  auto pos = positions.contiguous();
  const int64_t rows = x.size(0), row_stride = x.stride(0), half = head_dim / 2;
  const int64_t max_position = cos.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < max_position, "position ", pp[r], " outside the rotary table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> a(half), b(half);
      for (int64_t r = begin; r < end; ++r) {
        const float* c = cp + pp[r] * head_dim;
        const float* s = sp + pp[r] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          scalar_t* v = xp + r * row_stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            a[i] = static_cast<float>(v[i]);
            b[i] = static_cast<float>(v[i + half]);
          }
          // rotate_half(v) = [-b, a]: first half a*c - b*s, second half b*c + a*s.
          for (int64_t i = 0; i < half; ++i) {
            v[i] = static_cast<scalar_t>(a[i] * c[i] - b[i] * s[i]);
            v[i + half] = static_cast<scalar_t>(b[i] * c[i + half] + a[i] * s[i + half]);
          }
        }
      }
    });
  });
}
