"""Runs one scheduled step on the model: flattens the step into rows, builds the attention
metadata, runs the decoder, computes logits only for rows that sample, and samples.

It owns the device KV cache: per layer one tensor of `[num_blocks, 2, block_size,
num_kv_heads, head_dim]`, a block's K and V side by side, which the KV transfer moves a run
of blocks at a time; the attention backends read it as a (K, V) pair of views.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kv_transfer.layout import KVLayout, as_bytes
from workers.engine.cuda_graphs import DecodeGraphs, GraphCapture
from workers.engine.grammar import GrammarMasks
from workers.engine.request import PENDING, SamplingParams, choice_id, choice_seed
from workers.engine.sampler import SamplerOutput, sample
from workers.engine.sampling_inputs import SamplingColumns
from workers.engine.scheduler_output import SampledToken, ScheduledRequest, SchedulerOutput
from workers.engine.step_io import Fetched, StepInputs, fetch
from workers.model.attention import AttentionMetadata, PrefillSlice, select_backend
from workers.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from workers.engine.tp_ranks import RankLink  # which runs a ModelRunner on every rank

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
        kv_dtype: torch.dtype | None = None,
        ranks: RankLink | None = None,
    ) -> None:
        """`graphs`: replay decode steps from CUDA graphs (when the backend allows it).
        `kv_dtype`: the KV cache's, if not the model's (torch.float8_e4m3fn). `ranks`: this
        rank's link to the others of a tensor-parallel engine (tp_ranks.py): rank 0 sends
        them each step it runs, the others run the steps it sends."""
        cfg = model.local_cfg  # this rank's heads, under tp > 1
        self.ranks = ranks
        self.leads = ranks is not None and ranks.rank == 0
        if ranks is not None:
            model.use_collectives(ranks.collectives)
        if self.leads:
            ranks.send(
                (
                    "init",
                    dict(
                        num_blocks=num_blocks,
                        block_size=block_size,
                        attention_backend=attention_backend,
                        kv_dtype=kv_dtype,
                    ),
                )
            )
        if ranks is not None and graphs is not None:
            log.info("decode steps run eagerly: tp %d ranks replay no graphs yet", ranks.size)
            graphs = None
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
        dtype_name = str(kv_dtype or dtype).removeprefix("torch.")
        self.layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype_name
        )
        self.graphs: DecodeGraphs | None = None
        # A GPU's step never waits for the device to decide what to run next (sampler.py's
        # FilterPlan); on a CPU, waiting costs nothing and a cheaper path may be taken.
        self.sync_free = device.type != "cpu"
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
        if self.leads:  # every rank's runner is built (one that failed is gone: this raises)
            ranks.barrier()

    def _forward(self, input_ids, positions, meta, layer_done=None) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, self.backend, meta, layer_done)

    def launch(
        self, out: SchedulerOutput, layer_done=None, prev: LaunchedStep | None = None
    ) -> LaunchedStep:
        """`_launch` (below), on every rank under tp > 1."""
        return self._on_all_ranks(("launch", out), lambda: self._launch(out, layer_done, prev))

    def _on_all_ranks(self, message: tuple, run: Callable[[], object]):
        """`run()` here; under tp > 1, on rank 0, once `message` has told the other ranks to
        run it too. A failure once it is sent fails the ranks for good (`RankLink.fail`):
        they may be waiting in a collective this rank will not make."""
        if not self.leads:
            return run()
        self.ranks.check()
        try:
            self.ranks.send(message)
            return run()
        except BaseException as e:
            self.ranks.fail(f"{type(e).__name__}: {e}")
            raise

    @torch.inference_mode()
    def _launch(
        self, out: SchedulerOutput, layer_done=None, prev: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Queue one step on the device; `layer_done(i)`, if given, is called as each layer
        has written its KV. Its inputs reach the device in one copy (step_io.py) and its
        sampled tokens start back in one; nothing on the way waits for the device, but a
        grammar row's mask (built on the host, and sent as it is).

        A row whose last token is PENDING (a decode scheduled while the step that draws
        that token ran) takes it from `prev`'s sampled ids, on the device.

        Under tp > 1, the other ranks run the same step on their parts and sample nothing:
        rank 0's sampled ids reach them at the end."""
        scheduled = out.scheduled
        input_ids, positions, slots = [], [], []
        fill_at, fill_from = [], []  # rows of PENDING tokens; prev's sampled rows to read
        for s in scheduled:
            if s.token_ids[-1] == PENDING:
                if prev is None or s.request_id not in prev.rows:
                    raise RuntimeError(f"{s.request_id}: its last token was never drawn")
                fill_at.append(len(input_ids) + s.num_tokens - 1)
                fill_from.append(prev.rows[s.request_id])
            input_ids += s.token_ids
            positions += range(s.start_position, s.context_len)
            slots += self._slots(s.block_ids, s.start_position, s.context_len)
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
        follows = self.ranks is not None and not self.leads
        masks = None if follows else self._start_masks(samplers)
        try:
            inputs = StepInputs(self.device)
            copies = [inputs.add([c[i] for c in out.block_copies]) for i in (0, 1)]
            fills = [inputs.add(fill_at), inputs.add(fill_from)] if fill_at else None
            replay = self._replays(out, layer_done)
            if replay:
                tables = [s.block_ids for s in out.decodes]
                lens = [s.context_len for s in out.decodes]
                graph_cols = self.graphs.padded(input_ids, positions, slots, tables, lens)
                step = [inputs.add(c) for c in graph_cols]
            else:
                step = [inputs.add(input_ids), inputs.add(positions)]
                meta = StepMetadata(out, slots, inputs)
            row_col = inputs.add(rows)
            vocab = self.model.cfg.vocab_size
            sampling = None  # only the rank that samples needs the sampling columns
            if rows and not follows:
                sampling = SamplingColumns(inputs, samplers, vocab, self.sync_free)
            cols = inputs.send()
            if fills is not None:
                at, src = (cols[i] for i in fills)
                cols[step[0]].index_copy_(0, at, prev.token_ids.index_select(0, src))
            if out.block_copies:
                self.copy_blocks(*(cols[i] for i in copies))
            if replay:
                hidden = self.graphs.run(*(cols[i] for i in step))
            else:
                ids, pos = (cols[i] for i in step)
                hidden = self._forward(ids, pos, meta.build(cols), layer_done)
            if not rows:
                return LaunchedStep(self, [], None, None)
            logits = self.model.compute_logits(hidden.index_select(0, cols[row_col]))
            if follows:  # rank 0 samples; its ids come back for the next step's PENDING rows
                ids = torch.empty(len(rows), dtype=torch.long, device=self.device)
                drawn = SamplerOutput(token_ids=self.ranks.share_tokens(ids), logprobs=None)
                return LaunchedStep(self, samplers, drawn, None)
            t = sampling.tensors(cols)
            if masks is not None:
                filled = masks.result()
                t.allowed = (
                    torch.tensor(filled.rows, dtype=torch.long, device=self.device),
                    self.grammar.allowed(filled, logits.shape[-1]),
                )
            result = sample(logits, t)
            if self.leads:
                self.ranks.share_tokens(result.token_ids)
        except BaseException:  # a step that raised leaves no fill running beside the next one
            if masks is not None:
                masks.exception()
            raise
        back = [result.token_ids]
        if result.logprobs is not None:
            back.append(result.logprobs)
        if result.top_ids is not None:
            back += [result.top_ids, result.top_logprobs]
        return LaunchedStep(self, samplers, result, fetch(back), masks is not None)

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

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: block src[i] to dst[i], in every layer's K and V."""
        for layer in self.kv_layers:  # K and V of a block together
            layer = as_bytes(layer)  # an fp8 cache: index_copy_ takes no fp8 on the CPU
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

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Teacher-forced logits ([len, vocab], fp32) of `token_ids` prefilled whole into
        `blocks` (enough of them, held by the caller), outside any scheduled step."""
        message = ("prompt_logits", list(token_ids), list(blocks))
        return self._on_all_ranks(message, lambda: self._prompt_logits(token_ids, blocks))

    def _prompt_logits(self, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
        sched = ScheduledRequest(
            "logits", list(token_ids), 0, blocks, True, SamplingParams(temperature=0), 0, 0
        )
        inputs = StepInputs(self.device)
        meta = StepMetadata(
            SchedulerOutput(prefills=[sched]), self._slots(blocks, 0, len(token_ids)), inputs
        ).build(inputs.send())
        hidden = self.model(
            torch.tensor(token_ids, device=self.device),
            torch.arange(len(token_ids), device=self.device),
            self.kv_caches,
            self.backend,
            meta,
        )
        return self.model.compute_logits(hidden)

    def _slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


class LaunchedStep:
    """A step queued on the device (`ModelRunner.launch`); `result` waits for its tokens.
    `token_ids` (on the device) and `rows` (request id -> row) let the next step read the
    tokens it drew before the host has them."""

    def __init__(
        self,
        runner: ModelRunner,
        samplers: list[ScheduledRequest],
        result: SamplerOutput | None,
        fetched: Fetched | None,
        masked: bool = False,
    ) -> None:
        self.runner, self.samplers, self.fetched, self.masked = runner, samplers, fetched, masked
        self.token_ids = result.token_ids if result is not None else None
        self.logprobs = result is not None and result.logprobs is not None
        self.top = result is not None and result.top_ids is not None

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        """Request id -> its row of `token_ids`; built only for a next step that reads it."""
        return {s.request_id: i for i, s in enumerate(self.samplers)}

    def result(self) -> list[SampledToken]:
        """The step's sampled tokens, once the device has them (waits if need be)."""
        if self.fetched is None:
            return []
        grammar, samplers = self.runner.grammar, self.samplers
        got = self.fetched.wait()
        ids = got[0][:, 0].astype(np.int64).tolist()
        if self.masked:
            for s, tok in zip(samplers, ids):
                if s.sampling.constraint is not None:
                    grammar.advance(s.request_id, tok)
        lps = got[1][:, 0].tolist() if self.logprobs else [None] * len(ids)
        tops = [None] * len(ids)
        if self.top:
            at = 1 + self.logprobs
            top_ids, top_lps = got[at].astype(np.int64).tolist(), got[at + 1].tolist()
            tops = [tuple(zip(t, v)) for t, v in zip(top_ids, top_lps)]
        return [
            SampledToken(
                s.request_id,
                tok,
                lp if s.sampling.logprobs else None,
                top[: s.sampling.top_logprobs] if s.sampling.top_logprobs else None,
            )
            for s, tok, lp, top in zip(samplers, ids, lps, tops)
        ]


class StepMetadata:
    """The attention metadata of an eager step, its tensors queued as columns of the step's
    inputs (`build` reads them back once sent): the decodes' block tables, padded to the
    widest, and context lengths; each prefill's block table; every row's KV slot."""

    def __init__(self, out: SchedulerOutput, slots: list[int], inputs: StepInputs) -> None:
        self.out = out
        self.lens = tuple(s.context_len for s in out.decodes)
        self.slots = inputs.add(slots)
        self.decode = None
        if out.decodes:
            width = max(len(s.block_ids) for s in out.decodes)
            padded = [s.block_ids + [0] * (width - len(s.block_ids)) for s in out.decodes]
            self.decode = (inputs.add(padded), inputs.add(self.lens))
        self.prefill_tables = [inputs.add(s.block_ids) for s in out.prefills]

    def build(self, cols: list[torch.Tensor]) -> AttentionMetadata:
        tables = lens = None
        if self.decode is not None:
            tables, lens = (cols[i] for i in self.decode)
        prefills, row = [], len(self.out.decodes)
        for s, table in zip(self.out.prefills, self.prefill_tables):
            out_rows = min(s.num_tokens, max(0, s.context_len - len(s.prompt_ids)))
            prefills.append(PrefillSlice(row, s.num_tokens, s.context_len, cols[table], out_rows))
            row += s.num_tokens
        return AttentionMetadata(
            slot_mapping=cols[self.slots],
            num_decode_tokens=len(self.out.decodes),
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=prefills,
            decode_lens_host=self.lens,
            max_decode_len=max(self.lens, default=0),
        )


def scatter_rows(cache: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, ops=None) -> None:
    """`cache[idx[i]] = rows[i]` for whole blocks. With the CPU kernels (`ops`), a memcpy per
    block: index_copy_ goes element by element, at a fifth of the speed."""
    if ops is not None and cache.device.type == "cpu" and cache.is_contiguous():
        ops.scatter_blocks(cache, idx, rows)
    else:
        as_bytes(cache).index_copy_(0, idx, as_bytes(rows))


def fork_row(s: ScheduledRequest, index: int) -> ScheduledRequest:
    """The row of choice `index`, drawing its first token beside choice 0."""
    return dataclasses.replace(
        s,
        request_id=choice_id(s.request_id, index),
        seed=choice_seed(s.seed, index),
        forks=(),
    )
