// Causal prefill attention over the paged KV cache, bf16, for CPUs with AVX512-BF16.
//
// A prefill chunk of q_len queries attends to its sequence's first ctx_len keys: query i sits
// at position ctx_len - q_len + i and sees keys up to it. The chunk's own K/V are already in the
// cache, so a first chunk and a later one are the same call.
//
// Each KV head's keys and values are first copied out of their blocks into the layouts
// `vdpbf16ps` wants: keys as [key block of 32][head_dim/2][32][2] (a 64-byte load holds a pair
// of dimensions for 16 keys, as the linear kernel's weights), values as [key pair][head_dim][2].
// Then a tile of 8 query rows of one head walks the key blocks it can see, flash-style: the
// scores of 8 rows x 32 keys stay in registers, an online softmax in fp32 rescales the running
// output, and the probabilities, rounded to bf16 as GPU flash attention rounds them, weigh the
// values. Blocks past a tile's last position are never read; only the diagonal block is masked.
//
// Every output row is computed alone, in the same order, whatever the thread count or the
// chunking of its prompt.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_math.h"
#include "paged_cache.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kKeys = 32;  // keys per block of the packed layout
constexpr int kRows = 8;       // query rows per tile

#if defined(__AVX512BF16__)
// Copies keys and values kb * 32 .. kb * 32 + 31 of one KV head out of the paged cache into
// the packed layouts (zeros from `len` on, so padded keys score 0 and weigh nothing).
inline uint16_t as_bf16(uint16_t x) { return x; }
inline uint16_t as_bf16(uint8_t x) { return tandem::fp8_to_bf16(x); }  // exact

template <typename KV>
void pack_head(const KV* k_cache, const KV* v_cache, const int64_t* table,
               int64_t block_size, int64_t block_stride, int64_t num_kv_heads, int64_t kvh,
               int64_t D, int64_t len, int64_t kb, uint16_t* kp, uint16_t* vp) {
  for (int64_t t = 0; t < kKeys; ++t) {
    const int64_t j = kb * kKeys + t;
    uint16_t* vdst = vp + (j / 2) * D * 2 + (j % 2);
    if (j >= len) {
      for (int64_t d = 0; d < D; ++d) kp[(d / 2) * kKeys * 2 + t * 2 + d % 2] = 0;
      for (int64_t d = 0; d < D; ++d) vdst[d * 2] = 0;
      continue;
    }
    const int64_t row = table[j / block_size] * block_stride + (j % block_size) * num_kv_heads * D;
    const KV* krow = k_cache + row + kvh * D;
    const KV* vrow = v_cache + row + kvh * D;
    for (int64_t d = 0; d < D; ++d) kp[(d / 2) * kKeys * 2 + t * 2 + d % 2] = as_bf16(krow[d]);
    for (int64_t d = 0; d < D; ++d) vdst[d * 2] = as_bf16(vrow[d]);
  }
}

// One tile: up to kRows query rows of head h at positions p0 .. p0 + rows - 1 (absolute
// position offset + p), against the key blocks they see.
template <int D>
void prefill_tile(const uint16_t* q, int64_t q_stride, int64_t h, int64_t p0, int rows,
                  int64_t offset, const uint16_t* kp, const uint16_t* vp, float scale,
                  uint16_t* out, int64_t out_stride) {
  constexpr int kVecs = D / 16;             // fp32 vectors per output row
  constexpr int kPassRows = 16 / kVecs;     // output rows whose accumulators fit at once
  const uint16_t* qrow[kRows];
  int64_t last[kRows];  // the last key each row sees
  for (int m = 0; m < kRows; ++m) {
    const int64_t p = p0 + std::min(m, rows - 1);  // padding rows repeat the last one
    qrow[m] = q + p * q_stride + h * D;
    last[m] = offset + p;
  }
  alignas(64) float o[kRows][D];
  alignas(64) uint16_t pb[kRows][kKeys];
  float mx[kRows], sum[kRows], alpha[kRows];
  for (int m = 0; m < kRows; ++m) {
    mx[m] = -1e30f;
    sum[m] = 0.f;
    for (int d = 0; d < D; ++d) o[m][d] = 0.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t blocks = last[kRows - 1] / kKeys + 1;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint16_t* kblk = kp + kb * (D / 2) * kKeys * 2;
    __m512 s[kRows][2];
    for (int m = 0; m < kRows; ++m) s[m][0] = s[m][1] = _mm512_setzero_ps();
    for (int dp = 0; dp < D / 2; ++dp) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kblk + dp * kKeys * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kblk + dp * kKeys * 2 + kKeys);
      for (int m = 0; m < kRows; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(
            tandem::bf16_pair(qrow[m] + 2 * dp));
        s[m][0] = _mm512_dpbf16_ps(s[m][0], a, k0);
        s[m][1] = _mm512_dpbf16_ps(s[m][1], a, k1);
      }
    }
    for (int m = 0; m < kRows; ++m) {
      const int64_t seen = last[m] - kb * kKeys + 1;  // keys of this block the row sees
      const __mmask16 m0 = tandem::first_lanes(seen), m1 = tandem::first_lanes(seen - 16);
      if (!m0) {  // the whole block lies after this row's position
        alpha[m] = 1.f;
        _mm512_storeu_si512(pb[m], _mm512_setzero_si512());
        continue;
      }
      const __m512 s0 = _mm512_mul_ps(s[m][0], vscale), s1 = _mm512_mul_ps(s[m][1], vscale);
      const __m512 lo = _mm512_set1_ps(-1e30f);
      const float block_max = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_mask_mov_ps(lo, m0, s0), _mm512_mask_mov_ps(lo, m1, s1)));
      const float new_max = std::max(mx[m], block_max);
      const __m512 vmax = _mm512_set1_ps(new_max);
      const __m512 e0 =
          _mm512_maskz_mov_ps(m0, tandem::exp_nonpositive_x16(_mm512_sub_ps(s0, vmax)));
      const __m512 e1 =
          _mm512_maskz_mov_ps(m1, tandem::exp_nonpositive_x16(_mm512_sub_ps(s1, vmax)));
      alpha[m] = _mm512_cvtss_f32(tandem::exp_nonpositive_x16(_mm512_set1_ps(mx[m] - new_max)));
      mx[m] = new_max;
      sum[m] = sum[m] * alpha[m] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pb[m], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    const uint16_t* vblk = vp + kb * (kKeys / 2) * D * 2;
    for (int m0 = 0; m0 < kRows; m0 += kPassRows) {
      __m512 acc[kPassRows][kVecs];
      for (int r = 0; r < kPassRows; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[m0 + r]);
        for (int c = 0; c < kVecs; ++c)
          acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o[m0 + r] + c * 16), a);
      }
      for (int jp = 0; jp < kKeys / 2; ++jp) {
        __m512bh v[kVecs];
        for (int c = 0; c < kVecs; ++c)
          v[c] = (__m512bh)_mm512_loadu_si512(vblk + (jp * D + c * 16) * 2);
        for (int r = 0; r < kPassRows; ++r) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(
              tandem::bf16_pair(pb[m0 + r] + 2 * jp));
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, v[c]);
        }
      }
      for (int r = 0; r < kPassRows; ++r)
        for (int c = 0; c < kVecs; ++c) _mm512_store_ps(o[m0 + r] + c * 16, acc[r][c]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[m]);
    auto* dst = reinterpret_cast<__m256i*>(out + (p0 + m) * out_stride + h * D);
    for (int c = 0; c < kVecs; ++c) {
      const __m512 v = _mm512_mul_ps(_mm512_load_ps(o[m] + c * 16), inv);
      _mm256_storeu_si256(dst + c, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int D, typename KV>
void prefill(const uint16_t* q, int64_t q_stride, int64_t q_len, int64_t num_heads,
             const KV* k_cache, const KV* v_cache, int64_t block_size,
             int64_t block_stride, int64_t num_kv_heads, const int64_t* table, int64_t ctx_len,
             float scale, uint16_t* out, uint16_t* kp, uint16_t* vp, int64_t key_blocks) {
  const int64_t head_k = key_blocks * (D / 2) * kKeys * 2;  // packed elements per KV head
  at::parallel_for(0, num_kv_heads * key_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t kvh = b / key_blocks, kb = b % key_blocks;
      pack_head(k_cache, v_cache, table, block_size, block_stride, num_kv_heads, kvh, D,
                ctx_len, kb, kp + kvh * head_k + kb * (D / 2) * kKeys * 2, vp + kvh * head_k);
    }
  });
  const int64_t offset = ctx_len - q_len, group = num_heads / num_kv_heads;
  const int64_t tiles = (q_len + kRows - 1) / kRows;
  // Later tiles see more keys: the order 0, n-1, 1, n-2, ... gives every thread's contiguous
  // share of items about the same work.
  at::parallel_for(0, tiles * num_heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i % num_heads, z = i / num_heads;
      const int64_t t = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;
      const int64_t kvh = h / group;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, q_len - t * kRows));
      prefill_tile<D>(q, q_stride, h, t * kRows, rows, offset, kp + kvh * head_k, vp + kvh * head_k,
              scale, out, num_heads * D);
    }
  });
}
#endif
}  // namespace

// Whether prefill_attention_bf16 takes this head size on this build.
bool prefill_attention_bf16_supported(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

// q: [q_len, H, D] bf16 (rows may be strided, heads contiguous); k_cache, v_cache:
// [blocks, block_size, KVH, D] bf16 or fp8 (as paged_decode_attention's) holding the
// sequence's first ctx_len tokens, this chunk's included; block_table: [>= ctx_len /
// block_size] int64.
// Returns [q_len, H, D].
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, int64_t ctx_len, double scale) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be [T, H, D] bf16 with each row's heads contiguous");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16 || fp8, "the caches must be bf16 or fp8");
  tandem::check_paged_cache(k_cache, v_cache);
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.is_contiguous(),
              "block_table must be contiguous int64");
  const int64_t q_len = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "q's heads do not match the cache's");
  TORCH_CHECK(q_len >= 1 && ctx_len >= q_len &&
                  block_table.numel() * block_size >= ctx_len,
              "ctx_len ", ctx_len, " does not fit q_len ", q_len, " or the block table");
  TORCH_CHECK(prefill_attention_bf16_supported(D), "head_dim ", D, " is not supported");
  const auto* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx_len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < k_cache.size(0), "block id ", table[i],
                " out of range");
  const int64_t key_blocks = (ctx_len + kKeys - 1) / kKeys;
  auto out = torch::empty({q_len, H, D}, q.options());
  auto kp = torch::empty({KVH * key_blocks * kKeys * D}, q.options());
  auto vp = torch::empty({KVH * key_blocks * kKeys * D}, q.options());
  auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto* kpp = reinterpret_cast<uint16_t*>(kp.data_ptr());
  auto* vpp = reinterpret_cast<uint16_t*>(vp.data_ptr());
  auto run = [&](const auto* k, const auto* v) {
    if (D == 64)
      prefill<64>(u16(q), q.stride(0), q_len, H, k, v, block_size, k_cache.stride(0), KVH, table,
                  ctx_len, static_cast<float>(scale), o, kpp, vpp, key_blocks);
    else
      prefill<128>(u16(q), q.stride(0), q_len, H, k, v, block_size, k_cache.stride(0), KVH, table,
                   ctx_len, static_cast<float>(scale), o, kpp, vpp, key_blocks);
  };
  if (fp8)
    run(static_cast<const uint8_t*>(k_cache.data_ptr()),
        static_cast<const uint8_t*>(v_cache.data_ptr()));
  else
    run(u16(k_cache), u16(v_cache));
  return out;
#else
  TORCH_CHECK(false, "prefill_attention_bf16 needs a CPU with AVX512-BF16");
  return q;
#endif
}
