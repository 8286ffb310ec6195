// int8 linear layers for CPUs: y = (x W^T), with W int8 per output channel and x quantized
// to int8 per row as it arrives (W8A8, symmetric).
//
// A decode step reads every weight once; at int8 that is half the bytes of bf16. The weight is
// packed once, at load, so that one 64-byte load holds four consecutive inputs of 16 outputs
// ([N/32][K/4][32][4]); AVX512-VNNI's `vpdpbusd` multiplies them by a broadcast four of an
// input row's bytes and adds the four products into 16 int32 sums. vpdpbusd takes its first
// operand unsigned, so a row is stored as q + 128 and each output's 128 * sum(w) (`comp`,
// computed at pack time) is taken off its sum before scaling.
//
// The arithmetic is integer until the last step, so it is exact: the portable path (every
// other CPU, or forced with `portable`) computes the same sums in plain C++ and its results
// are bit-identical to the VNNI path's. A row's result depends on that row alone, whatever
// the batch or the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TANDEM_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace int8_linear {
constexpr int64_t kBlockN = 32;  // outputs per packed block
constexpr int64_t kTileM = 256;  // rows kept in cache while every weight block passes

// fp32 to bf16 bits, rounded to nearest even as torch rounds (NaN kept a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The kernels are built with -fassociative-math, under which the compiler may regroup
// x * (127 / absmax) as x * 127 / absmax, or v * (sx * sw) as (v * sx) * sw: each rounds
// differently. These two products' factors come from calls it cannot see into, so each is
// the one multiplication written, on every path and in the reference (tests/unit).
__attribute__((noinline)) float reciprocal_step(float absmax) { return 127.f / absmax; }

// scale[j] = sx * sw[j] for one row against 32 outputs.
__attribute__((noinline)) void output_scales(float sx, const float* sw, float* scale) {
  for (int64_t j = 0; j < kBlockN; ++j) scale[j] = sx * sw[j];
}

inline float widen(float v) { return v; }
inline float widen(uint16_t bf16) { return bf16_to_float(bf16); }

#if defined(TANDEM_INT8_VNNI)
inline __m512 load_x16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load_x16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// quantize_row's arithmetic, 16 lanes at a time: the same IEEE operations (max, one product,
// round to nearest even), so the same bytes.
template <typename InT>
float quantize_row_x16(const InT* x, int64_t K, uint8_t* q) {
  const __m512 big = _mm512_set1_ps(3.4e38f);
  __m512 mx = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = tandem::first_lanes(K - k);
    const __m512 a = _mm512_abs_ps(load_x16(x + k, lanes));
    finite &= _mm512_cmp_ps_mask(a, big, _CMP_LE_OQ) | static_cast<__mmask16>(~lanes);
    mx = _mm512_max_ps(mx, a);
  }
  const float absmax = _mm512_reduce_max_ps(mx);
  if (finite != 0xFFFF || absmax == 0.f) {
    std::memset(q, 128, K);
    return finite != 0xFFFF ? NAN : 0.f;
  }
  const __m512 inv = _mm512_set1_ps(reciprocal_step(absmax));
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = tandem::first_lanes(K - k);
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load_x16(x + k, lanes), inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm512_mask_cvtepi32_storeu_epi8(q + k, lanes, _mm512_add_epi32(_mm512_cvtps_epi32(r), offset));
  }
  return absmax / 127.f;
}
#endif

// One row quantized: q = rint(x * (127 / absmax)) + 128 as bytes; returns absmax / 127 (the
// row's scale; 0 for an all-zero row, whose bytes are then all 128). portable: in plain C++.
template <typename InT>
float quantize_row(const InT* x, int64_t K, uint8_t* q, bool portable) {
#if defined(TANDEM_INT8_VNNI)
  if (!portable) return quantize_row_x16(x, K, q);
#endif
  float absmax = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(widen(x[k]));
    finite = finite && a <= 3.4e38f;  // false for inf and NaN
    absmax = std::max(absmax, a);
  }
  if (!finite || absmax == 0.f) {
    // A non-finite input has no int8 form: the row's outputs are NaN. A zero row's are zero.
    std::memset(q, 128, K);
    return finite ? 0.f : NAN;
  }
  const float inv = reciprocal_step(absmax);
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::nearbyint(widen(x[k]) * inv);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(r, -127.f, 127.f)) + 128);
  }
  return absmax / 127.f;
}

template <typename OutT>
inline void store(OutT* out, int64_t n, float v) {
  if constexpr (std::is_same_v<OutT, float>) out[n] = v;
  else out[n] = to_bf16(v);
}

// Rows [m, m + mb) against one packed block of 32 outputs, in plain C++.
template <typename OutT>
void block_portable(int mb, const uint8_t* xq, int64_t K, const float* sx, const int8_t* w,
                    const float* sw, const int32_t* comp, OutT* out, int64_t out_stride) {
  const int64_t kq_n = K / 4;
  for (int m = 0; m < mb; ++m) {
    int32_t acc[kBlockN] = {};
    const uint8_t* row = xq + m * K;
    for (int64_t kq = 0; kq < kq_n; ++kq) {
      const int8_t* wk = w + kq * kBlockN * 4;
      for (int64_t j = 0; j < kBlockN; ++j)
        for (int64_t t = 0; t < 4; ++t)
          acc[j] += static_cast<int32_t>(row[4 * kq + t]) * static_cast<int32_t>(wk[j * 4 + t]);
    }
    float scale[kBlockN];
    output_scales(sx[m], sw, scale);
    for (int64_t j = 0; j < kBlockN; ++j)
      store(out + m * out_stride, j, static_cast<float>(acc[j] - comp[j]) * scale[j]);
  }
}

#if defined(TANDEM_INT8_VNNI)
// 16 fp32 lanes to bf16 bits, rounded to nearest even (AVX512F/BW only: CPUs with VNNI but
// not AVX512-BF16 exist). NaN lanes never occur here with a finite scale.
inline __m256i to_bf16_x16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// MB rows against one packed block of 32 outputs: 2 * MB int32 accumulators in registers.
// (Two blocks at a time, to spend a row's broadcast on four vpdpbusd, measured slower here:
// 6-row tiles and the registers the compiler then spills.)
template <int MB, typename OutT>
inline void tile(const uint8_t* xq, int64_t K, const float* sx, const int8_t* w, const float* sw,
                 const int32_t* comp, OutT* out, int64_t out_stride) {
  __m512i acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  const int64_t kq_n = K / 4;
  for (int64_t kq = 0; kq < kq_n; ++kq) {
    const __m512i w0 = _mm512_loadu_si512(w + kq * kBlockN * 4);
    const __m512i w1 = _mm512_loadu_si512(w + kq * kBlockN * 4 + 64);
    for (int m = 0; m < MB; ++m) {
      int32_t four;
      std::memcpy(&four, xq + m * K + 4 * kq, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], a, w1);
    }
  }
  float scale[MB][kBlockN];
  for (int m = 0; m < MB; ++m) output_scales(sx[m], sw, scale[m]);
  for (int h = 0; h < 2; ++h) {
    const __m512i c = _mm512_loadu_si512(comp + 16 * h);
    for (int m = 0; m < MB; ++m) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][h], c));
      const __m512 y = _mm512_mul_ps(v, _mm512_loadu_ps(scale[m] + 16 * h));
      OutT* o = out + m * out_stride + 16 * h;
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_storeu_ps(o, y);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16_x16(y));
    }
  }
}

template <typename OutT>
void block_vnni(int mb, const uint8_t* xq, int64_t K, const float* sx, const int8_t* w,
                const float* sw, const int32_t* comp, OutT* o, int64_t os) {
  switch (mb) {
    case 1: return tile<1>(xq, K, sx, w, sw, comp, o, os);
    case 2: return tile<2>(xq, K, sx, w, sw, comp, o, os);
    case 3: return tile<3>(xq, K, sx, w, sw, comp, o, os);
    case 4: return tile<4>(xq, K, sx, w, sw, comp, o, os);
    case 5: return tile<5>(xq, K, sx, w, sw, comp, o, os);
    case 6: return tile<6>(xq, K, sx, w, sw, comp, o, os);
    case 7: return tile<7>(xq, K, sx, w, sw, comp, o, os);
    default: return tile<8>(xq, K, sx, w, sw, comp, o, os);
  }
}
#endif

template <typename InT, typename OutT>
void linear(const InT* x, int64_t xs, int64_t M, int64_t K, const int8_t* w, const float* sw,
            const int32_t* comp, int64_t NB, bool portable, OutT* out) {
  const int64_t N = NB * kBlockN;
  std::vector<uint8_t> xq(M * K);
  std::vector<float> sx(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) sx[m] = quantize_row(x + m * xs, K, xq.data() + m * K, portable);
  });
#if defined(TANDEM_INT8_VNNI)
  const bool vnni = !portable;
#endif
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int64_t m1 = std::min(M, m0 + kTileM);
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb) {
        const int8_t* wb = w + nb * K * kBlockN;
        const int64_t n0 = nb * kBlockN;
        for (int64_t m = m0; m < m1; m += 8) {
          const int mb = static_cast<int>(std::min<int64_t>(8, m1 - m));
          OutT* o = out + m * N + n0;
#if defined(TANDEM_INT8_VNNI)
          if (vnni) {
            block_vnni(mb, xq.data() + m * K, K, sx.data() + m, wb, sw + n0, comp + n0, o, N);
            continue;
          }
#endif
          block_portable(mb, xq.data() + m * K, K, sx.data() + m, wb, sw + n0, comp + n0, o, N);
        }
      }
    });
  }
}
}  // namespace int8_linear

// Whether this build has the AVX512-VNNI path (else linear_int8 runs the portable one).
bool linear_int8_vnni_supported() {
#if defined(TANDEM_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

// q: [N, K] int8, N a multiple of 32, K of 4. Returns the packed [N/32, K/4, 32, 4].
torch::Tensor pack_linear_int8(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar, "weight must be a 2-d int8 tensor");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % int8_linear::kBlockN == 0 && K % 4 == 0, "weight [", N, ", ", K,
              "]: outputs must be a multiple of 32 and inputs of 4");
  const auto src_t = q.contiguous();
  auto packed = torch::empty({N / int8_linear::kBlockN, K / 4, int8_linear::kBlockN, 4}, q.options());
  const auto* src = src_t.data_ptr<int8_t>();
  auto* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, N / int8_linear::kBlockN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kq = 0; kq < K / 4; ++kq)
        for (int64_t j = 0; j < int8_linear::kBlockN; ++j)
          std::memcpy(dst + ((nb * (K / 4) + kq) * int8_linear::kBlockN + j) * 4,
                      src + (nb * int8_linear::kBlockN + j) * K + 4 * kq, 4);
  });
  return packed;
}

// x: [M, K] bf16 or fp32, unit column stride; packed: from pack_linear_int8; scales: [N] fp32,
// each output's weight scale; comp: [N] int32, 128 * each output's weight sum. Returns [M, N]
// in x's dtype, or fp32 with float_out. portable: the plain C++ path even where VNNI is built.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor comp, bool float_out, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], rows contiguous");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "x must be bf16 or fp32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kChar &&
                  packed.size(1) * 4 == x.size(1) && packed.is_contiguous(),
              "packed weight does not match x's ", x.size(1), " inputs");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * int8_linear::kBlockN;
  TORCH_CHECK(scales.numel() == N && scales.scalar_type() == torch::kFloat &&
                  scales.is_contiguous() && comp.numel() == N &&
                  comp.scalar_type() == torch::kInt && comp.is_contiguous(),
              "scales and comp must be contiguous [", N, "] fp32 and int32");
  const bool fp32_out = float_out || !bf16;
  auto out = torch::empty({M, N}, x.options().dtype(fp32_out ? torch::kFloat : torch::kBFloat16));
  const auto* w = packed.data_ptr<int8_t>();
  const auto* sw = scales.data_ptr<float>();
  const auto* c = comp.data_ptr<int32_t>();
  if (bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (fp32_out)
      int8_linear::linear(xp, x.stride(0), M, K, w, sw, c, NB, portable, out.data_ptr<float>());
    else
      int8_linear::linear(xp, x.stride(0), M, K, w, sw, c, NB, portable,
             reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    int8_linear::linear(x.data_ptr<float>(), x.stride(0), M, K, w, sw, c, NB, portable,
           out.data_ptr<float>());
  }
  return out;
}
