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
//
// GGUF's block formats are served as stored by the same loops (`linear_blocks`), with a weight
// scale per 32 inputs instead of one per output: Q8_0 (w = d * q) in the layout above, and the
// 4-bit Q4_0/Q4_1 (w = d * (q - 8) or d * q + m, q in 0..15) two to a byte, [N/32][K/8][32][4]
// with byte t of an output's four holding inputs 8k + t (low nibble) and 8k + 4 + t (high
// nibble): a quarter of bf16's bytes. Activations then take a scale per 32 inputs, as
// llama.cpp's do, and each group folds in as acc += s_x * (d * (sum - 128 sum(x_q))) for Q8_0
// (its values stored unsigned, as int8's), acc += s_x * (d * (sum - 8 sum(x_q))) for Q4_0
// (w = d (q - 8)), and acc += s_x * (d * sum + m * sum(x_q)) for Q4_1.
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
// for one with a non-finite value, whose row then comes out NaN), xsum[g] = sum(q) (128 times
// it is the offset of the unsigned int8 weights; the 4-bit formats' minimum multiplies it).
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> xsum;
  int64_t K, groups;
  Rows(int64_t M, int64_t K, int64_t group)
      : q(M * K), scale(M * (K / group)), xsum(M * (K / group)), K(K), groups(K / group) {}
};

// How a weight is stored: int8 with one scale per output (quantization: int8), or a GGUF block
// format with a scale (and for Q4_1 a minimum) per output and 32 inputs: Q8_0, Q4_1 (kQ4),
// Q4_0 (kQ4Sym).
enum class Fmt { kChannel, kQ8, kQ4, kQ4Sym };

constexpr bool four_bit(Fmt f) { return f == Fmt::kQ4 || f == Fmt::kQ4Sym; }

// The integer offset each group's sum carries: q + 128 for the unsigned int8 layouts, q - 8
// for Q4_0's values, none for Q4_1's (its minimum does that work).
constexpr int32_t offset(Fmt f) { return f == Fmt::kQ4Sym ? 8 : f == Fmt::kQ4 ? 0 : 128; }

// One packed block of 32 outputs' scales: `channel` [32] fp32 (kChannel), or `d` and `m`, fp16
// bits [K/32][32] (kQ8 uses d alone).
struct Scales {
  const float* channel;
  const uint16_t* d;
  const uint16_t* m;
};

inline float half_bits(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

template <typename InT>
void quantize_group(const InT* x, int64_t G, int8_t* q, float* scale, int32_t* xsum) {
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
    *xsum = 0;
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
  *xsum = sum;
}

#if defined(TANDEM_INT8_VNNI)
inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_x16(const uint16_t* p) { return tandem::load_bf16_x16(p); }

// quantize_group's arithmetic 16 lanes at a time (G a multiple of 16, at most 64): the same
// IEEE operations (max, one product, round to nearest even), so the same values.
template <typename InT>
void quantize_group_x16(const InT* x, int64_t G, int8_t* q, float* scale, int32_t* xsum) {
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
    *xsum = 0;
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
  *xsum = _mm512_reduce_add_epi32(sum);
}
#endif

template <typename InT>
void quantize_row(const InT* x, Rows& r, int64_t m, int64_t G, bool portable) {
  for (int64_t g = 0; g < r.groups; ++g) {
    const int64_t i = m * r.groups + g;
    int8_t* q = r.q.data() + m * r.K + g * G;
#if defined(TANDEM_INT8_VNNI)
    if (!portable) {
      quantize_group_x16(x + g * G, G, q, &r.scale[i], &r.xsum[i]);
      continue;
    }
#endif
    quantize_group(x + g * G, G, q, &r.scale[i], &r.xsum[i]);
  }
}

template <typename OutT>
inline void store(OutT* out, int64_t n, float v) {
  if constexpr (std::is_same_v<OutT, float>) out[n] = v;
  else out[n] = to_bf16(v);
}

// Weight bytes per packed block of 32 outputs over K inputs.
template <Fmt F>
constexpr int64_t block_bytes(int64_t K) {
  return four_bit(F) ? K * kBlockN / 2 : K * kBlockN;
}

// Rows [m, m + mb) against one packed block of 32 outputs, in plain C++.
template <Fmt F, typename OutT>
void block_portable(int mb, const Rows& r, int64_t m0, int64_t G, const uint8_t* w,
                    const Scales& sw, OutT* out, int64_t out_stride) {
  const int64_t K = r.K;
  for (int m = 0; m < mb; ++m) {
    const int64_t row = m0 + m;
    const int8_t* xq = r.q.data() + row * K;
    float acc[kBlockN] = {};
    for (int64_t g = 0; g < r.groups; ++g) {
      int32_t sum[kBlockN] = {};
      if constexpr (four_bit(F)) {
        for (int64_t ko = g * G / 8; ko < (g + 1) * G / 8; ++ko) {
          const uint8_t* wk = w + ko * kBlockN * 4;
          for (int64_t j = 0; j < kBlockN; ++j)
            for (int64_t t = 0; t < 4; ++t) {
              const int32_t b = wk[j * 4 + t];
              sum[j] += (b & 15) * static_cast<int32_t>(xq[8 * ko + t]) +
                        (b >> 4) * static_cast<int32_t>(xq[8 * ko + 4 + t]);
            }
        }
      } else {
        for (int64_t kq = g * G / 4; kq < (g + 1) * G / 4; ++kq) {
          const uint8_t* wk = w + kq * kBlockN * 4;
          for (int64_t j = 0; j < kBlockN; ++j)
            for (int64_t t = 0; t < 4; ++t)
              sum[j] += static_cast<int32_t>(wk[j * 4 + t]) * static_cast<int32_t>(xq[4 * kq + t]);
        }
      }
      const float s = r.scale[row * r.groups + g];
      const int32_t xs = r.xsum[row * r.groups + g];
      for (int64_t j = 0; j < kBlockN; ++j) {
        if constexpr (F == Fmt::kChannel) {
          acc[j] = std::fma(static_cast<float>(sum[j] - 128 * xs), s, acc[j]);
        } else if constexpr (F == Fmt::kQ8 || F == Fmt::kQ4Sym) {
          const float t =
              static_cast<float>(sum[j] - offset(F) * xs) * half_bits(sw.d[g * kBlockN + j]);
          acc[j] = std::fma(t, s, acc[j]);
        } else {
          const float t = std::fma(static_cast<float>(sum[j]), half_bits(sw.d[g * kBlockN + j]),
                                   half_bits(sw.m[g * kBlockN + j]) * static_cast<float>(xs));
          acc[j] = std::fma(t, s, acc[j]);
        }
      }
    }
    for (int64_t j = 0; j < kBlockN; ++j)
      store(out + m * out_stride, j, F == Fmt::kChannel ? acc[j] * sw.channel[j] : acc[j]);
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

inline __m512 load_half_x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm512_set1_epi32(four);
}

// MB rows against one packed block of 32 outputs: per group, 2 * MB int32 sums in registers,
// folded into 2 * MB fp32 accumulators at the group's end.
template <int MB, Fmt F, typename OutT>
inline void tile(const Rows& r, int64_t m0, int64_t G, const uint8_t* w, const Scales& sw,
                 OutT* out, int64_t out_stride) {
  const int64_t K = r.K;
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < r.groups; ++g) {
    __m512i sum[MB][2];
    for (int m = 0; m < MB; ++m) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    if constexpr (four_bit(F)) {
      const __m512i low = _mm512_set1_epi8(15);
      for (int64_t ko = g * G / 8; ko < (g + 1) * G / 8; ++ko) {
        const __m512i v0 = _mm512_loadu_si512(w + ko * kBlockN * 4);
        const __m512i v1 = _mm512_loadu_si512(w + ko * kBlockN * 4 + 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), lo1 = _mm512_and_si512(v1, low);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xq = r.q.data() + (m0 + m) * K + 8 * ko;
          const __m512i a = broadcast4(xq), b = broadcast4(xq + 4);
          sum[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[m][0], lo0, a), hi0, b);
          sum[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[m][1], lo1, a), hi1, b);
        }
      }
    } else {
      for (int64_t kq = g * G / 4; kq < (g + 1) * G / 4; ++kq) {
        const __m512i w0 = _mm512_loadu_si512(w + kq * kBlockN * 4);
        const __m512i w1 = _mm512_loadu_si512(w + kq * kBlockN * 4 + 64);
        for (int m = 0; m < MB; ++m) {
          const __m512i a = broadcast4(r.q.data() + (m0 + m) * K + 4 * kq);
          sum[m][0] = _mm512_dpbusd_epi32(sum[m][0], w0, a);
          sum[m][1] = _mm512_dpbusd_epi32(sum[m][1], w1, a);
        }
      }
    }
    __m512 d[2], mn[2];
    if constexpr (F != Fmt::kChannel)
      for (int h = 0; h < 2; ++h) d[h] = load_half_x16(sw.d + g * kBlockN + 16 * h);
    if constexpr (F == Fmt::kQ4)
      for (int h = 0; h < 2; ++h) mn[h] = load_half_x16(sw.m + g * kBlockN + 16 * h);
    for (int m = 0; m < MB; ++m) {
      const int64_t i = (m0 + m) * r.groups + g;
      const __m512 s = _mm512_set1_ps(r.scale[i]);
      for (int h = 0; h < 2; ++h) {
        __m512 t;
        if constexpr (F == Fmt::kQ4) {
          const __m512 xs = _mm512_set1_ps(static_cast<float>(r.xsum[i]));
          t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][h]), d[h], _mm512_mul_ps(mn[h], xs));
        } else {
          const __m512i c = _mm512_set1_epi32(offset(F) * r.xsum[i]);
          t = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m][h], c));
          if constexpr (F != Fmt::kChannel) t = _mm512_mul_ps(t, d[h]);
        }
        acc[m][h] = _mm512_fmadd_ps(t, s, acc[m][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < MB; ++m) {
      __m512 y = acc[m][h];
      if constexpr (F == Fmt::kChannel) y = _mm512_mul_ps(y, _mm512_loadu_ps(sw.channel + 16 * h));
      OutT* o = out + m * out_stride + 16 * h;
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_storeu_ps(o, y);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16_x16(y));
    }
  }
}

template <Fmt F, typename OutT>
void block_vnni(int mb, const Rows& r, int64_t m0, int64_t G, const uint8_t* w, const Scales& sw,
                OutT* o, int64_t os) {
  switch (mb) {
    case 1: return tile<1, F>(r, m0, G, w, sw, o, os);
    case 2: return tile<2, F>(r, m0, G, w, sw, o, os);
    case 3: return tile<3, F>(r, m0, G, w, sw, o, os);
    case 4: return tile<4, F>(r, m0, G, w, sw, o, os);
    case 5: return tile<5, F>(r, m0, G, w, sw, o, os);
    default: return tile<6, F>(r, m0, G, w, sw, o, os);
  }
}
#endif

// The weight's scales for packed block nb.
template <Fmt F>
Scales block_scales(const Scales& all, int64_t nb, int64_t K) {
  if constexpr (F == Fmt::kChannel) return {all.channel + nb * kBlockN, nullptr, nullptr};
  const int64_t off = nb * (K / 32) * kBlockN;
  return {nullptr, all.d + off, all.m == nullptr ? nullptr : all.m + off};
}

template <Fmt F, typename InT, typename OutT>
void linear(const InT* x, int64_t xs, int64_t M, int64_t K, int64_t G, const uint8_t* w,
            const Scales& sw, int64_t NB, bool portable, OutT* out) {
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
        const uint8_t* wb = w + nb * block_bytes<F>(K);
        const Scales s = block_scales<F>(sw, nb, K);
#if defined(TANDEM_INT8_VNNI)
        if (vnni) {
          for (int64_t m = t0; m < t1; m += kTileRows)
            block_vnni<F>(static_cast<int>(std::min<int64_t>(kTileRows, t1 - m)), r, m, G, wb, s,
                          out + m * N + nb * kBlockN, N);
          continue;
        }
#endif
        for (int64_t m = t0; m < t1; m += 8)
          block_portable<F>(static_cast<int>(std::min<int64_t>(8, t1 - m)), r, m, G, wb, s,
                            out + m * N + nb * kBlockN, N);
      }
    });
  }
}

// Dispatches on x's dtype and the output's: [M, N] in x's dtype, or fp32 with float_out.
template <Fmt F>
torch::Tensor run(torch::Tensor x, const uint8_t* w, const Scales& sw, int64_t NB, int64_t group,
                  bool float_out, bool portable) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), N = NB * kBlockN;
  const bool fp32_out = float_out || !bf16;
  auto out = torch::empty({M, N}, x.options().dtype(fp32_out ? torch::kFloat : torch::kBFloat16));
  if (bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (fp32_out)
      linear<F>(xp, x.stride(0), M, K, group, w, sw, NB, portable, out.data_ptr<float>());
    else
      linear<F>(xp, x.stride(0), M, K, group, w, sw, NB, portable,
                reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    linear<F>(x.data_ptr<float>(), x.stride(0), M, K, group, w, sw, NB, portable,
              out.data_ptr<float>());
  }
  return out;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], rows contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat,
              "x must be bf16 or fp32");
  TORCH_CHECK(x.device().is_cpu(), "the int8 kernels take CPU tensors");
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
  int8_linear::check_x(x);
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(),
              "linear_int8 takes CPU tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kByte &&
                  packed.size(1) * 4 == x.size(1) && packed.size(2) == int8_linear::kBlockN &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "packed weight does not match x's ", x.size(1), " inputs");
  const int64_t K = x.size(1), NB = packed.size(0);
  const int64_t N = NB * int8_linear::kBlockN;
  TORCH_CHECK((group == 32 || group == 64) && K % group == 0, "group ", group,
              ": must be 32 or 64 and divide the ", K, " inputs");
  TORCH_CHECK(scales.numel() == N && scales.scalar_type() == torch::kFloat &&
                  scales.is_contiguous(),
              "scales must be contiguous [", N, "] fp32");
  const int8_linear::Scales sw{scales.data_ptr<float>(), nullptr, nullptr};
  return int8_linear::run<int8_linear::Fmt::kChannel>(x, packed.data_ptr<uint8_t>(), sw, NB,
                                                       group, float_out, portable);
}

// q: [N, K] uint8 in 0..15, N and K multiples of 32. Returns the packed [N/32, K/8, 32, 4]
// uint8: byte t of output j's four at k holds input 8k + t (low nibble) and 8k + 4 + t (high).
torch::Tensor pack_linear_int4(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte, "weight must be a 2-d uint8 tensor");
  const int64_t N = q.size(0), K = q.size(1), B = int8_linear::kBlockN;
  TORCH_CHECK(N % B == 0 && K % 32 == 0, "weight [", N, ", ", K,
              "]: outputs and inputs must be multiples of 32");
  TORCH_CHECK(q.max().item<uint8_t>() < 16, "4-bit weight values must be in 0..15");
  const auto src_t = q.contiguous();
  auto packed = torch::empty({N / B, K / 8, B, 4}, q.options());
  const auto* src = src_t.data_ptr<uint8_t>();
  auto* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t ko = 0; ko < K / 8; ++ko)
        for (int64_t j = 0; j < B; ++j)
          for (int64_t t = 0; t < 4; ++t) {
            const uint8_t* row = src + (nb * B + j) * K + 8 * ko;
            dst[((nb * (K / 8) + ko) * B + j) * 4 + t] =
                static_cast<uint8_t>(row[t] | (row[4 + t] << 4));
          }
  });
  return packed;
}

// GGUF block formats, as stored. x as linear_int8's; packed: from pack_linear_int8 (Q8_0) or
// pack_linear_int4 (Q4_0/Q4_1, four_bit); d, m: fp16 [N/32, K/32, 32], each output's scale and
// (Q4_1 only) minimum per 32 inputs, m empty for Q8_0 and Q4_0. Activations take a scale per
// 32 inputs.
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor packed, torch::Tensor d,
                            torch::Tensor m, bool four_bit, bool float_out, bool portable) {
  int8_linear::check_x(x);
  const int64_t K = x.size(1), B = int8_linear::kBlockN;
  TORCH_CHECK(packed.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu(),
              "linear_blocks takes CPU tensors");
  TORCH_CHECK(K % 32 == 0, "x's ", K, " inputs are not whole blocks of 32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kByte &&
                  packed.size(1) * (four_bit ? 8 : 4) == K && packed.size(2) == B &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "packed weight does not match x's ", K, " inputs");
  const int64_t NB = packed.size(0);
  auto scales_ok = [&](const torch::Tensor& t) {
    return t.scalar_type() == torch::kHalf && t.is_contiguous() && t.dim() == 3 &&
           t.size(0) == NB && t.size(1) == K / 32 && t.size(2) == B;
  };
  TORCH_CHECK(scales_ok(d), "d must be contiguous [", NB, ", ", K / 32, ", 32] fp16");
  const bool minimum = m.numel() != 0;
  TORCH_CHECK(!minimum || (four_bit && scales_ok(m)),
              four_bit ? "m must be shaped as d, or empty (Q4_0)"
                       : "Q8_0 takes no minimum (m empty)");
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = minimum ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  const int8_linear::Scales sw{nullptr, dp, mp};
  const auto* w = packed.data_ptr<uint8_t>();
  using int8_linear::Fmt;
  if (four_bit && minimum) return int8_linear::run<Fmt::kQ4>(x, w, sw, NB, 32, float_out, portable);
  if (four_bit) return int8_linear::run<Fmt::kQ4Sym>(x, w, sw, NB, 32, float_out, portable);
  return int8_linear::run<Fmt::kQ8>(x, w, sw, NB, 32, float_out, portable);
}
