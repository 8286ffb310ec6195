"""flash-attn over the paged cache (GPU): one varlen call per layer covers every decode and
prefill chunk of the step, reading K/V through `block_table`.

What flash-attn takes (pages of 256 tokens, fp16/bf16) is in workers/model/flash_rules.py: the
engine's config refuses anything else when it loads, and the automatic choice of backend
passes flash-attn over for it. A step of decodes alone builds its inputs on the device, from
the step's tensors, with no host synchronisation: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.flash_rules import flash_refusal

INSTALL = "pip install --no-build-isolation flash-attn (it builds against the installed torch)"


def flash_attn_unavailable() -> str | None:
    """None if flash-attn imports, else why not."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError as e:
        return f"flash-attn is not installed ({e})"
    except Exception as e:  # a wheel built for another torch or CUDA fails here, not at use
        return f"flash-attn does not load ({type(e).__name__}: {e})"
    return None


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        why = flash_attn_unavailable()
        if why is not None:
            raise RuntimeError(
                f"attention_backend='flash-attn': {why}. Install it ({INSTALL}), or set "
                "attention_backend to auto, which uses a paged Triton kernel without it."
            )
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def check_block_size(self, block_size: int) -> None:
        why = flash_refusal(block_size=block_size)
        if why is not None:
            raise ValueError(f"{why} (set block_size: 256)")

    @property
    def graph_safe(self) -> bool:
        return True

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        # A chunk's rows at output positions (PrefillSlice.out_rows) go with the rest of it:
        # flash-attn splits a decode's keys by the batch's shape, so on a GPU a replay's rows
        # would not come out as their first decode steps did either way.
        if not meta.kv_written:
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
    """flash-attn's varlen arguments for the step, built once and shared by every layer."""
    if not meta.prefills:  # on the device alone (a CUDA graph replays this)
        lens = meta.decode_context_lens.to(torch.int32)
        batch = lens.shape[0]
        return {
            "cu_q": torch.arange(batch + 1, dtype=torch.int32, device=device),
            "cu_k": F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)),
            "max_q": 1,
            "max_k": meta.max_decode_len,
            "block_table": meta.decode_block_tables.to(torch.int32),
        }
    q_lens = [1] * meta.num_decode_tokens + [p.q_len for p in meta.prefills]
    k_lens = list(meta.decode_lens_host) + [p.ctx_len for p in meta.prefills]
    tables = [p.block_table for p in meta.prefills]
    width = max([int(t.numel()) for t in tables] + [0])
    if meta.num_decode_tokens:
        width = max(width, meta.decode_block_tables.shape[1])
    table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=device)
    if meta.num_decode_tokens:
        decode = meta.decode_block_tables
        table[: meta.num_decode_tokens, : decode.shape[1]] = decode
    for i, t in enumerate(tables, start=meta.num_decode_tokens):
        table[i, : t.numel()] = t
    cu = torch.zeros(2, len(q_lens) + 1, dtype=torch.int32)
    cu[0, 1:] = torch.tensor(q_lens).cumsum(0)
    cu[1, 1:] = torch.tensor(k_lens).cumsum(0)
    cu = cu.to(device)
    return {
        "cu_q": cu[0],
        "cu_k": cu[1],
        "max_q": max(q_lens),
        "max_k": max(k_lens),
        "block_table": table,
    }
