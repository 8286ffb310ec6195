"""Iteration-level scheduling (Orca): every step picks work within a token budget.

Each step:
0. with every seat (`max_num_seqs`) taken, a waiting request that fair share owes a seat
   takes that of the running request with the largest key (preempted: recompute);
1. running requests, in policy order, get their next token (decode) or next prompt chunk;
   one that needs a block when none is free preempts the policy's last running request
   (recompute: its blocks are freed, and it later re-prefills its prompt and outputs so far);
2. if nothing was preempted, waiting requests are admitted, in policy order, while their
   first chunk's blocks fit and the budget and `max_num_seqs` allow. A policy that
   `admits_ahead` (shortest-first) merges the two: before each running request is served,
   the waiting ones with smaller keys are admitted; and a chunk that does not end its
   prompt only goes into a step with no other prompt chunk, so a step that makes first
   tokens stays short.

Static batching is request-level scheduling as in HF `generate` or FasterTransformer: a group
is admitted only when the previous one has entirely finished, and a member that ends early
keeps its batch slot as padding (its last position is recomputed each step and the token
discarded) until the group's longest member ends; its blocks are freed with the group.
With `target_tpot_ms`, each step's prompt tokens are also limited to what the running
sequences can spare and still keep that mean time per token (decode pacing, pacing.py).

The scheduler is pure bookkeeping: it never touches tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.engine.block_pool import BlockPool
from workers.engine.config import SchedulerConfig
from workers.engine.kv_manager import KVCacheManager
from workers.engine.pacing import MAX_DECODE_PAUSE_S, DecodePacer
from workers.engine.policy import make_policy
from workers.engine.request import ErrorKind, Request, RequestStatus, choice_id, choice_seed
from workers.engine.scheduler_output import SampledToken, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        # With chunked prefill, pacing keeps the engine's target_tpot_ms, and each request's
        # own tpot_slo_ms (its tenancy); with neither, it limits nothing.
        target = config.target_tpot_ms / 1000 if config.target_tpot_ms else None
        self.pacer = DecodePacer(target, pool.block_size) if config.enable_chunked_prefill else None
        self._prompt_allowance: int | None = None  # this step's, under pacing; None: no limit
        self._decodes_due = 0  # this step's running decodes not yet served: their budget
        # Decodes of requests without a TPOT target this step may still run beside those
        # with one (pacing's decode_cap; None: no limit), and since when each held back is.
        self._decode_cap: int | None = None
        # Tenants whose decodes wait this step: it gives a tenant under its share of the
        # seats its first token (policy.yielding_to).
        self._yielding: set[str] = set()
        self._yielded_for: str | None = None  # the last request others' decodes waited for
        self._held_back: dict[str, float] = {}
        # Pacing: the last step scheduled and when, to time it by the next one's start.
        self._timing: tuple[SchedulerOutput, float] | None = None
        self.pool = pool
        self.kv = KVCacheManager(pool, watermark_blocks=int(config.watermark * pool.num_blocks))
        self.policy = make_policy(
            config.policy, config.fair_share, config.aging_per_s, config.max_wait_s
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0  # lifetime count, for metrics and tests
        self.num_prefix_queries = 0  # full prompt blocks looked up at admission, for metrics
        self.padding: list[Request] = []  # static batching: ended members still in the group
        self.reserved: set[str] = set()  # ids holding blocks for a KV transfer not yet admitted

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.policy.register(req)
        self.waiting.append(req)

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        error: str | None = None,
        kind: ErrorKind | None = None,
    ):
        """End a request now, releasing its blocks at once. Unknown or ended ids are ignored.
        An error's `kind` says why, for its status (the message is for people)."""
        assert status.is_finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.status = status
        req.error, req.error_kind = error, kind
        was_running = req in self.running
        if was_running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        natural = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if req.keep_kv and natural:
            # Every token but the one just sampled has its KV in the cache.
            n = self.kv.blocks_needed(req.num_tokens - 1)
            req.kept_blocks = list(self.kv.block_table(request_id)[:n])
            self.pool.hold(req.kept_blocks)
        if self.config.batching == "static" and was_running and natural and self.running:
            self.padding.append(req)  # keeps its slot and blocks until the group ends
        else:
            self.kv.free(req)
        if self.padding and not self.running:
            for ghost in self.padding:
                self.kv.free(ghost)
            self.padding.clear()
        self.policy.forget(req)
        self._held_back.pop(request_id, None)
        if not self.requests:  # the loop idles now: the next step's start times nothing
            self._timing = None
        return req

    # -- disaggregation: blocks reserved ahead of a KV transfer ---------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Hold blocks for a prompt whose KV will arrive from a prefill worker; None when
        they do not fit now. Decode reserves first, so a transfer never lands in a full cache."""
        if request_id in self.requests or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        blocks = self.kv.reserve(request_id, num_tokens)
        if blocks is not None:
            self.reserved.add(request_id)
        return blocks

    def release(self, request_id: str) -> bool:
        """Give back a reservation whose transfer failed or was cancelled."""
        if request_id not in self.reserved:
            return False
        self.reserved.discard(request_id)
        self.kv.free_id(request_id)
        return True

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """The blocks a reservation holds, in order; None if there is no such reservation."""
        if request_id not in self.reserved:
            return None
        return list(self.kv.block_table(request_id))

    def add_prefilled(self, req: Request) -> None:
        """Admit a request whose KV (for every token but the last output token, just sampled)
        fills its reserved blocks: it joins the running batch at its next decode."""
        if req.request_id not in self.reserved:
            raise ValueError(f"request {req.request_id!r} has no reserved blocks")
        assert req.output_token_ids, "a prefilled request carries its first token"
        need = self.kv.blocks_needed(req.num_tokens - 1)
        if need > len(self.kv.block_table(req.request_id)):
            raise ValueError(f"request {req.request_id!r} reserved fewer than {need} blocks")
        self.reserved.discard(req.request_id)
        self.requests[req.request_id] = req
        self.policy.register(req)
        req.num_computed_tokens = req.num_tokens - 1
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.policy.admitted(req)
        self.kv.publish(req)
        req.paced_since = (self.clock(), req.num_output_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Static batching admits a new group only once the last one is gone.
        admit = self.config.batching == "continuous" or not self.running
        # Sorted once a step: admissions only pop from it, and a preemption (which appends)
        # ends admission for the step.
        self.waiting.sort(key=self.policy.key)
        if admit and self.config.batching == "continuous":
            self._free_seats()
        decoding = [r for r in self.running if r.is_decoding]
        self._decodes_due = len(decoding)
        self._prompt_allowance = self._decode_cap = None
        if self.pacer is not None:
            now = self.clock()
            self._observe_last_step(now)
            self._prompt_allowance = self.pacer.prompt_allowance(
                decoding, now, self.config.max_model_len
            )
            self._decode_cap = self.pacer.decode_cap(decoding)
        share = self.config.prefill_share
        if decoding and share < 1:  # decode-first: prompts take at most this share
            cap = max(self.pool.block_size, int(share * self.config.max_num_batched_tokens))
            allowed = self._prompt_allowance
            self._prompt_allowance = cap if allowed is None else min(cap, allowed)
        self._yielding = self._yielding_to_first_token(budget) if admit else set()
        budget = self._schedule_running(out, budget, admit and self.policy.admits_ahead)
        for ghost in self.padding:
            if budget <= 0:
                break
            budget -= 1
            self._emit(out, ghost, 1, padding=True)
        if admit and not out.preempted_ids:  # room was just made by force: admit nothing
            self._schedule_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        self.policy.end_step()
        if self.pacer is not None and out.scheduled:
            self._timing = (out, now)
        return out

    def _observe_last_step(self, now: float) -> None:
        """Pacing learns what a step costs from the time between two steps' starts: the model
        run and all the worker does around it (its outputs handed on, commands applied),
        which is what the sequences' tokens wait for."""
        if self._timing is not None:
            out, started = self._timing
            self._timing = None
            prompt_tokens = sum(p.num_tokens for p in out.prefills)
            self.pacer.observe(len(out.decodes), prompt_tokens, now - started, now)

    def _free_seats(self) -> None:
        """Every seat taken and waiting requests owed one (fair share): the running request
        the policy names gives its seat up, preempted before anything is scheduled this
        step, and the waiting one is admitted in its place."""
        seats = self.config.max_num_seqs
        given: list[Request] = []  # waiting requests a seat was freed for, admitted first
        asked: set[str] = set()  # the first waiting request of each tenant asks, in order
        for first in list(self.waiting):
            if len(self.running) + len(given) < seats:
                break
            if first.tenancy.tenant in asked:
                continue
            asked.add(first.tenancy.tenant)
            victim = self.policy.seat_for(first, self.running, seats, given)
            if victim is not None:
                self._preempt(victim)
                given.append(first)
                asked.discard(first.tenancy.tenant)  # its next one may be owed a seat too
        if given:
            self.waiting = given + [r for r in self.waiting if r not in given]

    def _schedule_running(self, out: SchedulerOutput, budget: int, ahead: bool) -> int:
        self.running.sort(key=self.policy.key)
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted earlier in this loop to make room
            if ahead and not out.preempted_ids:
                budget = self._schedule_waiting(out, budget, before=self.policy.key(req))
            if self._holds_back(req):
                continue
            n = self._num_new_tokens(req, budget)
            if n == 0 or (ahead and self._yields(req, n, out)):
                continue
            while not self.kv.can_allocate(req, n):
                if len(self.running) == 1:
                    if not self._held_elsewhere():
                        # Alone, the rest of the cache free, and still out of blocks: the
                        # cache can never hold this request.
                        self._fail_unfittable(req, out)
                    break  # else it waits for the blocks KV transfers hold
                # The last of the largest keys (running[-1], unless some were admitted
                # ahead in this loop and appended out of order).
                victim = max(reversed(self.running), key=self.policy.key)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                self.kv.allocate(req, n)
                budget -= n
                self._emit(out, req, n)
        return budget

    def _yielding_to_first_token(self, budget: int) -> set[str]:
        """The tenants whose decodes wait this step, when the first waiting request (in the
        policy's order) gets its seats, its blocks and its whole prompt in it: its first
        token comes from a short step, not from one beside the whole batch. Once per
        request: one that still waits after its step (room taken by a preemption, say)
        makes nobody wait again."""
        if not self.waiting or self.waiting[0].request_id == self._yielded_for:
            return set()
        first = self.waiting[0]
        seqs = sum(r.sampling.n if r.forks_pending else 1 for r in [*self.running, first])
        if seqs > self.config.max_num_seqs:
            return set()
        left = first.num_tokens - first.num_computed_tokens
        room = budget
        if self.config.enable_chunked_prefill:
            room = min(room, self.config.prefill_chunk_size)
            if self._prompt_allowance is not None:
                room = min(room, self._prompt_allowance)
        if left > room or not self.kv.can_allocate(first, left, admitting=bool(self.running)):
            return set()
        seats = self.config.max_num_seqs
        yielding = self.policy.yielding_to(first, self.running, seats)
        if yielding:
            self._yielded_for = first.request_id
        return yielding

    def _holds_back(self, req: Request) -> bool:
        """A decode waits a step, unless it has waited MAX_DECODE_PAUSE_S already (since it
        last ran): its tenant's, over its share, for another's first token (`_yielding`); or
        one with no TPOT target of its own past pacing's decode cap."""
        if self._waits(req):
            self._held_back.setdefault(req.request_id, self.clock())
            self._decodes_due = max(0, self._decodes_due - 1)  # its budget goes to others
            return True
        self._held_back.pop(req.request_id, None)  # it runs: a later wait counts afresh
        return False

    def _waits(self, req: Request) -> bool:
        if not req.is_decoding:
            return False
        yields = req.tenancy.tenant in self._yielding
        capped = self._decode_cap is not None and not self.pacer.target_of(req)
        if not (yields or capped):
            return False
        since = self._held_back.get(req.request_id)
        overdue = since is not None and self.clock() - since >= MAX_DECODE_PAUSE_S
        if overdue or (not yields and self._decode_cap > 0):
            if capped:
                self._decode_cap = max(0, self._decode_cap - 1)
            return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, before=None) -> int:
        """Admit waiting requests in policy order (`waiting` is sorted by `schedule`; only
        those whose key is below `before`, when given); returns the budget left."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if before is not None and self.policy.key(req) >= before:
                break
            ahead = self.policy.admits_ahead
            if ahead and self._yields(req, self._num_new_tokens(req, budget), out):
                i += 1
                continue
            # A request that will fork counts all its choices against max_num_seqs, and so do
            # running ones that have not forked yet.
            seqs = sum(r.sampling.n if r.forks_pending else 1 for r in [*self.running, req])
            if self.running and seqs > self.config.max_num_seqs:
                break
            n = self._admit(req, budget)
            if n == 0:
                if self.running or self._prompt_allowance == 0 or self._held_elsewhere():
                    break  # wait for running requests or transfers to free blocks, or pacing
                # An empty cache has no room for it: it can never fit.
                self._fail_unfittable(req, out)
                continue
            self.waiting.pop(i)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.policy.admitted(req)
            budget -= n
            self._emit(out, req, n)
        return budget

    @staticmethod
    def _yields(req: Request, n: int, out: SchedulerOutput) -> bool:
        """Under an admits-ahead policy, a chunk that does not end its prompt only goes into
        a step with no other prompt chunk: one long prompt advances at a time (as vLLM's
        max_num_partial_prefills=1), and a step that ends short prompts stays short."""
        partial = 1 < n < req.num_tokens - req.num_computed_tokens
        return partial and bool(out.prefills)

    def _held_elsewhere(self) -> bool:
        """Whether blocks are held outside the batch: for KV transfers (a prefill's finished
        prompts being pushed, a decode's reservations for incoming KV). Those come back, so
        a request short of room waits for them rather than be failed as too big."""
        batch = {
            b for r in [*self.running, *self.padding] for b in self.kv.block_table(r.request_id)
        }
        return self.pool.num_free_blocks + len(batch) < self.pool.num_blocks

    def _fail_unfittable(self, req: Request, out: SchedulerOutput) -> None:
        error = f"request needs more than the {self.pool.num_blocks} KV blocks of this worker"
        self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, error, ErrorKind.TOO_BIG)
        out.failed.append((req, error))

    def update_from_output(
        self, out: SchedulerOutput, sampled: list[SampledToken]
    ) -> list[tuple[Request, list[int]]]:
        """Advance every scheduled request; returns (request, new token ids) for each that
        gained tokens or ended this step. Ended requests have released their blocks."""
        by_id = {s.request_id: s for s in sampled}
        results = []
        now = self.clock()
        for sched in out.scheduled:
            req = self.requests.get(sched.request_id)
            if req is None:
                continue  # cancelled while the step ran; its blocks are already free
            req.num_computed_tokens += sched.num_tokens
            self.kv.publish(req)
            tok = by_id.get(sched.request_id)
            if not sched.sample or tok is None:
                continue
            members = [(req, tok)]
            for index in sched.forks:  # before the parent may end and free its blocks
                members.append((self._fork(req, index), by_id[choice_id(req.request_id, index)]))
            for r, t in members:
                r.output_token_ids.append(t.token_id)
                if t.logprob is not None:
                    r.output_logprobs.append(t.logprob)
                if t.top_logprobs is not None:
                    r.output_top_logprobs.append(t.top_logprobs)
                if r.paced_since is None:
                    r.paced_since = (now, r.num_output_tokens)
                status = self.check_stop(r, t.token_id)
                if status is not None:
                    self.finish_request(r.request_id, status)
                results.append((r, [t.token_id]))
        return results

    def fork_prefilled(self, parent: Request, index: int, first: SampledToken) -> Request:
        """Choice `index` of a request just admitted by add_prefilled, with the first token
        the prefill drew for it: it shares the parent's blocks, the prompt's KV."""
        child = self._fork(parent, index)
        child.output_token_ids.append(first.token_id)
        if first.logprob is not None and child.sampling.logprobs:
            child.output_logprobs.append(first.logprob)
        if first.top_logprobs is not None and child.sampling.top_logprobs:
            child.output_top_logprobs.append(tuple(first.top_logprobs))
        return child

    def _fork(self, parent: Request, index: int) -> Request:
        """Choice `index` of a parent whose prompt was just computed: a running sequence
        sharing every block of the parent's."""
        child = Request(
            request_id=choice_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            sampling=parent.sampling,
            eos_token_ids=parent.eos_token_ids,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            tenancy=parent.tenancy,
            seed=choice_seed(parent.seed, index),
            parent_id=parent.request_id,
            index=index,
            # A prefill's choices end with their first token as it does; only the parent
            # holds the prompt's KV for the transfer.
            stop_after=parent.stop_after,
        )
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.paced_since = parent.paced_since
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.policy.inherit(child, parent)  # served, and preempted, as its parent
        self.running.append(child)
        self.kv.fork(parent.request_id, child.request_id)
        return child

    # -- helpers --------------------------------------------------------------------------
    def _admit(self, req: Request, budget: int) -> int:
        """Reserve blocks for a waiting request's first chunk; returns its size, 0 if it
        does not fit. Prefix hits are used when they fit, else the prefix is recomputed."""
        # The watermark only protects running sequences; with none, the whole pool is fair game.
        admitting = bool(self.running)
        cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
        for hits in [cached, []] if cached else [[]]:
            num_cached = len(hits) * self.pool.block_size
            n = self._num_new_tokens(req, budget, skip=num_cached)
            if n and self.kv.can_allocate(req, n, hits, admitting=admitting):
                if req.num_computed_tokens == 0 and self.pool.enable_prefix_caching:
                    self.num_prefix_queries += (req.num_tokens - 1) // self.pool.block_size
                self.kv.allocate(req, n, hits)
                req.num_computed_tokens += num_cached
                req.num_cached_tokens = num_cached
                return n
        return 0

    def _num_new_tokens(self, req: Request, budget: int, skip: int = 0) -> int:
        remaining = req.num_tokens - req.num_computed_tokens - skip
        if remaining > 1:  # a prompt (or recompute) chunk
            # Never out of the running decodes' budget: a prompt served ahead of them (an
            # aged one, under shortest-first) would otherwise stall the whole batch.
            budget -= self._decodes_due
            if self.config.enable_chunked_prefill:
                remaining = min(remaining, self.config.prefill_chunk_size)
                if self._prompt_allowance is not None:
                    remaining = min(remaining, self._prompt_allowance)
            elif remaining > budget:
                return 0  # unchunked prompts wait for a step with room for all of them
        return max(0, min(remaining, budget))

    def _emit(self, out: SchedulerOutput, req: Request, n: int, padding: bool = False) -> None:
        # A padding row recomputes the ended member's last computed position (its slot is
        # allocated); the sampled token is dropped.
        start = req.num_tokens - 2 if padding else req.num_computed_tokens
        tokens = req.token_slice(start, start + n)
        sample = start + n >= req.num_tokens
        sched = ScheduledRequest(
            request_id=req.request_id,
            token_ids=tokens,
            start_position=start,
            block_ids=list(self.kv.block_table(req.request_id)),
            sample=sample,
            sampling=req.sampling,
            seed=req.seed,
            num_output_tokens=req.num_output_tokens,
            prompt_ids=req.prompt_token_ids,
            output_ids=req.output_token_ids,
            eos_token_ids=req.eos_token_ids,
            forks=tuple(range(1, req.sampling.n)) if sample and req.forks_pending else (),
        )
        # One token at a prompt position (a chunk's remainder, a prompt cached but its last
        # token) is a prefill row: a row attends as prompt or as output by its position alone.
        decode = n == 1 and (padding or start >= len(req.prompt_token_ids))
        (out.decodes if decode else out.prefills).append(sched)
        if not padding:
            self.policy.served(req, n, decode)
        if n == 1 and not padding and req.is_decoding:
            self._decodes_due = max(0, self._decodes_due - 1)
        if n > 1 and self._prompt_allowance is not None:
            self._prompt_allowance = max(0, self._prompt_allowance - n)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.paced_since = None  # paced afresh from its next token, once recomputed
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)
        self.policy.preempted(req)

    def check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """The status that `token` ends the request with, or None."""
        sp = req.sampling
        # Before min_tokens, EOS and stop tokens are never drawn, nor do they end a request.
        # A prefill (stop_after) draws with them but leaves ending to the decode worker.
        if req.stop_after is None and req.num_output_tokens >= sp.min_tokens:
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        # A constrained sequence draws EOS only where its grammar may end: it ends there.
        if req.stop_after is None and sp.constraint is not None and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if req.stop_after is not None and req.num_output_tokens >= req.stop_after:
            return RequestStatus.FINISHED_LENGTH
        return None
