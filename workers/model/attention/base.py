"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened into one row per token: first every decode (one query token per
sequence), then the prefill chunks, each a contiguous run of rows. The KV cache of a layer is a
pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`, views of one
`[num_blocks, 2, block_size, num_kv_heads, head_dim]` allocation (K and V of a block side by
side, so a run of blocks is one contiguous region: a KV transfer moves it as one message).
Each block is contiguous; blocks lie `stride(0)` apart. Token `t` of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HeadShape:
    """What a backend must know of the model before its first step: its heads, their size,
    and the cache's block size and dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass
class PrefillSlice:
    """One sequence's prefill chunk within the step.

    `out_rows`: how many of the chunk's last rows sit at the sequence's output positions: the
    tokens it generated before, computed again by a replay or after a preemption. A backend
    that can attends them as the decode steps that first computed them did (`output_part`),
    so that their K/V and the next token's logits come out bit for bit as they did the first
    time, and a replayed greedy request ends as one that never stopped (G2).
    """

    q_start: int  # first row of the chunk in the flattened step
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks_of_sequence], int64
    out_rows: int = 0
    _output_part: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def has_prefix(self) -> bool:
        return self.ctx_len > self.q_len

    def prompt_part(self) -> PrefillSlice:
        """The chunk's rows at prompt positions, as a chunk of their own."""
        return PrefillSlice(
            self.q_start, self.q_len - self.out_rows, self.ctx_len - self.out_rows, self.block_table
        )

    def output_part(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at output positions as a batch of single-token decodes over this sequence's
        blocks: (block tables `[out_rows, blocks]`, context lengths `[out_rows]`), each row
        seeing the keys up to its own position. Built once a step, for every layer."""
        if self._output_part is None:
            n, table = self.out_rows, self.block_table
            lens = torch.arange(self.ctx_len - n + 1, self.ctx_len + 1, device=table.device)
            self._output_part = (table.expand(n, -1).contiguous(), lens)
        return self._output_part


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each row
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # [B] tokens in cache including this step's
    prefills: list[PrefillSlice]
    # The decodes' context lengths as the host knows them (empty in a CUDA graph, whose
    # lengths change at every replay), and a bound on them that holds for every replay.
    decode_lens_host: tuple[int, ...] = ()
    max_decode_len: int = 0
    # Flash-attn varlen inputs, built only by that backend (once per step, for all layers).
    extra: dict | None = None
    # (block, offset) of each row's slot, for writing K/V with torch ops (see slot_index).
    slot_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    # The step's K/V are in the cache already (fused layer ops wrote them with the rotary):
    # the backend writes nothing.
    kv_written: bool = False

    def slot_index(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`cache[meta.slot_index(bs)] = k` writes a step's new K rows into their slots (in a
        cache whose blocks may lie apart); derived once a step, for every layer."""
        if self.slot_blocks is None:
            self.slot_blocks = slot_index(self.slot_mapping, block_size)
        return self.slot_blocks


def slot_index(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids as (block, offset) index tensors into a `[blocks, block_size, ...]` cache."""
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache (unless `meta.kv_written`), then attends
    over it.

    Invariants: the backend never allocates or frees blocks (the scheduler owns them); it writes
    exactly the slots in `slot_mapping` and reads only blocks listed in the step's block tables.
    """

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError if this backend cannot address blocks of this size."""

    @property
    def graph_safe(self) -> bool:
        """Whether a step of decodes alone runs with no host synchronisation and no shape
        that depends on the data (context lengths only on the device, `decode_lens_host`
        unused), so that it can be captured in a CUDA graph and replayed."""
        return False
