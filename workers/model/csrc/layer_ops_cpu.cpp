// The decoder layer's small ops, fused, for the CPU: RMSNorm (with the residual add), rotary
// embedding in place, and SiLU-and-mul. Each replaces five to twelve torch ops, and a decode
// step of a small model is mostly op dispatch, not arithmetic.
//
// The rounding follows the torch code they replace (workers/model/llama.py, rope.py): math in
// fp32, the normalized value rounded to the activations' dtype before the weight multiplies it,
// the residual sum rounded to that dtype, SiLU rounded before the multiply. So results equal
// the unfused path's up to the order (and fusing) of fp32 multiply-adds.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_math.h"
#include "paged_cache.h"

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
inline float rd(float x) { return static_cast<float>(static_cast<T>(x)); }  // round trip

// out[r] = w * rd(h * rsqrt(mean(h^2) + eps)), with h = residual[r] (+= x[r] first when fused).
template <typename T>
void rms_norm_rows(T* out, T* residual, const T* x, const T* w, int64_t rows, int64_t hidden,
                   int64_t out_stride, int64_t res_stride, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * res_stride;
      float ss = 0.f;
      if (x != nullptr) {
        const T* xr = x + r * x_stride;
        for (int64_t i = 0; i < hidden; ++i) {
          const T sum = round_to<T>(static_cast<float>(res[i]) + static_cast<float>(xr[i]));
          res[i] = sum;
          h[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) h[i] = static_cast<float>(res[i]);
      }
      for (int64_t i = 0; i < hidden; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = round_to<T>(static_cast<float>(w[i]) * rd<T>(h[i] * inv));
    }
  });
}

}  // namespace

// x: [T, hidden]. Returns RMSNorm(x) * weight, x untouched.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, hidden], rows contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1),
              "weight must be contiguous, [hidden], of x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), nullptr,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), out.stride(0),
                            x.stride(0), 0, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place, rounded to its dtype); returns RMSNorm(residual) * weight.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.dim() == 2 && x.sizes() == residual.sizes(),
              "x and residual must both be [T, hidden]");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "x, residual and weight ([hidden], contiguous) must share a dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), out.stride(0), residual.stride(0), x.stride(0),
                            static_cast<float>(eps));
  });
  return out;
}

// Rotate-half rotary embedding, in place. qk: [T, heads, D] (any row stride, heads and D
// contiguous: the q or k columns of the fused qkv output); cos, sin: [max_pos, D/2] fp32;
// positions: [T] int64.
void rotary_inplace(torch::Tensor qk, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [T, heads, D] with heads and D contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous fp32 tables");
  positions = positions.to(torch::kLong).contiguous();
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(positions.numel() == T, "one position per row of qk");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos/sin tables must be [max_pos, head_dim / 2]");
  const int64_t row_stride = qk.stride(0), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " is past the table");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + pos[t] * half;
        const float* st = s + pos[t] * half;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* x = base + t * row_stride + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = round_to<scalar_t>(x1 * ct[i] - x2 * st[i]);
            x[i + half] = round_to<scalar_t>(x2 * ct[i] + x1 * st[i]);
          }
        }
      }
    });
  });
}

// gate_up: [T, 2I] (gate then up). Returns rd(silu(gate)) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I], rows contiguous");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, in_stride = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul",
                                  [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = in + t * in_stride;
        const scalar_t* u = g + I;
        scalar_t* ot = o + t * I;
        for (int64_t i = 0; i < I; ++i) {
          const float act = rd<scalar_t>(tandem::silu(static_cast<float>(g[i])));
          ot[i] = round_to<scalar_t>(act * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// What scatter_blocks and gather_blocks check before copying: CPU tensors of one dtype and one
// block shape; `packed` contiguous; each block of `strided` contiguous, the blocks themselves
// stride(0) apart (rows of a wider tensor, or one layer of a wider cache); `index` int64 [n]
// of ids below `blocks`. Returns one block's bytes.
static size_t checked_block_bytes(const char* op, const torch::Tensor& packed,
                                  const torch::Tensor& strided, const torch::Tensor& index,
                                  int64_t n, int64_t blocks) {
  TORCH_CHECK(packed.device().is_cpu() && strided.device().is_cpu() && index.device().is_cpu(),
              op, " takes CPU tensors");
  TORCH_CHECK(packed.is_contiguous(), op, ": the staged side must be contiguous");
  TORCH_CHECK(packed.scalar_type() == strided.scalar_type(), op, ": dtypes differ");
  TORCH_CHECK(strided.dim() >= 1 && strided.dim() == packed.dim() &&
                  packed.sizes().slice(1) == strided.sizes().slice(1),
              op, ": both sides must be [n, ...] with one block shape");
  int64_t slice = 1;
  for (int64_t dim = strided.dim() - 1; dim >= 1; --dim) {
    TORCH_CHECK(strided.size(dim) == 1 || strided.stride(dim) == slice,
                op, ": each block must be contiguous");
    slice *= strided.size(dim);
  }
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong && index.is_contiguous() &&
                  index.numel() == n,
              op, ": index must be int64 [n], one block id per block moved");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < blocks, op, ": block id ", idx[i], " out of range");
  }
  return static_cast<size_t>(slice) * strided.element_size();
}

// dst[index[i]] = src[i] along dim 0, each block copied whole: a KV transfer's blocks landing
// in their reserved blocks. index_copy_ copies element by element, at a fifth of this speed.
void scatter_blocks(torch::Tensor dst, torch::Tensor index, torch::Tensor src) {
  const int64_t n = index.numel();
  const size_t bytes = checked_block_bytes("scatter_blocks", dst, src, index, src.size(0),
                                           dst.size(0));
  const size_t src_stride = static_cast<size_t>(src.stride(0)) * src.element_size();
  const int64_t* idx = index.data_ptr<int64_t>();
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + idx[i] * bytes, s + i * src_stride, bytes);
}

// dst[i] = src[index[i]] along dim 0, each block copied whole on the calling thread alone: a
// KV transfer's staged blocks gathered on its sender's thread. index_select would start an
// OpenMP team there, and a process with more teams than cores slows its engine loop's
// (engine_loop.py says why).
void gather_blocks(torch::Tensor dst, torch::Tensor index, torch::Tensor src) {
  const int64_t n = index.numel();
  const size_t bytes = checked_block_bytes("gather_blocks", dst, src, index, dst.size(0),
                                           src.size(0));
  const size_t src_stride = static_cast<size_t>(src.stride(0)) * src.element_size();
  const int64_t* idx = index.data_ptr<int64_t>();
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * bytes, s + idx[i] * src_stride, bytes);
}

// The index of each row's maximum, the first among equals, as torch.argmax gives it (a NaN
// counts as the maximum: the first NaN's index). torch's reduction takes 4 ms over 64 rows of
// a 49,152-token vocabulary on one core; a greedy step needs it for every sequence.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) >= 1,
              "x must be [N, V] float32 with V >= 1 and contiguous rows");
  const int64_t rows = x.size(0), V = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = base + r * stride;
      int64_t nan_at = -1;
      float best = row[0];
#if defined(__AVX512F__)
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 m = tandem::first_lanes(V - i);
        const __m512 v = _mm512_mask_loadu_ps(vmax, m, row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, v);
      }
      if (nan) {
        for (int64_t i = 0; i < V && nan_at < 0; ++i)
          if (std::isnan(row[i])) nan_at = i;
      } else {
        best = _mm512_reduce_max_ps(vmax);
      }
#else
      for (int64_t i = 0; i < V && nan_at < 0; ++i) {
        if (std::isnan(row[i])) nan_at = i;
        else best = std::max(best, row[i]);
      }
#endif
      if (nan_at >= 0) {
        o[r] = nan_at;
        continue;
      }
      int64_t at = 0;  // the first lane equal to best: best is one of the row's values
#if defined(__AVX512F__)
      const __m512 vbest = _mm512_set1_ps(best);
      for (; at + 16 <= V; at += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + at), vbest, _CMP_EQ_OQ);
        if (eq) {
          at += __builtin_ctz(eq);
          break;
        }
      }
#endif
      while (row[at] != best) ++at;
      o[r] = at;
    }
  });
  return out;
}

// cache[slots[i] / block_size, slots[i] % block_size] = rows[i]: a step's new K (or V) rows
// into their slots. cache: [num_blocks, block_size, KVH, D] as the attention kernels take it
// (blocks may lie apart); rows: [n, KVH, D], each row contiguous, the rows themselves possibly
// strided (a layer's K or V columns of its fused QKV output).
void write_slots(torch::Tensor cache, torch::Tensor slots, torch::Tensor rows) {
  tandem::check_paged_cache(cache, cache);
  TORCH_CHECK(rows.device().is_cpu() && slots.device().is_cpu(), "write_slots takes CPU tensors");
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type() ||
                  (fp8 &&
                   (rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kFloat)),
              "cache and rows differ in dtype (an fp8 cache takes bf16 or fp32 rows)");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3) &&
                  rows.stride(2) == 1 && (rows.size(1) == 1 || rows.stride(1) == rows.size(2)),
              "rows must be [n, KVH, D] with each row contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == rows.size(0),
              "slots must be int64 [n], one slot per row");
  const int64_t n = slots.numel(), bs = cache.size(1), limit = cache.size(0) * bs;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < limit, "slot ", s[i], " out of range");
  }
  if (fp8) {  // converted as they go, saturating (tandem::to_fp8)
    const int64_t width = cache.size(2) * cache.size(3);
    auto* d = static_cast<uint8_t*>(cache.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, rows.scalar_type(), "write_slots_fp8", [&] {
      const auto* r = rows.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) {
        uint8_t* dst = d + (s[i] / bs) * cache.stride(0) + (s[i] % bs) * cache.stride(1);
        const scalar_t* src = r + i * rows.stride(0);
        int64_t j = 0;
#if defined(__AVX512BW__)
        for (; j + 16 <= width; j += 16) {
          __m512 v;
          if constexpr (std::is_same_v<scalar_t, float>)
            v = _mm512_loadu_ps(src + j);
          else
            v = tandem::load_bf16_x16(reinterpret_cast<const uint16_t*>(src + j));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), tandem::to_fp8_x16(v));
        }
#endif
        for (; j < width; ++j) dst[j] = tandem::to_fp8(static_cast<float>(src[j]));
      }
    });
    return;
  }
  const size_t es = cache.element_size();
  const size_t row_bytes = static_cast<size_t>(cache.size(2) * cache.size(3)) * es;
  const size_t block_bytes = static_cast<size_t>(cache.stride(0)) * es;
  const size_t slot_bytes = static_cast<size_t>(cache.stride(1)) * es;
  const size_t src_stride = static_cast<size_t>(rows.stride(0)) * es;
  char* d = static_cast<char*>(cache.data_ptr());
  const char* r = static_cast<const char*>(rows.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(d + (s[i] / bs) * block_bytes + (s[i] % bs) * slot_bytes, r + i * src_stride,
                row_bytes);
  }
}
