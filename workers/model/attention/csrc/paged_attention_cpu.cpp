// Decode attention straight off the paged KV cache, for the CPU.
//
// One work item per (sequence, KV head): its G query heads are scored against the sequence's
// keys block by block, softmaxed in fp32 and used to weigh the values. Nothing is gathered or
// padded, so the cost follows each sequence's own length rather than the batch's longest.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots of the cache
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = to_float(q[(b * num_heads + h * group + g) * head_dim + d]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* kp = k_cache + slot * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_float(kp[d]);
          scores[g * len + t] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = sg[0];  // len >= 1; no infinities, so reassociating flags stay safe
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        denom[g] = sum;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* vp = v_cache + slot * token_stride + h * head_dim;
        float vf[512];
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(vp[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / denom[g];
        T* o = out + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; tables: [B, W] int64;
// lens: [B] int64 (tokens in cache, >= 1). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor tables,
                                     torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B,H,D], cache [N,bs,KVH,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) <= 512, "head_dim above 512 is not supported");
  q = q.contiguous();
  tables = tables.to(torch::kLong).contiguous();
  lens = lens.to(torch::kLong).contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D,
                            bs, tables.size(1), static_cast<float>(scale));
  });
  return out;
}
