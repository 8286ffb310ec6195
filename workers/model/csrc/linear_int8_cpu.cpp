// int8 linear layers for CPUs: y = x W^T with W in int8 per output channel and x quantized to
// int8 as it arrives, in groups of 32 or 64 inputs of a row with a scale each (W8A8).
//
// A decode step reads every weight once; at int8 that is half the bytes of bf16. The weight is
// packed once, at load, so that one 64-byte load holds four consecutive inputs of 16 outputs
// ([N/32][K/4][32][4]); AVX512-VNNI's `vpdpbusd` multiplies them by a broadcast four of an
// input row's int8 values and adds the four products into 16 int32 sums. vpdpbusd takes its
// first operand unsigned, so the weight is stored as q + 128, and each group's sum has 128
// times the group's input sum taken off before it is scaled.
//
// Why groups: one scale for a whole row of activations cost SmolLM2 3.7% perplexity (the
// MLP's activations have outlier channels); a scale per 64 inputs costs 0.5%, and int8
// weights alone 0.3% (6,000 tokens; docs/benchmarks.md).
//
// Each group's int32 sum is exact; groups are combined in fp32 with one fused multiply-add
// each, in order, and the weight's scale multiplies last. The portable path (every other CPU,
// or forced with `portable`) does the same operations in plain C++, so its results are
// bit-identical to the VNNI path's. A row's result depends on that row alone, whatever the
// batch or the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
constexpr int kTileRows = 6;     // rows a VNNI tile holds: 24 accumulators and 3 operands

// bf16 as raw bits both ways, through torch's own conversion (rounded to nearest even, a NaN
// to 0x7FC0), so results match a torch cast.
inline uint16_t to_bf16(float f) { return c10::BFloat16(f).x; }

inline float widen(float v) { return v; }
inline float widen(uint16_t bf16) {
  return static_cast<float>(c10::BFloat16(bf16, c10::BFloat16::from_bits()));
}

// The kernels are built with -fassociative-math, under which the compiler may regroup
// x * (127 / absmax) as x * 127 / absmax, which rounds differently. The factor comes from a
// call it cannot see into, so the product is the one multiplication written, on every path
// and in the reference (tests/unit/test_int8_linear.py).
__attribute__((noinline)) float reciprocal_step(float absmax) { return 127.f / absmax; }

constexpr float kMaxFloat = std::numeric_limits<float>::max();
// A group whose largest magnitude is below this has no finite step (127 / absmax overflows):
// it is quantized as a zero group, on every path.
constexpr float kTinyGroup = 127.f / kMaxFloat;

// One activation row, quantized group by group. For group g: q = rint(x * (127 / absmax)),
// scale[g] = absmax / 127 (0 for an all-zero group, or one too small for a finite step; NaN
// for one with a non-finite value, whose row then comes out NaN), corr[g] = 128 * sum(q), the
// offset of the unsigned weights.
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> corr;
  int64_t K, groups;
  Rows(int64_t M, int64_t K, int64_t group)
      : q(M * K), scale(M * (K / group)), corr(M * (K / group)), K(K), groups(K / group) {}
};

template <typename InT>
void quantize_group(const InT* x, int64_t G, int8_t* q, float* scale, int32_t* corr) {
  float absmax = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < G; ++k) {
    const float a = std::fabs(widen(x[k]));
    finite = finite && a <= kMaxFloat;  // false for inf and NaN
    absmax = std::max(absmax, a);
  }
  if (!finite || absmax < kTinyGroup) {
    std::memset(q, 0, G);
    *scale = finite ? 0.f : NAN;
    *corr = 0;
    return;
  }
  const float inv = reciprocal_step(absmax);
  int32_t sum = 0;
  for (int64_t k = 0; k < G; ++k) {
    const float r = std::clamp(std::nearbyint(widen(x[k]) * inv), -127.f, 127.f);
    q[k] = static_cast<int8_t>(r);
    sum += q[k];
  }
  *scale = absmax / 127.f;
  *corr = 128 * sum;
}

#if defined(TANDEM_INT8_VNNI)
inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_x16(const uint16_t* p) { return tandem::load_bf16_x16(p); }

// quantize_group's arithmetic 16 lanes at a time (G a multiple of 16, at most 64): the same
// IEEE operations (max, one product, round to nearest even), so the same values.
template <typename InT>
void quantize_group_x16(const InT* x, int64_t G, int8_t* q, float* scale, int32_t* corr) {
  __m512 v[4];
  const int n = static_cast<int>(G / 16);
  __m512 mx = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int i = 0; i < n; ++i) {
    v[i] = load_x16(x + 16 * i);
    const __m512 a = _mm512_abs_ps(v[i]);
    finite &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(kMaxFloat), _CMP_LE_OQ);
    mx = _mm512_max_ps(mx, a);
  }
  const float absmax = _mm512_reduce_max_ps(mx);
  if (finite != 0xFFFF || absmax < kTinyGroup) {
    std::memset(q, 0, G);
    *scale = finite != 0xFFFF ? NAN : 0.f;
    *corr = 0;
    return;
  }
  const __m512 inv = _mm512_set1_ps(reciprocal_step(absmax));
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < n; ++i) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[i], inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    const __m512i qi = _mm512_cvtps_epi32(r);
    sum = _mm512_add_epi32(sum, qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtepi32_epi8(qi));
  }
  *scale = absmax / 127.f;
  *corr = 128 * _mm512_reduce_add_epi32(sum);
}
#endif

template <typename InT>
void quantize_row(const InT* x, Rows& r, int64_t m, int64_t G, bool portable) {
  for (int64_t g = 0; g < r.groups; ++g) {
    const int64_t i = m * r.groups + g;
    int8_t* q = r.q.data() + m * r.K + g * G;
#if defined(TANDEM_INT8_VNNI)
    if (!portable) {
      quantize_group_x16(x + g * G, G, q, &r.scale[i], &r.corr[i]);
      continue;
    }
#endif
    quantize_group(x + g * G, G, q, &r.scale[i], &r.corr[i]);
  }
}

template <typename OutT>
inline void store(OutT* out, int64_t n, float v) {
  if constexpr (std::is_same_v<OutT, float>) out[n] = v;
  else out[n] = to_bf16(v);
}

// Rows [m, m + mb) against one packed block of 32 outputs, in plain C++.
template <typename OutT>
void block_portable(int mb, const Rows& r, int64_t m0, int64_t G, const uint8_t* w,
                    const float* sw, OutT* out, int64_t out_stride) {
  const int64_t K = r.K, kq_per_group = G / 4;
  for (int m = 0; m < mb; ++m) {
    const int64_t row = m0 + m;
    const int8_t* xq = r.q.data() + row * K;
    float acc[kBlockN] = {};
    for (int64_t g = 0; g < r.groups; ++g) {
      int32_t sum[kBlockN] = {};
      for (int64_t kq = g * kq_per_group; kq < (g + 1) * kq_per_group; ++kq) {
        const uint8_t* wk = w + kq * kBlockN * 4;
        for (int64_t j = 0; j < kBlockN; ++j)
          for (int64_t t = 0; t < 4; ++t)
            sum[j] += static_cast<int32_t>(wk[j * 4 + t]) * static_cast<int32_t>(xq[4 * kq + t]);
      }
      const float s = r.scale[row * r.groups + g];
      const int32_t c = r.corr[row * r.groups + g];
      for (int64_t j = 0; j < kBlockN; ++j)
        acc[j] = std::fma(static_cast<float>(sum[j] - c), s, acc[j]);
    }
    for (int64_t j = 0; j < kBlockN; ++j) store(out + m * out_stride, j, acc[j] * sw[j]);
  }
}

#if defined(TANDEM_INT8_VNNI)
// 16 fp32 lanes to bf16 bits as to_bf16 gives them (AVX512F/BW only: CPUs with VNNI but not
// AVX512-BF16 exist).
inline __m256i to_bf16_x16(__m512 v) {
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// MB rows against one packed block of 32 outputs: per group, 2 * MB int32 sums in registers,
// folded into 2 * MB fp32 accumulators at the group's end.
template <int MB, typename OutT>
inline void tile(const Rows& r, int64_t m0, int64_t G, const uint8_t* w, const float* sw,
                 OutT* out, int64_t out_stride) {
  const int64_t K = r.K, kq_per_group = G / 4;
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < r.groups; ++g) {
    __m512i sum[MB][2];
    for (int m = 0; m < MB; ++m) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    for (int64_t kq = g * kq_per_group; kq < (g + 1) * kq_per_group; ++kq) {
      const __m512i w0 = _mm512_loadu_si512(w + kq * kBlockN * 4);
      const __m512i w1 = _mm512_loadu_si512(w + kq * kBlockN * 4 + 64);
      for (int m = 0; m < MB; ++m) {
        int32_t four;
        std::memcpy(&four, r.q.data() + (m0 + m) * K + 4 * kq, sizeof four);
        const __m512i a = _mm512_set1_epi32(four);
        sum[m][0] = _mm512_dpbusd_epi32(sum[m][0], w0, a);
        sum[m][1] = _mm512_dpbusd_epi32(sum[m][1], w1, a);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const int64_t i = (m0 + m) * r.groups + g;
      const __m512i c = _mm512_set1_epi32(r.corr[i]);
      const __m512 s = _mm512_set1_ps(r.scale[i]);
      for (int h = 0; h < 2; ++h)
        acc[m][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m][h], c)), s,
                                    acc[m][h]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m512 s = _mm512_loadu_ps(sw + 16 * h);
    for (int m = 0; m < MB; ++m) {
      const __m512 y = _mm512_mul_ps(acc[m][h], s);
      OutT* o = out + m * out_stride + 16 * h;
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_storeu_ps(o, y);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16_x16(y));
    }
  }
}

template <typename OutT>
void block_vnni(int mb, const Rows& r, int64_t m0, int64_t G, const uint8_t* w, const float* sw,
                OutT* o, int64_t os) {
  switch (mb) {
    case 1: return tile<1>(r, m0, G, w, sw, o, os);
    case 2: return tile<2>(r, m0, G, w, sw, o, os);
    case 3: return tile<3>(r, m0, G, w, sw, o, os);
    case 4: return tile<4>(r, m0, G, w, sw, o, os);
    case 5: return tile<5>(r, m0, G, w, sw, o, os);
    default: return tile<6>(r, m0, G, w, sw, o, os);
  }
}
#endif

template <typename InT, typename OutT>
void linear(const InT* x, int64_t xs, int64_t M, int64_t K, int64_t G, const uint8_t* w,
            const float* sw, int64_t NB, bool portable, OutT* out) {
  const int64_t N = NB * kBlockN;
  Rows r(M, K, G);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * xs, r, m, G, portable);
  });
#if defined(TANDEM_INT8_VNNI)
  const bool vnni = !portable;
#endif
  for (int64_t t0 = 0; t0 < M; t0 += kTileM) {
    const int64_t t1 = std::min(M, t0 + kTileM);
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb) {
        const uint8_t* wb = w + nb * K * kBlockN;
        const float* s = sw + nb * kBlockN;
#if defined(TANDEM_INT8_VNNI)
        if (vnni) {
          for (int64_t m = t0; m < t1; m += kTileRows)
            block_vnni(static_cast<int>(std::min<int64_t>(kTileRows, t1 - m)), r, m, G, wb, s,
                       out + m * N + nb * kBlockN, N);
          continue;
        }
#endif
        for (int64_t m = t0; m < t1; m += 8)
          block_portable(static_cast<int>(std::min<int64_t>(8, t1 - m)), r, m, G, wb, s,
                         out + m * N + nb * kBlockN, N);
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

// q: [N, K] int8, N a multiple of 32, K of 32. Returns the packed [N/32, K/4, 32, 4] uint8,
// each value q + 128.
torch::Tensor pack_linear_int8(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar, "weight must be a 2-d int8 tensor");
  const int64_t N = q.size(0), K = q.size(1), B = int8_linear::kBlockN;
  TORCH_CHECK(N % B == 0 && K % 32 == 0, "weight [", N, ", ", K,
              "]: outputs and inputs must be multiples of 32");
  const auto src_t = q.contiguous();
  auto packed = torch::empty({N / B, K / 4, B, 4}, q.options().dtype(torch::kByte));
  const auto* src = src_t.data_ptr<int8_t>();
  auto* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kq = 0; kq < K / 4; ++kq)
        for (int64_t j = 0; j < B; ++j)
          for (int64_t t = 0; t < 4; ++t)
            dst[((nb * (K / 4) + kq) * B + j) * 4 + t] =
                static_cast<uint8_t>(src[(nb * B + j) * K + 4 * kq + t] + 128);
  });
  return packed;
}

// x: [M, K] bf16 or fp32, unit column stride; packed: from pack_linear_int8; scales: [N] fp32,
// each output's weight scale; group: inputs per activation scale, 32 or 64, dividing K.
// Returns [M, N] in x's dtype, or fp32 with float_out. portable: the plain C++ path even where
// VNNI is built.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          int64_t group, bool float_out, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], rows contiguous");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "x must be bf16 or fp32");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu(),
              "linear_int8 takes CPU tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kByte &&
                  packed.size(1) * 4 == x.size(1) && packed.size(2) == int8_linear::kBlockN &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "packed weight does not match x's ", x.size(1), " inputs");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  const int64_t N = NB * int8_linear::kBlockN;
  TORCH_CHECK((group == 32 || group == 64) && K % group == 0, "group ", group,
              ": must be 32 or 64 and divide the ", K, " inputs");
  TORCH_CHECK(scales.numel() == N && scales.scalar_type() == torch::kFloat &&
                  scales.is_contiguous(),
              "scales must be contiguous [", N, "] fp32");
  const bool fp32_out = float_out || !bf16;
  auto out = torch::empty({M, N}, x.options().dtype(fp32_out ? torch::kFloat : torch::kBFloat16));
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sw = scales.data_ptr<float>();
  if (bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (fp32_out)
      int8_linear::linear(xp, x.stride(0), M, K, group, w, sw, NB, portable,
                          out.data_ptr<float>());
    else
      int8_linear::linear(xp, x.stride(0), M, K, group, w, sw, NB, portable,
                          reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    int8_linear::linear(x.data_ptr<float>(), x.stride(0), M, K, group, w, sw, NB, portable,
                        out.data_ptr<float>());
  }
  return out;
}
