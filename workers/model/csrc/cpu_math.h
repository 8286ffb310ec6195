// Small math shared by Tandem's CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
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

// The KV cache in fp8 e4m3 (kv_cache_dtype: fp8): written saturating at +-448 (torch's own
// conversion turns anything past 464 into NaN), read back as bf16, which holds every e4m3 value
// exactly. The attention kernels then run their bf16 arithmetic on those values, so an fp8
// cache gives what a bf16 cache holding the same values would.
constexpr float kFp8Max = 448.f;

inline uint8_t to_fp8(float x) {
  if (x != x) return 0x7F;  // NaN
  return c10::Float8_e4m3fn(std::clamp(x, -kFp8Max, kFp8Max)).x;
}

// bf16 bits of each of the 256 e4m3 codes.
inline const uint16_t* fp8_bf16_table() {
  static const auto table = [] {
    alignas(64) std::array<uint16_t, 256> t{};
    for (int i = 0; i < 256; ++i) {
      const c10::Float8_e4m3fn f(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits());
      t[i] = c10::BFloat16(static_cast<float>(f)).x;
    }
    return t;
  }();
  return table.data();
}

inline uint16_t fp8_to_bf16(uint8_t b) { return fp8_bf16_table()[b]; }

#if defined(__AVX512BW__)
// 32 e4m3 codes to their bf16 bits, one per 16-bit lane: the magnitude (7 bits) looked up in
// the table's first 128 entries, 64 at a time, and the sign put back.
inline __m512i fp8x32_to_bf16(const uint8_t* p) {
  const uint16_t* t = fp8_bf16_table();
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i lo =
      _mm512_permutex2var_epi16(_mm512_loadu_si512(t), b, _mm512_loadu_si512(t + 32));
  const __m512i hi =
      _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 64), b, _mm512_loadu_si512(t + 96));
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)),
                                              lo, hi);
  return _mm512_or_si512(mag,
                         _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}

// to_fp8 16 lanes at a time, the same codes: |x| saturated at 448; below 2^-6 (e4m3's
// subnormals) the code is |x| / 2^-9 rounded to nearest even (8 being the smallest normal);
// above, the fp32 bits rounded to nearest even at 3 mantissa bits and the exponent rebased
// (127 - 7); then the sign; a NaN is 0x7F.
inline __m128i to_fp8_x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(kFp8Max));
  const __m512i ab = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), lsb));
  const __m512i normal =
      _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.f)));  // RNE
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.f / 64), _CMP_LT_OQ);
  __m512i code = _mm512_or_si512(_mm512_mask_mov_epi32(normal, small, sub), sign);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(code);
}

// Lanes 16 * half .. 16 * half + 15 of 32 bf16 values, widened to fp32 exactly.
inline __m512 widen_bf16_half(__m512i v, int half) {
  const __m256i h = half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace tandem
