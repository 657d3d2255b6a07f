// 16-lane float32 loads and stores of float32 / bfloat16 / float16 rows, for the CPU kernels.
// With AVX-512 the widening and the round-to-nearest-even narrowing happen in registers; the
// kernels fall back to plain loops (c10's scalar conversions) where this header says
// kVec<T> is false or the CPU has no AVX-512.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedinfer {

template <typename T>
constexpr bool kVecType = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                          std::is_same_v<T, c10::Half>;

#if defined(__AVX512F__)
template <typename T>
constexpr bool kVec = kVecType<T>;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 is the top half of a float32: widen to 32 bits and shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16(float) does; NaN stays a (quiet) NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// e^x for 16 lanes (relative error ~2e-7; 0 below -87.3, where float32 goes subnormal):
// e^x = 2^n * 2^f with n = round(x log2 e),
// |f| <= 1/2, 2^f from a degree-6 polynomial, 2^n applied by scalef.
inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]
  // 2^f = e^(f ln 2): Taylor coefficients of e^y with y = f ln 2, |y| <= 0.347.
  const __m512 y = _mm512_mul_ps(f, _mm512_set1_ps(0.693147180559945f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}
// tanh(x) for 16 lanes (error ~2e-7 absolute, Cephes' tanhf): an odd polynomial below
// |x| = 0.625, where 1 - 2 / (e^2|x| + 1) would lose digits to cancellation, and that form
// above it, the sign put back. NaN stays NaN; large |x| saturates to +-1.
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_add_ps(ax, ax));  // exp16 clamps: e stays finite
  __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  big = _mm512_mask_sub_ps(big, negative, _mm512_setzero_ps(), big);
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_mask_mov_ps(big, is_small, small), nan, x);
}
#else
template <typename T>
constexpr bool kVec = false;

// 8 float lanes in gcc vector types (AVX2: one ymm; NEON: two q registers; scalar code
// elsewhere), for the paths without AVX-512.
typedef float F8v __attribute__((vector_size(32)));
typedef int32_t I8v __attribute__((vector_size(32)));

// e^x for 8 lanes, x <= 0 (softmax weights; relative error ~2e-7, 0 below -87.3): exp16's
// method, 2^n built from the exponent bits (n in [-126, 0]).
inline F8v exp8_nonpositive(F8v x) {
  const I8v tiny = x < -87.3f;
  x = x < -87.3f ? F8v{} - 87.3f : x;
  const F8v t = x * 1.44269504088896341f;
  const F8v n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const F8v y = (t - n) * 0.693147180559945f;     // |y| <= 0.347
  F8v p = F8v{} + 1.f / 720.f;
  p = p * y + 1.f / 120.f;
  p = p * y + 1.f / 24.f;
  p = p * y + 1.f / 6.f;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const I8v bits = (__builtin_convertvector(n, I8v) + 127) << 23;
  const F8v e = p * reinterpret_cast<F8v>(bits);
  return tiny ? F8v{} : e;
}
#endif

// In place: s = e^(s - M) over n floats with M = the larger of *max_io and max s; returns
// the sum and leaves M in *max_io (the pieces of a softmax that a split context, or a
// context taken a chunk at a time, combines later). Start *max_io at -inf; n > 0 and some
// s finite, or M stays -inf and the exponents are NaN.
inline float exp_shifted_inplace(float* s, int64_t n, float* max_io) {
  float m = *max_io;
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
  m = _mm512_reduce_max_ps(vm);
#else
  // 8 running maxima in a register (a scalar loop here kept m in memory: a third of a
  // prefill tile's time).
  F8v vm = F8v{} + m;
  for (; i + 8 <= n; i += 8) {
    F8v v;
    std::memcpy(&v, s + i, sizeof v);
    vm = v > vm ? v : vm;
  }
  for (int l = 0; l < 8; ++l) m = vm[l] > m ? vm[l] : m;
#endif
  for (; i < n; ++i) m = s[i] > m ? s[i] : m;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#else
  F8v vsum{};
  for (; i + 8 <= n; i += 8) {
    F8v v;
    std::memcpy(&v, s + i, sizeof v);
    const F8v e = exp8_nonpositive(v - m);
    std::memcpy(s + i, &e, sizeof e);
    vsum += e;
  }
  for (int l = 0; l < 8; ++l) sum += vsum[l];
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  *max_io = m;
  return sum;
}

}  // namespace pagedinfer
