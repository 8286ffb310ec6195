// Decode attention straight off the paged KV cache, for the CPU.
//
// One work item per (sequence, KV head): its G query heads are scored against the sequence's
// keys block by block, softmaxed in fp32 and used to weigh the values. Nothing is gathered or
// padded, so the cost follows each sequence's own length rather than the batch's longest.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "paged_cache.h"

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }


// Calls fn(t, row) for the sequence's tokens t = 0 .. len-1 in order, row being the element
// offset of token t's slot in the cache: blocks lie block_stride apart (a layer's K and V may
// share one allocation, block by block), slots within one token_stride apart. It walks the
// block table block by block (no division per token).
template <typename Fn>
inline void for_each_slot(const int64_t* table, int64_t len, int64_t block_size,
                          int64_t block_stride, int64_t token_stride, Fn&& fn) {
  for (int64_t blk = 0, t = 0; t < len; ++blk) {
    const int64_t base = table[blk] * block_stride;
    const int64_t n = std::min(block_size, len - t);
    for (int64_t i = 0; i < n; ++i, ++t) fn(t, base + i * token_stride);
  }
}

// for_each_slot, with fn(t, row, ahead) also given `ahead`: the same slot's row in the next
// block of the table (row itself in the last block), for the caller to prefetch. Blocks lie
// anywhere in the cache, so the hardware prefetchers cannot see the next one coming.
template <typename Fn>
inline void for_each_slot_ahead(const int64_t* table, int64_t len, int64_t block_size,
                                int64_t block_stride, int64_t token_stride, Fn&& fn) {
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t blk = 0, t = 0; t < len; ++blk) {
    const int64_t base = table[blk] * block_stride;
    const int64_t next = blk + 1 < blocks ? table[blk + 1] * block_stride : base;
    const int64_t n = std::min(block_size, len - t);
    for (int64_t i = 0; i < n; ++i, ++t) fn(t, base + i * token_stride, next + i * token_stride);
  }
}

// KV heads in one work item: all of a sequence's when the batch alone keeps every thread busy,
// one otherwise.
inline int64_t kv_heads_per_item(int64_t batch, int64_t num_kv_heads) {
  return batch >= 2 * at::get_num_threads() ? num_kv_heads : 1;
}

// D_FIXED is the head dimension when known at compile time (the inner loops then unroll and
// vectorise without remainders), 0 for any other size.
//
// A work item is one sequence and a run of its KV heads: all of them when the batch alone keeps
// every thread busy (each token's K and V rows are then read whole, in one pass), one head each
// otherwise.
template <typename T, typename KV, int64_t D_FIXED>
void decode_kernel(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim_, int64_t block_size,
                   int64_t block_stride, int64_t table_width, float scale) {
  const int64_t D = D_FIXED ? D_FIXED : head_dim_;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;  // between slots of the cache
  const int64_t heads_per_item = kv_heads_per_item(batch, num_kv_heads);
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = heads_per_item * group;  // query heads of one item
    std::vector<float> qf(rows * D), acc(rows * D), scores, denom(rows), vf(heads_per_item * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq;
      const int64_t h0 = (item % items_per_seq) * heads_per_item;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_width;
      const T* qb = q + (b * num_heads + h0 * group) * D;  // the item's query heads, in a row
      for (int64_t i = 0; i < rows * D; ++i) qf[i] = to_float(qb[i]) * scale;
      scores.resize(rows * len);
      float* sc = scores.data();
      for_each_slot(table, len, block_size, block_stride, token_stride,
                    [&](int64_t t, int64_t row) {
        const KV* krow = k_cache + row + h0 * D;
        for (int64_t hh = 0, r = 0; hh < heads_per_item; ++hh) {
          const KV* kp = krow + hh * D;
          for (int64_t g = 0; g < group; ++g, ++r) {
            const float* qr = qf.data() + r * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(kp[d]);
            sc[r * len + t] = s;
          }
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = sc + r * len;
        float mx = sr[0];  // len >= 1; no infinities, so reassociating flags stay safe
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sr[t]);
        for (int64_t t = 0; t < len; ++t) sr[t] = tandem::exp_nonpositive(sr[t] - mx);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += sr[t];
        denom[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_slot(table, len, block_size, block_stride, token_stride,
                    [&](int64_t t, int64_t row) {
        const KV* vrow = v_cache + row + h0 * D;
        for (int64_t i = 0; i < heads_per_item * D; ++i) vf[i] = to_float(vrow[i]);
        for (int64_t hh = 0, r = 0; hh < heads_per_item; ++hh) {
          const float* vp = vf.data() + hh * D;
          for (int64_t g = 0; g < group; ++g, ++r) {
            const float p = sc[r * len + t];
            float* ar = acc.data() + r * D;
            for (int64_t d = 0; d < D; ++d) ar[d] += p * vp[d];
          }
        }
      });
      T* ob = out + (b * num_heads + h0 * group) * D;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / denom[r];
        for (int64_t d = 0; d < D; ++d) ob[r * D + d] = static_cast<T>(acc[r * D + d] * inv);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// A cache row of D elements into L1, a cache line at a time.
template <int D, typename KV>
inline void prefetch_row(const KV* p) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int c = 0; c < D * static_cast<int>(sizeof(KV)); c += 64)
    _mm_prefetch(bytes + c, _MM_HINT_T0);
}

// A key row as bf16 vectors (32 dimensions each): from a bf16 cache, or an fp8 one, whose
// values bf16 holds exactly.
template <int D>
inline void load_key(const uint16_t* row, __m512bh* k) {
  for (int c = 0; c < D / 32; ++c) k[c] = (__m512bh)_mm512_loadu_si512(row + c * 32);
}
template <int D>
inline void load_key(const uint8_t* row, __m512bh* k) {
  for (int c = 0; c < D / 32; ++c) k[c] = (__m512bh)tandem::fp8x32_to_bf16(row + c * 32);
}

// A value row widened to fp32 (16 dimensions a vector).
template <int D>
inline void load_value(const uint16_t* row, __m512* v) {
  for (int c = 0; c < D / 16; ++c) v[c] = tandem::load_bf16_x16(row + c * 16);
}
template <int D>
inline void load_value(const uint8_t* row, __m512* v) {
  for (int c = 0; c < D / 32; ++c) {
    const __m512i b = tandem::fp8x32_to_bf16(row + c * 32);
    v[2 * c] = tandem::widen_bf16_half(b, 0);
    v[2 * c + 1] = tandem::widen_bf16_half(b, 1);
  }
}

// The bf16 path on AVX512-BF16, for head_dim 64 or 128 and up to 8 query heads per KV head, over
// a bf16 cache (KV = uint16_t) or an fp8 one (uint8_t).
// Work items as decode_kernel's; a key's score for each of the G query heads of its KV head is
// one vdpbf16ps chain over the key's row (the generic loop above converts every element to fp32
// and reduces it one dot at a time), the softmax runs 16 lanes at a time, and each value row
// is widened to fp32 once and weighed in fp32 for all G heads.
template <int D, int G, typename KV>
void decode_bf16(const uint16_t* q, const KV* k_cache, const KV* v_cache,
                 const int64_t* tables, const int64_t* lens, uint16_t* out, int64_t batch,
                 int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                 int64_t block_stride, int64_t table_width, float scale) {
  constexpr int kC = D / 32;  // bf16 vectors per row
  constexpr int kV = D / 16;  // fp32 vectors per row
  const int64_t token_stride = num_kv_heads * D;
  // As in decode_kernel: every KV head of a sequence in one item when the batch alone keeps
  // the threads busy, one head each otherwise.
  const int64_t nh = kv_heads_per_item(batch, num_kv_heads);
  const int64_t items_per_seq = num_kv_heads / nh;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv;  // reused across the thread's items
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * nh, len = lens[b];
      const int64_t* table = tables + b * table_width;
      const int64_t rows = nh * G, last = len - 1;
      scores.resize(rows * len);
      float* sc = scores.data();
      for (int64_t hh = 0; hh < nh; ++hh) {  // scores: row hh * G + g, token t
        const uint16_t* qb = q + (b * num_heads + (h0 + hh) * G) * D;
        __m512bh qz[G][kC];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < kC; ++c)
            qz[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * D + c * 32);
        for_each_slot_ahead(table, len, block_size, block_stride, token_stride,
                            [&](int64_t t, int64_t row, int64_t ahead) {
          const KV* krow = k_cache + row + (h0 + hh) * D;
          prefetch_row<D>(k_cache + ahead + (h0 + hh) * D);
          __m512bh k[kC];
          load_key<D>(krow, k);
          for (int g = 0; g < G; ++g) {
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < kC; ++c) s = _mm512_dpbf16_ps(s, qz[g][c], k[c]);
            sc[(hh * G + g) * len + t] = _mm512_reduce_add_ps(s) * scale;
          }
        });
      }
      inv.resize(rows);
      const __m512 lo = _mm512_set1_ps(-1e30f);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = sc + r * len;
        __m512 vmax = lo;
        for (int64_t t = 0; t <= last; t += 16)
          vmax = _mm512_max_ps(
              vmax, _mm512_mask_loadu_ps(lo, tandem::first_lanes(len - t), sr + t));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t <= last; t += 16) {
          const __mmask16 m = tandem::first_lanes(len - t);
          const __m512 x = _mm512_sub_ps(_mm512_mask_loadu_ps(lo, m, sr + t), mx);
          const __m512 e = _mm512_maskz_mov_ps(m, tandem::exp_nonpositive_x16(x));
          _mm512_mask_storeu_ps(sr + t, m, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(vsum);
      }
      for (int64_t hh = 0; hh < nh; ++hh) {  // values, weighed in fp32
        __m512 a[G][kV];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < kV; ++c) a[g][c] = _mm512_setzero_ps();
        for_each_slot_ahead(table, len, block_size, block_stride, token_stride,
                            [&](int64_t t, int64_t row, int64_t ahead) {
          const KV* vrow = v_cache + row + (h0 + hh) * D;
          prefetch_row<D>(v_cache + ahead + (h0 + hh) * D);
          __m512 v[kV];
          load_value<D>(vrow, v);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(sc[(hh * G + g) * len + t]);
            for (int c = 0; c < kV; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
          }
        });
        uint16_t* ob = out + (b * num_heads + (h0 + hh) * G) * D;
        for (int g = 0; g < G; ++g) {
          const __m512 s = _mm512_set1_ps(inv[hh * G + g]);
          for (int c = 0; c < kV; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + g * D + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[g][c], s)));
        }
      }
    }
  });
}

template <int D, typename KV>
bool decode_bf16_for_group(int64_t group, const uint16_t* q, const KV* k, const KV* v,
                           const int64_t* tables, const int64_t* lens, uint16_t* out, int64_t B,
                           int64_t H, int64_t KVH, int64_t bs, int64_t bstride, int64_t width,
                           float scale) {
  switch (group) {
#define TANDEM_GROUP(G)                                                                    \
    case G:                                                                                \
      decode_bf16<D, G, KV>(q, k, v, tables, lens, out, B, H, KVH, bs, bstride, width, scale); \
      return true;
    TANDEM_GROUP(1) TANDEM_GROUP(2) TANDEM_GROUP(3) TANDEM_GROUP(4)
    TANDEM_GROUP(5) TANDEM_GROUP(6) TANDEM_GROUP(7) TANDEM_GROUP(8)
#undef TANDEM_GROUP
    default: return false;
  }
}

// Runs the bf16 path when it takes this shape; false leaves the call to the generic kernel.
bool try_decode_bf16(const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& tables,
                     const torch::Tensor& lens, torch::Tensor& out, float scale) {
  if (q.scalar_type() != torch::kBFloat16) return false;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), group = H / KVH;
  auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  const auto* tp = tables.data_ptr<int64_t>();
  const auto* lp = lens.data_ptr<int64_t>();
  const int64_t bstride = k_cache.stride(0);
  auto run = [&](const auto* k, const auto* v) {
    if (D == 64)
      return decode_bf16_for_group<64>(group, u16(q), k, v, tp, lp, u16(out), B, H, KVH, bs,
                                       bstride, tables.size(1), scale);
    if (D == 128)
      return decode_bf16_for_group<128>(group, u16(q), k, v, tp, lp, u16(out), B, H, KVH, bs,
                                        bstride, tables.size(1), scale);
    return false;
  };
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    return run(static_cast<const uint8_t*>(k_cache.data_ptr()),
               static_cast<const uint8_t*>(v_cache.data_ptr()));
  return run(u16(k_cache), u16(v_cache));
}
#endif

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D], each block contiguous and
// both with the same strides (blocks may lie further apart, see tandem::check_paged_cache);
// tables: [B, W] int64; lens: [B] int64 (tokens in cache, >= 1). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor tables,
                                     torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B,H,D], cache [N,bs,KVH,D]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || fp8,
              "q and cache dtypes differ (only an fp8 cache takes other queries)");
  q = q.contiguous();
  tables = tables.to(torch::kLong).contiguous();
  lens = lens.to(torch::kLong).contiguous();
  tandem::check_paged_cache(k_cache, v_cache);
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "q heads/dim do not fit the cache's");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B,
              "tables must be [B, W] and lens [B]");
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 1 && len <= tables.size(1) * bs, "sequence ", b, " has length ", len,
                ", outside 1..", tables.size(1) * bs, " (its block table)");
    for (int64_t i = 0; i < (len + bs - 1) / bs; ++i) {
      const int64_t block = tp[b * tables.size(1) + i];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block id ", block, " out of range");
    }
  }
#if defined(__AVX512BF16__)
  if (try_decode_bf16(q, k_cache, v_cache, tables, lens, out, static_cast<float>(scale)))
    return out;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto with_cache = [&](const auto* k, const auto* v) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
      auto run = [&](auto kernel) {
        kernel(q.data_ptr<scalar_t>(), k, v, tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, bs,
               k_cache.stride(0), tables.size(1), static_cast<float>(scale));
      };
      if (D == 64) run(decode_kernel<scalar_t, KV, 64>);
      else if (D == 128) run(decode_kernel<scalar_t, KV, 128>);
      else run(decode_kernel<scalar_t, KV, 0>);
    };
    if (fp8)
      with_cache(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>());
    else
      with_cache(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}
