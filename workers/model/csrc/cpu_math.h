// Small math shared by Tandem's CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem {

// exp(x) for x <= 0, in plain float arithmetic that the compiler vectorises: std::exp is a
// scalar libm call, and a long context's softmax (or a wide MLP's SiLU) is mostly exps.
// Cephes' expf: range reduction by ln 2, a degree-6 polynomial; ~1 ulp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);  // below this exp underflows; keeps the exponent field valid
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x * sigmoid(x), through exp of a non-positive argument only (no overflow either way).
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|), in (0, 1]
  return x >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

// Two adjacent bf16 values (raw bits) as one 32-bit word, for a vdpbf16ps broadcast.
inline int32_t bf16_pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0, 16 lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial),
// as exp_nonpositive above.
inline __m512 exp_nonpositive_x16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // a NaN x is the second operand: kept
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The mask of lanes [0, n) of 16, n clamped to [0, 16].
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>(n <= 0 ? 0 : (1u << n) - 1);
}

// 16 bf16 values (raw bits) widened to fp32, exactly.
inline __m512 load_bf16_x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

}  // namespace tandem
