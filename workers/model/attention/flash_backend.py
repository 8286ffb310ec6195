"""flash-attn over the paged cache (GPU): one varlen call per layer covers every decode and
prefill chunk of the step, reading K/V through `block_table`.

flash-attn 2 addresses paged K/V only in pages whose size is a multiple of 256 tokens, so this
backend refuses smaller KV blocks at start rather than producing garbage.
"""

from __future__ import annotations

import torch

from workers.model.attention.base import AttentionBackend, AttentionMetadata

FLASH_PAGE_MULTIPLE = 256


def import_flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise RuntimeError(
            "the flash-attn attention backend needs the flash-attn package "
            "(pip install 'tandem[gpu]' on a CUDA machine); "
            f"import failed: {e}. Use --attention-backend torch to run without it."
        ) from e
    return flash_attn_varlen_func


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        self._varlen = import_flash_attn()

    def check_block_size(self, block_size: int) -> None:
        if block_size % FLASH_PAGE_MULTIPLE:
            raise ValueError(
                f"block_size={block_size}: the flash-attn backend needs KV blocks whose size is a "
                f"multiple of {FLASH_PAGE_MULTIPLE} (set --block-size 256)"
            )

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        # A chunk's rows at output positions (PrefillSlice.out_rows) go with the rest of it:
        # flash-attn splits a decode's keys by the batch's shape, so on a GPU a replay's rows
        # would not come out as their first decode steps did either way.
        index = meta.slot_index(k_cache.shape[1])
        k_cache[index] = k
        v_cache[index] = v
        if meta.extra is None:
            meta.extra = _varlen_inputs(meta, q.device)
        x = meta.extra
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=x["cu_q"],
            cu_seqlens_k=x["cu_k"],
            max_seqlen_q=x["max_q"],
            max_seqlen_k=x["max_k"],
            softmax_scale=scale,
            causal=True,  # bottom-right aligned: a chunk's queries sit at the end of its keys
            block_table=x["block_table"],
        )


def _varlen_inputs(meta: AttentionMetadata, device: torch.device) -> dict:
    q_lens: list[int] = []
    k_lens: list[int] = []
    tables: list[torch.Tensor] = []
    if meta.num_decode_tokens:
        q_lens += [1] * meta.num_decode_tokens
        k_lens += meta.decode_context_lens.tolist()
        tables += list(meta.decode_block_tables)
    for p in meta.prefills:
        q_lens.append(p.q_len)
        k_lens.append(p.ctx_len)
        tables.append(p.block_table)
    width = max(int(t.numel()) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : t.numel()] = t
    cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_k = torch.zeros(len(k_lens) + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor(q_lens).cumsum(0)
    cu_k[1:] = torch.tensor(k_lens).cumsum(0)
    return {
        "cu_q": cu_q.to(device),
        "cu_k": cu_k.to(device),
        "max_q": max(q_lens),
        "max_k": max(k_lens),
        "block_table": table.to(device),
    }
