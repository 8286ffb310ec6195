// The paged KV cache as the attention kernels read it.
#pragma once

#include <torch/extension.h>

namespace tandem {

// k_cache, v_cache: [num_blocks, block_size, KVH, D], the same strides and dtype, each block's
// slots contiguous. Blocks may lie further apart than one block: a layer's K and V share one
// allocation, block by block ([num_blocks, 2, block_size, KVH, D]), so that a run of blocks
// is one contiguous region, K and V together; the kernels step by stride(0).
inline void check_paged_cache(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "the KV cache must be on the CPU");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.strides() == k.strides() &&
                  v.scalar_type() == k.scalar_type(),
              "the K and V caches must be [blocks, block_size, KVH, D], alike");
  const int64_t bs = k.size(1), KVH = k.size(2), D = k.size(3);
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && k.stride(1) == KVH * D &&
                  k.stride(0) >= bs * KVH * D,
              "each block of the KV cache must be contiguous");
}

}  // namespace tandem
