"""Attention with torch over the paged cache, on the CPU and on CUDA without flash-attn.

Decodes are batched. Where a paged decode kernel is at hand they read their blocks in place:
Tandem's compiled CPU kernel (workers/model/cpu_kernels.py), or on CUDA a Triton kernel
(triton_decode.py). Both stop at each row's own length, and a row's result does not depend on
the rest of the batch. Without one, each row's blocks are gathered for SDPA, in groups of
rows of like length (a group is padded to at most twice its rows' blocks, never to the
longest row of the batch), with the query heads of each KV group in SDPA's query-length axis,
so GQA needs no head repeat.
Prefill chunks run one sequence each. In bf16 on a CPU with AVX512-BF16 a compiled kernel
attends straight off the paged cache, first chunk or later, and so does a Triton kernel on
CUDA (triton_prefill.py), which needs no mask tensor for a later chunk. Otherwise a chunk
with no cached prefix attends to its own fresh K/V, causally, without touching the cache,
and a later chunk reads its prefix (only its own blocks) from the cache; on the CPU it
attends to the prefix and to itself in two mask-free passes, merged exactly by their
log-sum-exps.
With a paged decode kernel, a chunk's rows at the sequence's output positions (a replay's
tokens, or a preempted sequence's, computed again) attend as single-token decodes, as they
were first computed: the kernel's rows do not depend on the batch or the chunking, so each
comes out the same bits.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from workers.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    HeadShape,
    PrefillSlice,
)
from workers.model.fp8_linear import FP8_MAX

log = logging.getLogger(__name__)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self, device: torch.device, use_kernel: bool = True, shape: HeadShape | None = None
    ) -> None:
        """use_kernel=False keeps decode attention on SDPA (for comparison). On CUDA the
        Triton kernel is tried at `shape` (the model's) before it is taken."""
        self.kernel = None  # Tandem's CPU kernels: slot writes, bf16 prefill, paged decode
        self.paged_decode = None  # (q, k_cache, v_cache, tables, lens, scale) -> out
        self.paged_prefill = None  # (q, k_cache, v_cache, table, ctx_len, scale) -> out
        self._in_place = paged_blocks_contiguous  # what the paged decode asks of a cache
        if use_kernel and device.type == "cpu":
            from workers.model.cpu_kernels import cpu_kernels

            self.kernel = cpu_kernels()
            if self.kernel is not None:
                self.paged_decode = self.kernel.paged_decode_attention
                self.name = "torch+cpu-kernel"
        elif use_kernel and device.type == "cuda":
            from workers.model.attention.triton_decode import (
                paged_decode_attention,
                triton_refusal,
            )
            from workers.model.triton_base import triton_unavailable

            if shape is None:
                why = triton_unavailable()
            else:
                why = triton_refusal(
                    device,
                    shape.dtype,
                    shape.heads,
                    shape.kv_heads,
                    shape.head_dim,
                    shape.block_size,
                )
            if why is None:
                self.paged_decode = paged_decode_attention
                # Any block stride: it asks only that K and V be alike and dense in head_dim,
                # as every layer's pair of views is.
                self._in_place = lambda k_cache, v_cache: True
                self.name = "torch+triton"
                self.paged_prefill = _triton_prefill(device, shape)
            else:
                log.warning(
                    "no Triton decode kernel (%s): decode attention gathers each row's "
                    "blocks for SDPA, and decode steps are not captured in CUDA graphs",
                    why,
                )

    @property
    def graph_safe(self) -> bool:
        return self.paged_decode is not None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        group = q.shape[1] // k.shape[1]
        if not meta.kv_written:
            self._write(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if not meta.prefills:  # decodes alone: their output is the whole step's
            return self._decode(q, k_cache, v_cache, tables, lens, group, scale, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, tables, lens, group, scale, meta)
        # Output rows attend as decodes only where that makes them exact: with a paged
        # kernel, which reads the cache in place. The fallback would gather a row's whole
        # context for each of them.
        exact = self.paged_decode is not None and self._in_place(k_cache, v_cache)
        for p in meta.prefills:
            tail = p.out_rows if exact else 0
            start, mid, end = p.q_start, p.q_start + p.q_len - tail, p.q_start + p.q_len
            if mid > start:
                part = p.prompt_part() if tail else p
                out[start:mid] = self._prefill(
                    q[start:mid], k[start:mid], v[start:mid], k_cache, v_cache, part, scale
                )
            if end > mid:  # output positions, attended as their decode steps were
                rows_tables, rows_lens = p.output_part()
                out[mid:end] = self._decode(
                    q[mid:end], k_cache, v_cache, rows_tables, rows_lens, group, scale
                )
        return out

    def _write(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if self.kernel is not None:  # a memcpy per row
            self.kernel.write_slots(k_cache, meta.slot_mapping, k)
            self.kernel.write_slots(v_cache, meta.slot_mapping, v)
        else:
            index = meta.slot_index(k_cache.shape[1])
            k_cache[index] = as_cached(k, k_cache.dtype).to(k_cache.dtype)
            v_cache[index] = as_cached(v, v_cache.dtype).to(v_cache.dtype)

    def _prefill_kernel(self, q, k_cache, v_cache, block_table) -> bool:
        """Whether this chunk takes the compiled bf16 prefill kernel (AVX512-BF16): what it
        checks, checked here, so that anything else takes the SDPA paths rather than fail."""
        return (
            self.kernel is not None
            and q.dtype == torch.bfloat16
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn)
            and q.stride(-1) == 1
            and q.stride(-2) == q.shape[-1]
            and paged_blocks_contiguous(k_cache, v_cache)
            and block_table.dtype == torch.long
            and block_table.is_contiguous()
            and self.kernel.prefill_attention_bf16_supported(q.shape[-1])
        )

    def _decode(self, q, k_cache, v_cache, tables, lens, group: int, scale: float, meta=None):
        """Single-token queries, row i over the keys `tables[i]` holds up to `lens[i]`; the
        step's decode batch passes `meta`, whose host-side lengths group the fallback's rows."""
        if self.paged_decode is not None and self._in_place(k_cache, v_cache):
            return self.paged_decode(q, k_cache, v_cache, tables, lens, scale)
        host = meta.decode_lens_host if meta is not None and meta.decode_lens_host else None
        if host is None:
            host = lens.tolist()
        groups = _length_groups(host, k_cache.shape[1])
        if len(groups) == 1:
            return _sdpa_decode(q, k_cache, v_cache, tables[:, : groups[0][1]], lens, group, scale)
        out = torch.empty_like(q)
        for rows, width in groups:
            idx = torch.tensor(rows, device=q.device)
            out[idx] = _sdpa_decode(
                q[idx], k_cache, v_cache, tables[idx, :width], lens[idx], group, scale
            )
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillSlice, scale: float):
        kvh, d = k.shape[1], k.shape[2]
        if self._prefill_kernel(q, k_cache, v_cache, p.block_table):
            return self.kernel.prefill_attention_bf16(
                q, k_cache, v_cache, p.block_table, p.ctx_len, scale
            )
        if self.paged_prefill is not None:  # CUDA: off the paged cache, prefix or not
            return self.paged_prefill(q, k_cache, v_cache, p.block_table, p.ctx_len, scale)
        # 4-D inputs: with a batch axis, SDPA takes its fused CPU kernel rather than the
        # math fallback (5x faster on a 1,500-token prompt), and GQA needs no head repeat.
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        # The chunk's own K/V as the cache holds them, so that its rows attend as they will
        # once cached (an fp8 cache rounds them).
        k, v = as_cached(k, k_cache.dtype), as_cached(v, v_cache.dtype)
        own_k, own_v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        gqa = q.shape[1] != kvh
        if not p.has_prefix:
            o = F.scaled_dot_product_attention(
                qh, own_k, own_v, is_causal=True, scale=scale, enable_gqa=gqa
            )
            return o[0].transpose(0, 1)
        # A later chunk: its queries see the whole cached prefix, and their own chunk causally.
        offset = p.ctx_len - p.q_len
        block_size = k_cache.shape[1]
        blocks = p.block_table[: (offset + block_size - 1) // block_size]
        pre_k = k_cache[blocks].view(-1, kvh, d)[:offset].transpose(0, 1).unsqueeze(0)
        pre_v = v_cache[blocks].view(-1, kvh, d)[:offset].transpose(0, 1).unsqueeze(0)
        pre_k, pre_v = pre_k.to(q.dtype), pre_v.to(q.dtype)  # from an fp8 cache: exact
        if q.device.type == "cpu":
            # Two mask-free flash passes merged by their log-sum-exps: an explicit mask makes
            # the kernel read it and compute every masked score (1.5x slower at 2k tokens).
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            o_pre, lse_pre = flash(qh, pre_k, pre_v, 0.0, False, scale=scale)
            o_own, lse_own = flash(qh, own_k, own_v, 0.0, True, scale=scale)
            w = torch.sigmoid(lse_pre - lse_own).unsqueeze(-1)  # the prefix's share
            o = torch.lerp(o_own.float(), o_pre.float(), w).to(q.dtype)
            return o[0].transpose(0, 1)
        keys, values = torch.cat([pre_k, own_k], 2), torch.cat([pre_v, own_v], 2)
        # Query i sits at absolute position offset + i and sees keys up to it.
        qpos = torch.arange(p.q_len, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(p.ctx_len, device=q.device).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        return o[0].transpose(0, 1)


def _triton_prefill(device: torch.device, shape: HeadShape | None):
    """The Triton prefill kernel, once its first launch at the model's shapes has passed;
    else None (chunks go to SDPA), said once."""
    from workers.model.attention.triton_prefill import paged_prefill_attention, prefill_refusal

    if shape is None:
        return None
    why = prefill_refusal(
        device, shape.dtype, shape.heads, shape.kv_heads, shape.head_dim, shape.block_size
    )
    if why is not None:
        log.warning("no Triton prefill kernel (%s): prompt chunks run on SDPA", why)
        return None
    return paged_prefill_attention


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The values a cache of `cache_dtype` holds for `x`, in x's dtype: x itself, or for an
    fp8 cache x rounded to e4m3, saturating at +-448 as the CPU kernels write it (torch's
    own conversion turns anything past 464 into NaN)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(cache_dtype).to(x.dtype)


def paged_blocks_contiguous(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What the kernels ask of a layer's cache pair: alike, each block contiguous."""
    _, block_size, kvh, d = k_cache.shape
    return (
        k_cache.shape == v_cache.shape
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride()[1:] == (kvh * d, d, 1)
        and k_cache.stride(0) >= block_size * kvh * d
    )


def _length_groups(lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Rows grouped by the power of two at or above their block count: (rows, blocks to
    gather for each). A row's group gathers fewer than twice the blocks it needs."""
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lens):
        need = -(-n // block_size)
        groups.setdefault(1 << (need - 1).bit_length(), []).append(row)
    return [(rows, width) for width, rows in sorted(groups.items())]


def _sdpa_decode(q, k_cache, v_cache, tables, lens, group: int, scale: float):
    """Rows of like length: their blocks gathered (`tables` cut to the group's width), keys
    past each row's length masked."""
    batch, width = tables.shape
    _, block_size, kvh, d = k_cache.shape
    length = width * block_size
    mask = (torch.arange(length, device=lens.device)[None, :] < lens[:, None]).view(
        batch, 1, 1, length
    )
    keys = k_cache[tables].view(batch, length, kvh, d).transpose(1, 2).to(q.dtype)
    values = v_cache[tables].view(batch, length, kvh, d).transpose(1, 2).to(q.dtype)
    qg = q.view(batch, kvh, group, d)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(batch, kvh * group, d)
