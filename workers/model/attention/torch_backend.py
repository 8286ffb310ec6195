"""Attention with torch's scaled_dot_product_attention over the paged cache (CPU, any device).

Decodes are batched. On the CPU a compiled kernel (workers/model/cpu_kernels.py) reads their
blocks in place; otherwise their blocks are gathered into a padded `[B, KVH, L, D]` view for
SDPA, with the query heads of each KV group in SDPA's query-length axis, so GQA needs no head
repeat.
Prefill chunks run one sequence each; a chunk with no cached prefix attends to its own fresh
K/V, causally, without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.attention.base import AttentionBackend, AttentionMetadata, PrefillSlice


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device, use_kernel: bool = True) -> None:
        self.kernel = None
        if use_kernel and device.type == "cpu":
            from workers.model.cpu_kernels import cpu_kernels

            self.kernel = cpu_kernels()
        if self.kernel is not None:
            self.name = "torch+cpu-kernel"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        group = q.shape[1] // num_kv_heads
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, group, scale)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p, scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, group: int, scale: float):
        tables = meta.decode_block_tables
        if self.kernel is not None:
            return self.kernel.paged_decode_attention(
                q, k_cache, v_cache, tables, meta.decode_context_lens, scale
            )
        batch, max_blocks = tables.shape
        _, block_size, kvh, d = k_cache.shape
        length = max_blocks * block_size
        if meta.decode_mask is None:
            pos = torch.arange(length)
            meta.decode_mask = (pos[None, :] < meta.decode_context_lens[:, None]).view(
                batch, 1, 1, length
            )
        keys = k_cache[tables].view(batch, length, kvh, d).transpose(1, 2)
        values = v_cache[tables].view(batch, length, kvh, d).transpose(1, 2)
        qg = q.view(batch, kvh, group, d)
        o = F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=meta.decode_mask, scale=scale
        )
        return o.reshape(batch, kvh * group, d)

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillSlice, scale: float):
        kvh, d = k.shape[1], k.shape[2]
        # 4-D inputs: with a batch axis, SDPA takes its fused CPU kernel rather than the
        # math fallback (5x faster on a 1,500-token prompt), and GQA needs no head repeat.
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if not p.has_prefix:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
            mask = None
        else:
            block_size = k_cache.shape[1]
            n = (p.ctx_len + block_size - 1) // block_size
            blocks = p.block_table[:n]
            keys = k_cache[blocks].view(-1, kvh, d)[: p.ctx_len].transpose(0, 1)
            values = v_cache[blocks].view(-1, kvh, d)[: p.ctx_len].transpose(0, 1)
            # Query i sits at absolute position ctx_len - q_len + i and sees keys up to it.
            offset = p.ctx_len - p.q_len
            qpos = torch.arange(p.q_len).unsqueeze(1) + offset
            mask = torch.arange(p.ctx_len).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(
            qh,
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != kvh,
        )
        return o[0].transpose(0, 1)
