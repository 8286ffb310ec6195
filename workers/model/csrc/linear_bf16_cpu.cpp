// bf16 linear layers for CPUs with AVX512-BF16: y = x W^T, accumulated in fp32, rounded once.
//
// The weight is packed once, at load, so that one 64-byte load holds a pair of input columns
// for 16 outputs ([N/32][K/2][32][2]); `vdpbf16ps` then multiplies that by a broadcast pair of
// an input row's values and adds both products into 16 fp32 accumulators. A tile keeps 32
// outputs of up to 8 rows in registers while the weight streams through once. At the few rows
// of a decode step the layer is a read of its weight: this reaches 30-40 GB/s on one core
// where oneDNN's packed GEMM reaches 16 (measured on the 49152 x 576 lm_head), and it is on
// par at a prefill chunk's hundreds of rows.
//
// Each output row is computed alone, in the same order whatever the batch holds or the
// thread count: a sequence's logits do not depend on what it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kBlockN = 32;  // outputs per packed block
constexpr int64_t kTileM = 256;  // rows of x kept in cache while every weight block passes

#if defined(__AVX512BF16__)
// OutT: uint16_t (bf16 bits, rounded once) or float (the fp32 sums themselves).
template <int MB, typename OutT>
inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k_pairs,
                 OutT* out, int64_t out_stride) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * kBlockN);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * kBlockN + kBlockN);
    for (int m = 0; m < MB; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(
          tandem::bf16_pair(x + m * x_stride + 2 * kp));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (std::is_same_v<OutT, float>) {
      _mm512_storeu_ps(out + m * out_stride, acc[m][0]);
      _mm512_storeu_ps(out + m * out_stride + 16, acc[m][1]);
    } else {
      auto* o = reinterpret_cast<__m256i*>(out + m * out_stride);
      _mm256_storeu_si256(o, (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
      _mm256_storeu_si256(o + 1, (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
    }
  }
}

template <typename OutT>
void rows(int mb, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t kp, OutT* o,
          int64_t os) {
  switch (mb) {
    case 1: return tile<1>(x, xs, w, kp, o, os);
    case 2: return tile<2>(x, xs, w, kp, o, os);
    case 3: return tile<3>(x, xs, w, kp, o, os);
    case 4: return tile<4>(x, xs, w, kp, o, os);
    case 5: return tile<5>(x, xs, w, kp, o, os);
    case 6: return tile<6>(x, xs, w, kp, o, os);
    case 7: return tile<7>(x, xs, w, kp, o, os);
    default: return tile<8>(x, xs, w, kp, o, os);
  }
}

template <typename OutT>
void linear(const uint16_t* xp, int64_t xs, int64_t M, const uint16_t* w, int64_t NB,
            int64_t kp, OutT* o) {
  const int64_t N = NB * kBlockN;
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int64_t m1 = std::min(M, m0 + kTileM);
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t m = m0; m < m1; m += 8)
          rows(static_cast<int>(std::min<int64_t>(8, m1 - m)), xp + m * xs, xs,
               w + nb * kp * 2 * kBlockN, kp, o + m * N + nb * kBlockN, N);
    });
  }
}
#endif
}  // namespace

// Whether this build has the kernel (compiled for a CPU with AVX512-BF16).
bool linear_bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// weight: [N, K] bf16, N a multiple of 32, K even. Returns the packed [N/32, K/2, 32, 2].
torch::Tensor pack_linear_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "weight must be a 2-d bf16 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlockN == 0 && K % 2 == 0, "weight [", N, ", ", K,
              "]: outputs must be a multiple of 32 and inputs even");
  const auto w = weight.contiguous();
  auto packed = torch::empty({N / kBlockN, K / 2, kBlockN, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kp = 0; kp < K / 2; ++kp)
        for (int64_t j = 0; j < kBlockN; ++j)
          for (int64_t t = 0; t < 2; ++t)
            dst[((nb * (K / 2) + kp) * kBlockN + j) * 2 + t] =
                src[(nb * kBlockN + j) * K + 2 * kp + t];
  });
  return packed;
}

// x: [M, K] bf16 with unit column stride; packed: from pack_linear_bf16. Returns [M, N],
// bf16, or with float_out the fp32 sums unrounded (logits: no bf16 round trip, no cast).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, bool float_out) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.is_contiguous(),
              "packed weight does not match x's ", x.size(1), " inputs");
  const int64_t M = x.size(0), NB = packed.size(0), N = NB * kBlockN, kp = x.size(1) / 2;
  auto out = torch::empty({M, N}, x.options().dtype(float_out ? torch::kFloat : torch::kBFloat16));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (float_out)
    linear(xp, x.stride(0), M, w, NB, kp, out.data_ptr<float>());
  else
    linear(xp, x.stride(0), M, w, NB, kp, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a CPU with AVX512-BF16");
  return x;
#endif
}
