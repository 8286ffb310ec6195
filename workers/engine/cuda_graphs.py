"""Decode steps replayed from CUDA graphs, as vLLM does: a decode step of a small model is a
few hundred kernel launches of a few microseconds each, and launching them from Python costs
more than running them. One graph is captured per batch-size bucket (1, 2, 4, 8, then every
8 up to the batch limit); a step of B decodes runs the graph of the smallest bucket >= B, its
rows past B padded.

A graph replays the same kernels on the same memory, so every input lives in a static buffer
that is filled before each replay: token ids, positions, the slot each row's K/V goes to, the
block tables and the context lengths. Padding rows read and write only the null block, a KV
block the block pool never hands out. The attention backend must be graph-safe (no host
synchronisation, no shape that depends on the data): flash-attn, or the Triton kernel.

`GraphCapture` is what captures and replays one graph. On CUDA it is a `torch.cuda.CUDAGraph`;
tests on the CPU use `EagerReplay`, which re-runs the captured function on the same static
buffers, so the bucketing, padding and buffer plumbing are checked without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from workers.model.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8, up to max_batch
    (which is always one)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `fn` once; returns its output tensor, which each replay rewrites."""

    def replay(self) -> None:
        """Run what was recorded again, on the buffers' current contents."""


class CudaGraph:
    """One `torch.cuda.CUDAGraph`; graphs of one runner share a memory pool."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels), as
        # torch's documentation asks: nothing of that may happen inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerReplay:
    """A stand-in for CPU tests: replaying runs `fn` again and writes its result where the
    captured output lives, reading the same static buffers a CUDA graph would."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class DecodeGraphs:
    """Decode-only steps of one model on its KV cache, replayed from captured graphs.

    Called from the engine's loop thread alone (capture at start, then `run` per step)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        null_block: int,
        device: torch.device,
        make_graph: Callable[[], GraphCapture] | None = None,
    ) -> None:
        """`forward(input_ids, positions, meta)`: the model's hidden states for a decode
        step. `null_block`: the KV block padding rows use (never allocated to a request)."""
        self.forward = forward
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.block_size, self.null_block = block_size, null_block
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slots = torch.full((max_batch,), null_block * block_size, **long)
        self.tables = torch.full((max_batch, max_blocks), null_block, **long)
        self.lens = torch.ones(max_batch, **long)
        self.graphs: dict[int, tuple[GraphCapture, torch.Tensor]] = {}
        self._width = max_blocks  # columns of `tables` that may hold a real block id

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, the largest first (the smaller ones reuse its memory)."""
        for size in reversed(batch_buckets(self.max_batch)):
            graph = self.make_graph()
            out = graph.capture(lambda b=size: self._forward(b))
            self.graphs[size] = (graph, out)
        log.info("decode steps: CUDA graphs for batch sizes %s", sorted(self.graphs))

    def bucket(self, batch: int) -> int | None:
        """The captured size a batch of this many decodes runs in, or None (too big)."""
        return next((b for b in sorted(self.graphs) if b >= batch), None)

    def padded(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
    ) -> tuple[list[int], list[int], list[int], list[list[int]], list[int]]:
        """A decode step's columns (at most the largest bucket's rows, each block table no
        wider than max_blocks), padded to its bucket: each padding row one token at position
        0 in the null block; the tables to their widest row, with the null block."""
        pad = self.bucket(len(input_ids)) - len(input_ids)
        width = max(len(t) for t in tables)
        null, slot = self.null_block, self.null_block * self.block_size
        return (
            input_ids + [0] * pad,
            positions + [0] * pad,
            slots + [slot] * pad,
            [t + [null] * (width - len(t)) for t in tables] + [[null] * width] * pad,
            lens + [1] * pad,
        )

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of a decode step from `padded`'s columns, on the device: copied into
        the graph's buffers on the device (no wait for the host), then replayed."""
        size, width = tables.shape
        graph, out = self.graphs[size]
        self.input_ids[:size].copy_(input_ids)
        self.positions[:size].copy_(positions)
        self.slots[:size].copy_(slots)
        self.lens[:size].copy_(lens)
        self.tables[:size, :width].copy_(tables)
        # Columns past a row's own blocks are never read; past `width`, older (wider) steps
        # left block ids that name real blocks: cleared when the width shrinks.
        if width < self._width:
            self.tables[:, width : self._width].fill_(self.null_block)
        self._width = width
        graph.replay()
        return out

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.lens[:size],
            prefills=[],
            max_decode_len=self.max_model_len,
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta)
