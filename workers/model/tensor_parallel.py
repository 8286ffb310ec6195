"""Tensor parallelism, Megatron-style: what each of a worker's `tp` ranks holds of the model,
and the collectives that join their partial results.

- Attention is split by KV-head groups: a rank holds whole KV heads and the query heads that
  read them, so its attention needs nothing from the others. Where tp is at most the KV
  heads, the KV heads are dealt out in contiguous runs whose sizes differ by at most one
  (SmolLM2's 3 KV heads over 2 ranks: 2 and 1, with 6 and 3 query heads); where tp exceeds
  them, each KV head is repeated on tp / kv_heads ranks, which split its query heads.
- QKV and gate-up are column-parallel (each rank its own output rows); O and down are
  row-parallel (each rank its own inputs), so each is followed by one all-reduce.
- The embedding and lm_head are vocab-parallel: a rank looks up the ids in its range (an
  all-reduce joins them) and computes the logits of its range (an all-gather joins them, so
  sampling sees the whole vocabulary).

Each rank's model is built with `local_config`: the same architecture with its own heads and
MLP width, which every kernel already takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers.model.config import ModelConfig


def tp_refusal(cfg: ModelConfig, tp: int) -> str | None:
    """Why a model cannot be split over `tp` ranks, or None."""
    if tp == 1:
        return None
    if tp > cfg.num_kv_heads:
        if tp % cfg.num_kv_heads or cfg.num_heads % tp:
            return (
                f"tp={tp} exceeds the model's {cfg.num_kv_heads} KV heads, so each KV head "
                f"is repeated: tp must then be a multiple of {cfg.num_kv_heads} and divide "
                f"its {cfg.num_heads} attention heads"
            )
    chunk = -(-cfg.vocab_size // tp)
    if tp > cfg.intermediate_size or chunk * (tp - 1) >= cfg.vocab_size:
        return f"tp={tp} leaves a rank no part of the model's MLP or vocabulary"
    return None


def _split(total: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` contiguous runs of `total`, sizes differing by at most one,
    the larger first: (start, length)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the rows and columns of each weight it holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # (first query head, how many)
    kv_heads: tuple[int, int]  # (first KV head, how many)
    mlp: tuple[int, int]  # (first MLP channel, how many)
    vocab: tuple[int, int]  # (first token id, how many)
    vocab_chunk: int  # every rank's logits are padded to this many columns for the gather

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        if (why := tp_refusal(cfg, size)) is not None:
            raise ValueError(why)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        if size <= cfg.num_kv_heads:
            kv = _split(cfg.num_kv_heads, size, rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            repeat = size // cfg.num_kv_heads
            kv = (rank // repeat, 1)
            per = cfg.num_heads // size
            q = (rank * per, per)
        chunk = -(-cfg.vocab_size // size)
        start = min(rank * chunk, cfg.vocab_size)
        vocab = (start, min(chunk, cfg.vocab_size - start))
        return cls(rank, size, q, kv, _split(cfg.intermediate_size, size, rank), vocab, chunk)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this rank's layers see it: its own heads and MLP width."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(
            cfg,
            num_heads=self.q_heads[1],
            num_kv_heads=self.kv_heads[1],
            intermediate_size=self.mlp[1],
        )

    def rows(self, part: str, cfg: ModelConfig) -> tuple[int, int]:
        """(start, length) along a checkpoint tensor's split dimension: 'q', 'kv' (in rows of
        head_dim each), 'mlp' or 'vocab'."""
        if part == "q":
            return self.q_heads[0] * cfg.head_dim, self.q_heads[1] * cfg.head_dim
        if part == "kv":
            return self.kv_heads[0] * cfg.head_dim, self.kv_heads[1] * cfg.head_dim
        return getattr(self, part)


class Collectives:
    """The all-reduce and all-gather a tensor-parallel model needs, over one process group
    (gloo on the CPU, NCCL on CUDA); `Collectives.single()` for one rank, which does
    nothing."""

    def __init__(self, group=None, size: int = 1) -> None:
        self.group, self.size = group, size

    @classmethod
    def single(cls) -> Collectives:
        return cls()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place in `t` (returned)."""
        if self.size > 1:
            self.group.allreduce([t]).wait()
        return t

    def broadcast_first(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank, in place (the others give a tensor of its shape)."""
        if self.size > 1:
            self.group.broadcast(t, 0).wait()
        return t

    def all_gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Each rank's `[rows, <= chunk]` columns side by side, `[rows, width]`: every rank's
        part padded to the same chunk for the gather, the padding dropped."""
        if self.size == 1:
            return t
        chunk = -(-width // self.size)
        if t.shape[-1] != chunk:
            t = torch.nn.functional.pad(t, (0, chunk - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, :width]
