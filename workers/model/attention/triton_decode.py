"""Paged decode attention as a Triton kernel: one query token per row against the KV blocks
its block table names, for CUDA machines without flash-attn.

The contract is the CPU kernel's (csrc/paged_attention_cpu.cpp `paged_decode_attention`) and
`TorchAttentionBackend._decode`'s. Each row's length is read from `context_lens` on the
device: no host sync, no data-dependent shape, so the launch can be captured in a CUDA graph.

Flash-decoding: a row's context is cut into splits of SPLIT_TOKENS tokens (more where a
row's length would need more than MAX_SPLITS), one program per (row, KV head, split), so that
a batch of few rows at long contexts still fills the GPU (one row of an 8B model has 8 KV
heads; an H200 has 132 SMs). A row of one split writes its output directly, exactly as an
unsplit kernel would; a longer row's splits write their partial outputs and log-sum-exps,
which a second kernel merges in split order. How a row is split depends on its own length
alone, never on the batch or the grid: a row comes out the same bits whatever shares its
batch.
"""

from __future__ import annotations

import math

import torch

from workers.model.attention.triton_tiles import (
    MAX_HEAD_DIM,
    check_paged_cache,
    paged_kv_tile,
    softmax_step,
)
from workers.model.triton_base import (
    IMPORT_ERROR,
    as_operand,
    first_launch_failure,
    interpreting,
    jit,
    tl,
    triton,
)

GROUP_PAD = 16  # tl.dot wants M >= 16: a query group is padded to 16 rows (the kernel's 16)
SPLIT_TOKENS = 256  # a split's tokens (a multiple of every tile): 16 splits fill 128 SMs at 4k
MAX_SPLITS = 16  # past SPLIT_TOKENS * MAX_SPLITS tokens, a row's splits grow instead


@jit
def _split_len(length, TILE: tl.constexpr, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Tokens per split of a row of `length` tokens: SPLIT, or more (whole tiles) so that
    the row needs at most MAX_SPLITS. A function of the length alone."""
    per = tl.cdiv(tl.cdiv(length, MAX_SPLITS), TILE) * TILE
    return tl.maximum(per, SPLIT)


# One compiled kernel whatever the split count (1 and 16 would each get their own).
@jit(do_not_specialize=["n_splits"])
def _decode_kernel(
    q, k_cache, v_cache, tables, lens, out, part_o, part_lse, scale_log2,
    q_sb, q_sh, c_sn, c_st, c_sh, t_sb, o_sb, o_sh, n_splits,
    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIM_P: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens + row)
    per = _split_len(length, TILE, SPLIT, MAX_SPLITS)
    first = split * per
    if (first < length) | (split == 0):  # past the row's last split: nothing to do
        g, d, offs = tl.arange(0, 16), tl.arange(0, DIM_P), tl.arange(0, TILE)
        d_ok = d < DIM
        head = kvh * GROUP + g
        q_ok = (g < GROUP)[:, None] & d_ok[None, :]
        qg = tl.load(q + row * q_sb + head[:, None] * q_sh + d[None, :], mask=q_ok, other=0.0)
        if UPCAST:
            qg = qg.to(tl.float32)
        dtype = out.dtype.element_ty
        m_i = tl.full([16], float("-inf"), tl.float32)
        l_i = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, DIM_P], tl.float32)
        end = tl.minimum(first + per, length)
        for start in range(first, end, TILE):
            pos = start + offs
            live = pos < end
            k, v = paged_kv_tile(
                k_cache, v_cache, tables + row * t_sb, pos, live, d, d_ok, kvh, c_sn, c_st,
                c_sh, BLOCK_SIZE, UPCAST,
            )  # fmt: skip
            s = tl.dot(qg, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(live[None, :], s, float("-inf"))  # every tile has a live position
            m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, dtype, UPCAST, PRECISION)
        if length <= per:  # the row's only split: its output, as an unsplit kernel writes it
            o = as_operand(acc / l_i[:, None], dtype, UPCAST)
            tl.store(out + row * o_sb + head[:, None] * o_sh + d[None, :], o.to(dtype), mask=q_ok)
        else:  # a partial output in fp32 and its log2-sum-exp, for the merge
            at = ((row * tl.num_programs(1) + kvh) * n_splits + split) * GROUP + g
            mine = g < GROUP
            tl.store(
                part_o + at[:, None] * DIM_P + d[None, :], acc / l_i[:, None], mask=mine[:, None]
            )
            tl.store(part_lse + at, m_i + tl.log2(l_i), mask=mine)


@jit(do_not_specialize=["n_splits"])
def _merge_kernel(
    lens, out, part_o, part_lse, o_sb, o_sh, n_splits,
    GROUP: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr, TILE: tl.constexpr,
    SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Each split row's partial outputs, weighted by their share of its softmax, in split
    order; rows of one split were written whole by the decode kernel."""
    row, kvh = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens + row)
    per = _split_len(length, TILE, SPLIT, MAX_SPLITS)
    splits = tl.cdiv(length, per)
    if splits > 1:
        g, d = tl.arange(0, 16), tl.arange(0, DIM_P)
        mine = g < GROUP
        base = (row * tl.num_programs(1) + kvh) * n_splits
        top = tl.full([16], float("-inf"), tl.float32)
        for i in range(0, splits):
            lse = tl.load(part_lse + (base + i) * GROUP + g, mask=mine, other=0.0)
            top = tl.maximum(top, lse)
        total = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, DIM_P], tl.float32)
        for i in range(0, splits):
            at = (base + i) * GROUP + g
            w = tl.exp2(tl.load(part_lse + at, mask=mine, other=0.0) - top)
            o = tl.load(part_o + at[:, None] * DIM_P + d[None, :], mask=mine[:, None], other=0.0)
            acc += o * w[:, None]
            total += w
        head = kvh * GROUP + g
        ok = (g < GROUP)[:, None] & (d < DIM)[None, :]
        dtype = out.dtype.element_ty
        o = as_operand(acc / total[:, None], dtype, UPCAST)
        tl.store(out + row * o_sb + head[:, None] * o_sh + d[None, :], o.to(dtype), mask=ok)


def triton_refusal(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str | None:
    """Why the kernel cannot serve a model of these shapes on `device`; None if it can.
    Beyond the shapes it takes and triton's presence, it is launched once at these shapes, so
    that a kernel that cannot compile here (no C compiler in the image, a GPU this triton does
    not know) is found at start, not at the first decode step."""
    group = heads // kv_heads if kv_heads else 0
    if not kv_heads or heads % kv_heads or not 1 <= group <= GROUP_PAD:
        return (
            f"{heads} query heads over {kv_heads} KV heads: the kernel takes groups of "
            f"1..{GROUP_PAD}"
        )
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: the kernel takes up to {MAX_HEAD_DIM}"

    def launch() -> None:
        q = torch.zeros(1, heads, head_dim, dtype=dtype, device=device)
        cache = torch.zeros(1, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(1, 1, dtype=torch.long, device=device)
        lens = torch.ones(1, dtype=torch.long, device=device)
        paged_decode_attention(q, cache[:, 0], cache[:, 1], tables, lens, 1.0)

    return first_launch_failure(launch, device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row i of q [B, H, D] attends to the first context_lens[i] tokens that block_tables[i]
    addresses in k_cache/v_cache [num_blocks, block_size, KVH, D]; query head h reads KV
    head h // (H // KVH). Returns [B, H, D] in q's dtype, written into `out` when given."""
    if triton is None:  # callers ask triton_unavailable() first; this is the hot path
        raise RuntimeError(f"triton paged decode attention: {IMPORT_ERROR}")
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if heads != group * kv_heads or group > GROUP_PAD:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: need a group of 1..16")
    check_paged_cache(q, k_cache, v_cache)
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables must be [B, W] and context_lens [B]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must be like q: [B, H, D], its dtype, contiguous in D")
    if batch == 0:
        return out
    dim_p = max(16, triton.next_power_of_2(dim))
    # 64 tokens a tile while a token's K row is at most 256 bytes (bf16 D<=128, fp32 D<=64),
    # else 32, so K and V tiles stay small. From the shapes alone: batch-invariant.
    tile = 64 if dim_p * q.element_size() <= 256 else 32
    # 8 warps for tiles over 16 KiB (fp32, D>128), which take 234 registers a thread at 4.
    warps = 4 if tile * dim_p * q.element_size() <= 16384 else 8
    # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584):
    # there, operands go in as fp32 holding the values a GPU would feed its tensor cores.
    upcast = interpreting()
    # The grid covers the longest row the tables can address (a shape, so a graph's launch
    # fits every replay); programs past a row's own splits return at once.
    reach = block_tables.shape[1] * block_size
    splits = min(MAX_SPLITS, max(1, -(-reach // SPLIT_TOKENS)))
    # Never written where no row can span two splits (but always fp32: one compiled kernel).
    part_o = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    if splits > 1:  # [batch, KV heads, splits, group, DIM_P]: 64 MiB at 8B's 256 x 8k
        work = torch.empty(
            batch * kv_heads * splits * group * (dim_p + 1), dtype=torch.float32, device=q.device
        )
        part_o, part_lse = work.split(
            [batch * kv_heads * splits * group * dim_p, batch * kv_heads * splits * group]
        )
    sizes = dict(
        GROUP=group, DIM=dim, DIM_P=dim_p, TILE=tile, SPLIT=SPLIT_TOKENS, MAX_SPLITS=MAX_SPLITS
    )
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), splits,
        BLOCK_SIZE=block_size, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=upcast, **sizes,
        num_warps=warps, enable_fp_fusion=True,  # fusion pinned: 3.10 changes the default
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, kv_heads)](
            context_lens, out, part_o, part_lse, out.stride(0), out.stride(1), splits,
            UPCAST=upcast,
            **sizes, num_warps=4, enable_fp_fusion=True,
        )  # fmt: skip
    return out
