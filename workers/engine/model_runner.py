"""Runs one scheduled step on the model: flattens the step into rows, builds the attention
metadata, runs the decoder, computes logits only for rows that sample, and samples.

It owns the device KV cache: per layer one tensor of `[num_blocks, 2, block_size,
num_kv_heads, head_dim]`, a block's K and V side by side, which the KV transfer moves a run
of blocks at a time; the attention backends read it as a (K, V) pair of views.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kv_transfer.layout import KVLayout
from workers.engine.cuda_graphs import DecodeGraphs, GraphCapture
from workers.engine.grammar import GrammarMasks
from workers.engine.request import choice_id, choice_seed
from workers.engine.sampler import Penalties, SamplingTensors, sample
from workers.engine.scheduler_output import SampledToken, ScheduledRequest, SchedulerOutput
from workers.model.attention import AttentionMetadata, PrefillSlice, select_backend
from workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphSettings:
    """What decode graphs are captured for: batches up to max_batch rows, sequences up to
    max_model_len tokens. `make_graph`: how one graph is captured (None: a CUDA graph)."""

    max_batch: int
    max_model_len: int
    make_graph: Callable[[], GraphCapture] | None = None


def allocate_kv_cache(layout: KVLayout, num_blocks: int, device: torch.device):
    """Each layer's cache, `layout.layer_shape(num_blocks)`: a block's K and V side by side,
    so that a run of blocks is one contiguous region (one message for a KV transfer). The
    attention backends take it as a (K, V) pair of views (`kv_pair`)."""
    shape = layout.layer_shape(num_blocks)
    dtype = getattr(torch, layout.dtype)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]


def kv_pair(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V caches, `[num_blocks, block_size, kv_heads, dim]` views of it."""
    return layer[:, 0], layer[:, 1]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
        graphs: GraphSettings | None = None,
    ) -> None:
        """`graphs`: replay decode steps from CUDA graphs (when the backend allows it)."""
        cfg = model.cfg
        self.model = model
        self.device = device
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        self.backend = select_backend(
            attention_backend,
            device,
            dtype,
            block_size,
            cfg.head_dim,
            (cfg.num_heads, cfg.num_kv_heads),
        )
        self.backend.check_block_size(block_size)
        dtype_name = str(dtype).removeprefix("torch.")
        self.layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype_name
        )
        self.graphs: DecodeGraphs | None = None
        # Set by the engine once a constrained request arrives; the helper thread that builds
        # the masks starts with the first such step.
        self.grammar: GrammarMasks | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        use_graphs = graphs is not None and self.backend.graph_safe
        # With graphs, one more block than the pool hands out: the padding rows' (never
        # allocated, so never read by a request).
        self.kv_layers = allocate_kv_cache(self.layout, num_blocks + use_graphs, device)
        self.kv_caches = [kv_pair(layer) for layer in self.kv_layers]
        if use_graphs:
            self.graphs = DecodeGraphs(
                self._forward,
                graphs.max_batch,
                -(-graphs.max_model_len // block_size),
                graphs.max_model_len,
                block_size,
                num_blocks,
                device,
                graphs.make_graph,
            )
            self.graphs.capture()
        elif graphs is not None:
            log.info("decode steps run eagerly: backend %s is not graph-safe", self.backend.name)

    def _forward(self, input_ids, positions, meta, layer_done=None) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, self.backend, meta, layer_done)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, layer_done=None) -> list[SampledToken]:
        """One step; `layer_done(i)`, if given, is called as each layer has written its KV."""
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        scheduled = out.scheduled
        input_ids, positions, slots = [], [], []
        for s in scheduled:
            input_ids += s.token_ids
            positions += range(s.start_position, s.context_len)
            slots += self._slots(s.block_ids, s.start_position, s.context_len)
        dev = self.device
        rows, samplers, offset = [], [], 0
        for s in scheduled:
            offset += s.num_tokens
            if s.sample:
                rows.append(offset - 1)
                samplers.append(s)
                for i in s.forks:  # the other choices draw from the same logits
                    rows.append(offset - 1)
                    samplers.append(fork_row(s, i))
        # Constrained rows' masks are built on a helper thread while the model runs.
        masks = self._start_masks(samplers)
        try:
            if self._replays(out, layer_done):
                tables = [s.block_ids for s in out.decodes]
                lens = [s.context_len for s in out.decodes]
                hidden = self.graphs.run(input_ids, positions, slots, tables, lens)
            else:
                hidden = self._forward(
                    torch.tensor(input_ids, dtype=torch.long, device=dev),
                    torch.tensor(positions, dtype=torch.long, device=dev),
                    self._metadata(out, slots),
                    layer_done,
                )
            if not rows:
                return []
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
            t = sampling_tensors(samplers, logits.shape[-1], dev)
            if masks is not None:
                filled = masks.result()
                t.allowed = (
                    torch.tensor(filled.rows, dtype=torch.long, device=dev),
                    self.grammar.allowed(filled, logits.shape[-1]),
                )
            result = sample(logits, t)
            ids = result.token_ids.tolist()
            if masks is not None:
                for s, tok in zip(samplers, ids):
                    if s.sampling.constraint is not None:
                        self.grammar.advance(s.request_id, tok)
        finally:  # a step that raised leaves no fill running beside the next one
            if masks is not None:
                masks.exception()
        lps = result.logprobs.tolist() if result.logprobs is not None else [None] * len(ids)
        tops = [None] * len(ids)
        if result.top_ids is not None:
            tops = [
                tuple(zip(t, v))
                for t, v in zip(result.top_ids.tolist(), result.top_logprobs.tolist())
            ]
        return [
            SampledToken(
                s.request_id,
                tok,
                lp if s.sampling.logprobs else None,
                top[: s.sampling.top_logprobs] if s.sampling.top_logprobs else None,
            )
            for s, tok, lp, top in zip(samplers, ids, lps, tops)
        ]

    def _start_masks(self, samplers: list[ScheduledRequest]) -> Future | None:
        """The grammar masks of the constrained rows, being built on the helper thread."""
        rows = [
            (i, s.request_id, s.sampling.constraint, s.output_ids, s.num_output_tokens)
            for i, s in enumerate(samplers)
            if s.sampling.constraint is not None
        ]
        if not rows:
            return None
        assert self.grammar is not None, "a constrained request reached an engine without grammars"
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        return self._mask_thread.submit(self.grammar.fill, rows)

    def _replays(self, out: SchedulerOutput, layer_done) -> bool:
        """Whether this step replays a graph: decodes alone, within the largest bucket, and
        nobody waiting on its layers one by one (a KV push streams them)."""
        return (
            self.graphs is not None
            and layer_done is None
            and not out.prefills
            and self.graphs.bucket(len(out.decodes)) is not None
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) pair, in every layer's K and V."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for layer in self.kv_layers:  # K and V of a block together
            layer.index_copy_(0, dst, layer.index_select(0, src))

    def export_layer(self, layer: int, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of one layer of these blocks, `layout.layer_shape(n)` (into `out` if
        given). The caller must hold the blocks."""
        cache = self.kv_layers[layer]
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        return torch.index_select(cache, 0, idx, out=out) if out is not None else cache[idx]

    def import_layer(self, layer: int, block_ids, data: torch.Tensor) -> None:
        """Write `export_layer`'s copy of one layer into (reserved) blocks."""
        cache = self.kv_layers[layer]
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        scatter_rows(cache, idx, data.to(cache.device), self.model.ops)

    def write_blocks(self, cache: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole blocks into a layer's cache (`kv_layers`), at block ids `idx`."""
        scatter_rows(cache, idx, rows, self.model.ops)

    def read_blocks(self, cache: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Whole blocks out of a layer's cache, at block ids `idx`, into `out`: on the CPU on
        the calling thread alone (the kernel), so a transfer thread starts no OpenMP team."""
        ops = self.model.ops
        if ops is not None and cache.device.type == "cpu":
            ops.gather_blocks(out, idx, cache)
        else:
            torch.index_select(cache, 0, idx, out=out)

    def _slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, out: SchedulerOutput, slots: list[int]) -> AttentionMetadata:
        dev = self.device
        decode_tables = decode_lens = None
        host_lens = tuple(s.context_len for s in out.decodes)
        if out.decodes:
            width = max(len(s.block_ids) for s in out.decodes)
            # One tensor from padded lists, not one small tensor per sequence per step.
            padded = [s.block_ids + [0] * (width - len(s.block_ids)) for s in out.decodes]
            decode_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            decode_lens = torch.tensor([s.context_len for s in out.decodes], device=dev)
        prefills, row = [], len(out.decodes)
        for s in out.prefills:
            table = torch.tensor(s.block_ids, dtype=torch.long, device=dev)
            out_rows = min(s.num_tokens, max(0, s.context_len - len(s.prompt_ids)))
            prefills.append(PrefillSlice(row, s.num_tokens, s.context_len, table, out_rows))
            row += s.num_tokens
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(out.decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
            decode_lens_host=host_lens,
            max_decode_len=max(host_lens, default=0),
        )


def scatter_rows(cache: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, ops=None) -> None:
    """`cache[idx[i]] = rows[i]` for whole blocks. With the CPU kernels (`ops`), a memcpy per
    block: index_copy_ goes element by element, at a fifth of the speed."""
    if ops is not None and cache.device.type == "cpu" and cache.is_contiguous():
        ops.scatter_blocks(cache, idx, rows)
    else:
        cache.index_copy_(0, idx, rows)


def fork_row(s: ScheduledRequest, index: int) -> ScheduledRequest:
    """The row of choice `index`, drawing its first token beside choice 0."""
    return dataclasses.replace(
        s,
        request_id=choice_id(s.request_id, index),
        seed=choice_seed(s.seed, index),
        forks=(),
    )


def sampling_tensors(reqs: list[ScheduledRequest], vocab: int, dev) -> SamplingTensors:
    """The batch's sampling parameters as tensors; the optional parts only when a row uses
    them, so that a plain batch pays for none."""
    params = [s.sampling for s in reqs]

    def col(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=dev)

    t = SamplingTensors(
        temperature=col([p.temperature for p in params]),
        top_k=col([max(p.top_k, 0) for p in params], torch.long),
        top_p=col([p.top_p for p in params]),
        seeds=col([s.seed & (2**63 - 1) for s in reqs], torch.long),
        counters=col([s.num_output_tokens for s in reqs], torch.long),
        all_greedy=all(p.greedy for p in params),
        any_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        want_logprobs=any(p.logprobs for p in params),
        top_logprobs=max(p.top_logprobs for p in params),
    )
    if any(p.min_p > 0 for p in params):
        t.min_p = col([p.min_p for p in params])
    edits = []  # (row, token id, value)
    for i, s in enumerate(reqs):
        sp = s.sampling
        edits += [(i, token, bias) for token, bias in sp.logit_bias if token < vocab]
        if s.num_output_tokens < sp.min_tokens:
            # A constrained row's grammar alone says where EOS may come.
            free = sp.ignore_eos or sp.constraint is not None
            banned = set(sp.stop_token_ids) | (set() if free else set(s.eos_token_ids))
            edits += [(i, token, float("-inf")) for token in sorted(banned) if token < vocab]
    if edits:
        rows, cols, values = zip(*edits)
        t.logit_edits = (col(rows, torch.long), col(cols, torch.long), col(values))
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        # Token counts over each penalized row's output, and which tokens its prompt holds.
        counts = torch.zeros((len(penalized), vocab), dtype=torch.float32, device=dev)
        in_prompt = torch.zeros((len(penalized), vocab), dtype=torch.bool, device=dev)
        for r, i in enumerate(penalized):
            out = col(reqs[i].output_ids[: reqs[i].num_output_tokens], torch.long)
            counts[r].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            in_prompt[r, col(reqs[i].prompt_ids, torch.long)] = True
        t.penalties = Penalties(
            rows=col(penalized, torch.long),
            presence=col([params[i].presence_penalty for i in penalized]),
            frequency=col([params[i].frequency_penalty for i in penalized]),
            repetition=col([params[i].repetition_penalty for i in penalized]),
            output_counts=counts,
            in_prompt=in_prompt,
        )
    return t
