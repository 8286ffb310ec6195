"""LLMEngine: requests in, token deltas out, one `step()` at a time.

    step N = schedule N -> launch N -> land N - 1, if left running (resolve its tokens,
             apply stop strings) -> advance N's bookkeeping -> land N, unless left running

With overlap (on CUDA by default), a step is left running on the device when `step()`
returns, and landed by the next call once that call has launched the step after it: the
host's scheduling hides behind the device's work (`_overlaps` says what is waited for). The
order matters: N - 1 lands before N advances, so the blocks N publishes hash real tokens.
The engine holds no threads but the one that builds constrained rows' masks while a step's
model runs (grammar.py); the offline API and the workers drive `step()` in their loops.
Disaggregation uses it through a small API, never through the scheduler or block pool:

- prefill side: `add_request(..., stop_after=n + 1, keep_kv=True)` samples one token past
  the n it was given and keeps the KV blocks held (`RequestOutput.kv_blocks`); the worker
  reads them from `kv_cache_layer` (or copies them out with `export_kv_layer`) and gives them
  back with `release_kv`. To send the KV while it is computed, set `on_kv_completing` (below)
  and `hold_kv` the blocks it names;
- decode side: `reserve` blocks, fill them in `kv_cache_layer` or with `write_kv_blocks` or
  `import_kv_layer` (`reserved_blocks` says where), then `add_prefilled`, or `release` the
  reservation;
- both: `abort`, and `stats()` for the worker's status.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.streams import indexed
from workers.engine.block_pool import BlockPool
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import GraphCapture
from workers.engine.grammar import GrammarCompiler, GrammarMasks
from workers.engine.model_runner import GraphSettings, LaunchedStep, ModelRunner
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.request import (
    NO_TENANCY,
    ErrorKind,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    Tenancy,
    choice_id,
    choice_index,
    split_choice,
    stop_status,
)
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_output import SampledToken, SchedulerOutput
from workers.engine.stop_strings import StopStringMatcher
from workers.engine.tp_ranks import Followers
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import build_model, read_model_config, resolve_model
from workers.model.tensor_parallel import tp_refusal
from workers.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _stops_armed(req: Request) -> bool:
    """Stop strings end a request only once it has more than min_tokens tokens, as in vLLM."""
    return req.num_output_tokens > req.sampling.min_tokens


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        model: LlamaForCausalLM | None = None,
        *,
        make_graph: Callable[[], GraphCapture] | None = None,
    ) -> None:
        """`tokenizer` and `model` may be passed in to share one loaded checkpoint between
        engines (each engine still owns its own KV cache); they must match `config.model`.
        `make_graph`: capture decode graphs with it, on any device (tests use EagerReplay);
        by default CUDA graphs on CUDA, unless config.cuda_graphs is off."""
        config = self.config = config.resolve()
        # Under tp > 1, ranks 1.. start now and load their parts while this one loads its own.
        self.followers = self._start_ranks(config, model)
        try:  # under tp > 1, a failure to start stops the ranks already started
            threads = config.num_threads
            if self.followers is not None:
                threads = self.followers.settings.threads
            if threads and config.device == "cpu":
                torch.set_num_threads(threads)
            device = indexed(config.device)  # "cuda" pinned to a GPU: set_device needs its index
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's current device: the loop's
            need_source = model is None or tokenizer is None
            self.source = resolve_model(config.model) if need_source else None
            self.tokenizer = tokenizer or Tokenizer(self.source)
            ranks = None
            if model is None:
                model = build_model(
                    self.source,
                    getattr(torch, config.dtype),
                    device,
                    quantization=config.quantization,
                    tp=(0, config.tp),
                )
            if self.followers is not None:
                ranks = self.followers.connect(device)
            self.model_config = model.cfg
            self.max_model_len = config.context_len(model.cfg.max_position_embeddings)
            # Under tp > 1, per rank: rank 0's KV heads are the most any rank holds.
            num_blocks = config.num_kv_blocks or config.kv_blocks(
                model.cfg.num_layers, model.local_cfg.kv_size
            )
            graphs = None
            if make_graph is not None or (device.type == "cuda" and config.cuda_graphs):
                graphs = GraphSettings(config.max_num_seqs, self.max_model_len, make_graph)
            self.runner = ModelRunner(
                model,
                num_blocks,
                config.block_size,
                device,
                config.attention_backend,
                graphs,
                kv_dtype=torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else None,
                ranks=ranks,
            )
        except BaseException:
            self.close()
            raise
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler(self.max_model_len), self.pool)
        eos = set(model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self._seeds = random.Random(config.seed)
        self.prefill_tokens = self.decode_tokens = 0  # computed, lifetime (for metrics)
        self._stops: dict[str, StopStringMatcher] = {}
        # overlap: the step launched and left running by the last `step`, with its schedule.
        self.overlap = config.overlap == "on" or (
            config.overlap == "auto" and device.type == "cuda"
        )
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.overlapped_steps = 0  # lifetime: steps left running while the next was scheduled
        # Prefill side, optional: called as a step begins, with (request id, block ids, tokens)
        # of each keep_kv request whose KV that step completes; it may return a function that
        # the model calls with each layer's index once the layer has written its KV, so the
        # KV can leave layer by layer while the later layers compute.
        self.on_kv_completing: (
            Callable[[list[tuple[str, list[int], int]]], Callable[[int], None] | None] | None
        ) = None
        log.info(
            "engine ready: %s on %s, %s%s, %d KV blocks of %d tokens, backend %s%s",
            self.source.path.name if self.source else "a model passed in",
            device,
            config.dtype,
            (f", {config.quantization} weights" if config.quantization != "none" else "")
            + (", fp8 KV" if config.kv_cache_dtype == "fp8" else ""),
            num_blocks,
            config.block_size,
            self.runner.backend.name,
            ", decode in CUDA graphs" if self.runner.graphs else "",
        )
        if self.followers is not None:
            log.info("tp %d: ranks 1.. are pids %s", config.tp, self.followers.pids)

    @staticmethod
    def _start_ranks(config: EngineConfig, model: LlamaForCausalLM | None) -> Followers | None:
        """Under tp > 1, the other ranks' processes, started (tp_ranks.py); else None."""
        if config.tp == 1:
            return None
        if model is not None:
            raise ValueError("a model passed in is one rank's: tp > 1 loads its own parts")
        why = tp_refusal(read_model_config(resolve_model(config.model)), config.tp)
        if why is not None:  # before any rank starts
            raise ValueError(why)
        if config.device.startswith("cuda"):
            first = torch.device(config.device).index or 0
            if first + config.tp > torch.cuda.device_count():
                raise ValueError(
                    f"tp={config.tp} needs GPUs {first}..{first + config.tp - 1}; "
                    f"{torch.cuda.device_count()} are visible"
                )
        return Followers(config)

    def close(self) -> None:
        """Stop the other ranks of a tp > 1 engine (nothing to do under tp 1)."""
        if getattr(self, "followers", None) is not None:
            self.followers.close()

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        *,
        output_ids: list[int] | tuple[int, ...] = (),
        stop_after: int | None = None,
        keep_kv: bool = False,
        tenancy: Tenancy = NO_TENANCY,
    ) -> str:
        """Queue a request. `output_ids` are tokens it already generated (a replay): they
        are computed with the prompt and generation continues after them, with the sampler at
        the same positions and the same remaining budget as if it had never stopped."""
        self.validate_prompt(list(prompt_token_ids) + list(output_ids))
        self.validate_sampling(sampling)
        if sampling.n > 1 and output_ids:
            raise ValueError("n > 1 is for a fresh request, not a replay")
        if request_id is not None:
            self._check_id_free(request_id, sampling.n)
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            seed=sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63),
            output_token_ids=list(output_ids),
            stop_after=stop_after,
            keep_kv=keep_kv,
            tenancy=tenancy,
        )
        self.scheduler.add_request(req)
        if sampling.stop and stop_after is None:  # a prefill never ends on a stop
            self._watch_stops(req)
        return req.request_id

    def _check_id_free(self, request_id: str, n: int) -> None:
        """Choice i > 0 of request R runs as `choice_id(R, i)` (R#i): an id may name neither
        a sequence that exists nor one that a request here will fork."""
        sched = self.scheduler
        taken = [choice_id(request_id, i) for i in range(n)]
        parent_of, index = split_choice(request_id)
        parent = sched.requests.get(parent_of) if index else None
        if any(t in sched.requests or t in sched.kv.reserved for t in taken) or (
            parent is not None and parent.forks_pending and index < parent.sampling.n
        ):
            raise ValueError(f"request id {request_id!r} is already in use (or a choice's)")

    def _watch_stops(self, req: Request, prior: list[int] | None = None) -> StopStringMatcher:
        """Register a request's stop-string matcher, fed the tokens already emitted (`prior`,
        by default all its outputs): their text may hold a stop's beginning, never a whole
        one."""
        matcher = self._stops[req.request_id] = StopStringMatcher(self.tokenizer, req.sampling.stop)
        prior = req.output_token_ids if prior is None else prior
        if prior:
            matcher.push(prior, search=False)
        return matcher

    def validate_sampling(self, sampling: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise ValueError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if sampling.constraint is not None:
            self.grammars().compiler.grammar(sampling.constraint)  # GrammarError names it

    def grammars(self) -> GrammarMasks:
        """The engine's constrained-decoding state, made with the first constrained request
        (reading the tokenizer's vocabulary takes about half a second)."""
        if self.runner.grammar is None:
            compiler = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size)
            self.runner.grammar = GrammarMasks(compiler, self.eos_token_ids, self.device)
        return self.runner.grammar

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in ids):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        if -(-len(ids) // self.pool.block_size) > self.pool.num_blocks:
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than the whole KV cache holds "
                f"({self.pool.num_blocks * self.pool.block_size})"
            )
        cfg = self.scheduler.config
        if not cfg.enable_chunked_prefill and len(ids) > cfg.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} with chunked prefill off"
            )

    # -- disaggregation ---------------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def reserve(self, request_id: str, num_tokens: int) -> int | None:
        """Hold blocks for `num_tokens` tokens whose KV a prefill worker will send; returns
        how many blocks, or None if they don't fit now. A step left running (overlap) may
        still write into blocks freed while it ran: a writer on another stream first waits
        for an event recorded on the engine's stream after this call, as the decode
        worker's does (held_requests.py, `writable`)."""
        blocks = self.scheduler.reserve(request_id, num_tokens)
        return None if blocks is None else len(blocks)

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """Where a reservation's KV goes, in order; None without a reservation."""
        return self.scheduler.kv.reserved_blocks(request_id)

    def release(self, request_id: str) -> bool:
        """Give back a reservation (the transfer failed or was cancelled)."""
        return self.scheduler.kv.release(request_id)

    def kv_cache_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s cache, `kv_layout.layer_shape(num_blocks)`: a block's K and V side
        by side. A transfer reads held blocks out of it, or writes reserved ones, in place;
        nothing else may be touched."""
        return self.runner.kv_layers[layer]

    def write_kv_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, rows) -> None:
        """Whole blocks into a `kv_cache_layer` tensor, at reserved block ids."""
        self.runner.write_blocks(cache, block_ids, rows)

    def read_kv_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, out) -> None:
        """Whole blocks out of a `kv_cache_layer` tensor, at held block ids, into `out`."""
        self.runner.read_blocks(cache, block_ids, out)

    def import_kv_layer(self, layer: int, block_ids, data: torch.Tensor) -> None:
        """Write `export_kv_layer`'s copy of one layer into reserved blocks (nothing reads
        them yet)."""
        self.runner.import_layer(layer, block_ids, data)

    def export_kv_layer(
        self, layer: int, block_ids, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A copy of one layer of held blocks, `kv_layout.layer_shape(n)` (into `out` if
        given); thread-safe for a layer whose KV no step is writing any more."""
        return self.runner.export_layer(layer, block_ids, out)

    def hold_kv(self, block_ids: list[int]) -> None:
        """Take an extra reference on a running request's blocks (give it back with
        release_kv): they stay readable, and unwritten, whatever becomes of the request."""
        self.pool.hold(block_ids)

    def release_kv(self, block_ids: list[int]) -> None:
        """Give back blocks a keep_kv request held; they stay behind as prefix cache."""
        self.pool.free(block_ids)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        priority: int = 0,
        last_logprob: float | None = None,
        last_top_logprobs: tuple[tuple[int, float], ...] | None = None,
        siblings: tuple[SampledToken, ...] = (),
        tenancy: Tenancy = NO_TENANCY,
    ) -> list[RequestOutput]:
        """Admit a request prefilled elsewhere: the KV of the prompt and of every output
        token but the last (just sampled) is in its reserved blocks. With n > 1, `siblings`
        are first tokens the same prefill drew for choices > 0, each under its choice's id:
        those choices are forked at once, sharing the prompt's blocks (a choice left out is
        never run here). Returns the final output of every choice that its first token
        already ends."""
        indices = [choice_index(s.request_id) for s in siblings]
        if siblings and (
            len(output_ids) != 1
            or len(set(indices)) != len(indices)
            or not all(0 < i < sampling.n for i in indices)
        ):
            raise ValueError(
                f"n={sampling.n}: siblings must be distinct choices in [1, {sampling.n}) after "
                f"one output token; got {indices} after {len(output_ids)}"
            )
        for s in siblings:
            self._check_id_free(s.request_id, 1)
        if sampling.constraint is not None:
            self.grammars()  # its matcher catches up on output_ids at its first step
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            seed=seed,
            output_token_ids=list(output_ids),
            tenancy=tenancy,
        )
        if last_logprob is not None and sampling.logprobs:
            req.output_logprobs.append(last_logprob)
        if last_top_logprobs is not None and sampling.top_logprobs:
            req.output_top_logprobs.append(tuple(last_top_logprobs))
        self.scheduler.add_prefilled(req)
        # Every choice forks before any may end and give back the blocks it shares.
        choices = [req] + [
            self.scheduler.fork_prefilled(req, choice_index(t.request_id), t) for t in siblings
        ]
        ended = []
        for r in choices:
            if r.sampling.stop:  # tokens before the last were emitted: no stop ended them
                matcher = self._watch_stops(r, r.output_token_ids[:-1])
                if matcher.push(r.output_token_ids[-1:], search=_stops_armed(r)) is not None:
                    self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
            status = stop_status(r, r.output_token_ids[-1], self.max_model_len)
            if status is not None and not r.is_finished:
                self.scheduler.finish_request(r.request_id, status)
            if r.is_finished:
                matcher = self._stops.pop(r.request_id, None)
                text = matcher.text if matcher is not None else None
                ended.append(
                    RequestOutput(
                        request_id, [], True, r.finish_reason, r.error, None, text, index=r.index
                    )
                )
        return ended

    def unforked_choices(self, request_id: str) -> int:
        """How many choices (> 0) of an n > 1 request are still to be forked from it."""
        req = self.scheduler.requests.get(request_id)
        return req.sampling.n - 1 if req is not None and req.forks_pending else 0

    def abort(self, request_id: str, choices: bool = True) -> bool:
        """Cancel a request, and with `choices` every choice of it (else only the sequence
        under this id: a choice's own id, or choice 0's); its blocks are free when this
        returns."""
        if self.scheduler.kv.release(request_id):
            self._stops.pop(request_id, None)
            return True
        # Every choice still running, whether or not choice 0 has ended.
        family = [
            r.request_id
            for r in self.scheduler.requests.values()
            if r.request_id == request_id or (choices and r.parent_id == request_id)
        ]
        for rid in family:
            self._stops.pop(rid, None)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_CANCELLED)
        return bool(family)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits ([len, vocab], fp32) at every position of `token_ids`, in one
        pass through the paged-cache path, outside the scheduler: for scoring (perplexity,
        correctness checks). Its blocks are taken from the pool and freed at the end; raises
        if they are not free."""
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(
                f"{len(token_ids)} tokens: score 1 to max_model_len ({self.max_model_len})"
            )
        if self._in_flight is not None:
            raise RuntimeError("a step is in flight: land it (step()) before scoring")
        pool = self.pool
        blocks = pool.allocate(-(-len(token_ids) // pool.block_size))
        try:
            return self.runner.prompt_logits(token_ids, blocks)
        finally:
            pool.free(blocks)

    def stats(self) -> EngineStats:
        sched = self.scheduler
        g = self.runner.grammar
        grammar = {}
        if g is not None:
            grammar = dict(
                constrained_seqs=g.constrained_requests,
                grammar_mask_steps=g.mask_steps,
                grammar_mask_seconds=g.mask_seconds,
                grammar_compiles=g.compiler.compiles,
                grammar_compile_seconds=g.compiler.compile_seconds,
                grammar_cache_hits=g.compiler.hits,
            )
        return EngineStats(
            **grammar,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free_blocks,
            kv_blocks_reservable=self.pool.num_blocks - sched.kv.watermark_blocks,
            running=len(sched.running),
            waiting=len(sched.waiting),
            reserved=len(sched.kv.reserved),
            preemptions=sched.num_preemptions,
            prefix_hit_blocks=self.pool.num_prefix_hits,
            prefix_query_blocks=sched.num_prefix_queries,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            kv_bytes_per_token=self._kv_bytes_per_token(),
        )

    def _kv_bytes_per_token(self) -> int:
        """K and V of one token, every layer, in the cache's dtype: under tp > 1, over every
        rank's heads (a KV head repeated on several ranks counts on each)."""
        layout = self.kv_layout
        if self.config.tp == 1:
            return layout.bytes_per_token
        cfg = self.model_config
        held = max(cfg.num_kv_heads, self.config.tp)  # each rank holds one past kv_heads
        return layout.bytes_per_token // layout.num_kv_heads * held

    # -- the loop body ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step before it if that one
        was left running, and this one's unless it is left running (see `_overlaps`). With
        overlap, a step stays in flight between calls: the host schedules and launches the
        next one while the device runs it, and the next step's decodes take its tokens on
        the device. A row whose request ended in the step before (a stop, EOS) computes one
        token too many; that token is dropped, never returned, streamed or logged."""
        out = self.scheduler.schedule()
        results = [o for req, err in out.failed for o in self._ended_with_error(req, err)]
        prev, self._in_flight = self._in_flight, None
        if not out.scheduled:
            return results + (self._land(*prev) if prev is not None else [])
        self.prefill_tokens += sum(p.num_tokens for p in out.prefills)
        self.decode_tokens += len(out.decodes)
        layer_done = self._kv_completing(out)
        try:
            launched = self.runner.launch(out, layer_done, prev[1] if prev is not None else None)
        except Exception as e:  # one bad step must not take the engine down with it
            if prev is not None:  # the step before streams its tokens first
                results += self._land(*prev)
            return results + self._failed(out, e)
        if prev is not None:
            results += self._land(*prev)
        self.scheduler.advance(out)
        if self._overlaps(out, layer_done):
            self._in_flight = (out, launched)
            self.overlapped_steps += 1
            return results
        return results + self._land(out, launched)

    def _overlaps(self, out, layer_done) -> bool:
        """Whether the next step may be scheduled before this one's tokens are on the host.
        Not when a row's next step needs its token's value on the host: a grammar's mask,
        penalties over its history, n > 1 forks, a prefill that keeps its KV for a
        transfer (or streams it layer by layer)."""
        if not self.overlap or layer_done is not None:
            return False
        requests = self.scheduler.requests
        for s in out.scheduled:
            if not s.sample:
                continue
            req = requests.get(s.request_id)
            sp = s.sampling
            if s.forks or sp.constraint is not None or sp.penalized:
                return False
            if req is not None and (req.keep_kv or req.stop_after is not None):
                return False
        return True

    def _land(self, out: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """A launched step's tokens, waited for, into its requests' bookkeeping and outputs."""
        try:
            sampled = launched.result()
        except Exception as e:
            return self._failed(out, e)
        results = []
        # A sequence whose grammar broke this step ends in error, not on the EOS it was given.
        broken = self.runner.grammar.take_failed() if self.runner.grammar is not None else {}
        for rid, why in broken.items():
            req = self.scheduler.finish_request(
                rid, RequestStatus.FINISHED_ERROR, why, ErrorKind.GRAMMAR
            )
            if req is not None:
                results += self._ended_with_error(req, why)
        for req, new_ids in self.scheduler.resolve(out, sampled):
            results.append(self._output(req, new_ids))
        if self.runner.grammar is not None and len(self.runner.grammar):
            self.runner.grammar.retain(self.scheduler.requests)
        return results

    def _failed(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """A step that raised: every request it ran ends in error."""
        ids = [s.request_id for s in out.scheduled]
        log.error("model step failed; failing its %d requests: %s", len(ids), ids, exc_info=e)
        error = f"{type(e).__name__}: {e}"
        results, sched = [], self.scheduler
        for s in out.scheduled:
            if out.advanced:  # it landed: only what it advanced, if still live here
                req = sched.advanced(out, s.request_id)
                if req is None:
                    continue  # ended meanwhile (its id perhaps taken again)
                if s.sample:
                    req.output_token_ids.pop()  # the token it drew is lost
            req = sched.finish_request(
                s.request_id, RequestStatus.FINISHED_ERROR, error, ErrorKind.STEP_FAILED
            )
            if req is not None:
                results += self._ended_with_error(req, error)
        return results

    def _kv_completing(self, out) -> Callable[[int], None] | None:
        if self.on_kv_completing is None:
            return None
        bs, requests = self.config.block_size, self.scheduler.requests
        done = [  # decodes too: a replay's last chunk of one token (a prefix-cache hit)
            (s.request_id, s.block_ids[: -(-s.context_len // bs)], s.context_len)
            for s in out.scheduled
            if s.sample and requests[s.request_id].keep_kv
        ]
        return self.on_kv_completing(done) if done else None

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        text = None
        forked_now = req.parent_id is not None and req.num_output_tokens == 1
        if forked_now and req.sampling.stop and req.stop_after is None:
            self._watch_stops(req, [])  # a choice just forked: its own matcher, from now
        matcher = self._stops.get(req.request_id)
        if matcher is not None:
            hit = matcher.push(new_ids, search=_stops_armed(req))
            text = matcher.text
            if hit is not None and not req.is_finished:
                # Keep the tokens up to the one that completed the match.
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                del self._stops[req.request_id]
        sp = req.sampling

        def new(xs: list) -> list:  # the entries of this step's tokens
            return xs[len(xs) - len(new_ids) :]

        return RequestOutput(
            req.parent_id or req.request_id,
            new_ids,
            req.is_finished,
            req.finish_reason,
            req.error,
            new(req.output_logprobs) if sp.logprobs else None,
            text,
            req.kept_blocks,
            new_top_logprobs=new(req.output_top_logprobs) if sp.top_logprobs else None,
            index=req.index,
            error_kind=req.error_kind,
        )

    def _ended_with_error(self, req: Request, message: str) -> list[RequestOutput]:
        """The last output of a request that failed; of all its choices if none forked yet."""
        self._stops.pop(req.request_id, None)
        indices = range(req.sampling.n) if req.forks_pending else [req.index]
        rid, kind = req.parent_id or req.request_id, req.error_kind
        return [
            RequestOutput(rid, [], True, FinishReason.ERROR, message, index=i, error_kind=kind)
            for i in indices
        ]
