"""Iteration-level scheduling (Orca): every step picks work within a token budget.

Each step:
0. with every seat (`max_num_seqs`) taken, a waiting request that fair share owes a seat
   takes that of a running request the seat policy names (preempted: recompute);
1. running requests, in policy order, get their next token (decode) or next prompt chunk;
   one that needs a block when none is free preempts the policy's last running request
   (recompute: its blocks are freed, and it later re-prefills its prompt and outputs so far);
2. if nothing was preempted, waiting requests are admitted, in policy order, while their
   first chunk's blocks fit and the budget and `max_num_seqs` allow. A policy that
   `admits_ahead` (shortest-first) merges the two: before each running request is served,
   the waiting ones with smaller keys are admitted.

What a step may take beside blocks and budget (decode pacing, first-token yields, one
partial prompt at a time under shortest-first) is asked of the step's gate (step_gate.py),
built for the step and dropped after it; the order and who gives up a seat, of the seat
policy (policy.py). Static batching is request-level scheduling as in HF `generate`: a group
is admitted only when the previous one has entirely finished, and a member that ends early
keeps its batch slot as padding (its last position recomputed each step, the token dropped)
until the group's longest member ends; its blocks are freed with the group.

The scheduler is pure bookkeeping: it never touches tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.engine.block_pool import BlockPool
from workers.engine.config import SchedulerConfig
from workers.engine.kv_manager import KVCacheManager
from workers.engine.policy import make_policy
from workers.engine.request import (
    PENDING,
    ErrorKind,
    Request,
    RequestStatus,
    choice_id,
    drop,
    ends_by_length,
    stop_status,
)
from workers.engine.scheduler_output import SampledToken, ScheduledRequest, SchedulerOutput
from workers.engine.step_gate import Gatekeeper, StepGate


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.pool = pool
        self.kv = KVCacheManager(pool, watermark_blocks=int(config.watermark * pool.num_blocks))
        self.policy = make_policy(
            config.policy, config.fair_share, config.aging_per_s, config.max_wait_s
        )
        # Pacing and first-token yields: what limits a step beside blocks and the budget.
        self.gates = Gatekeeper(config, self.policy, pool.block_size, clock)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0  # lifetime count, for metrics and tests
        self.num_prefix_queries = 0  # full prompt blocks looked up at admission, for metrics
        self.padding: list[Request] = []  # static batching: ended members still in the group

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
        was_running = drop(self.running, req)
        if not was_running:
            drop(self.waiting, req)
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
        self.gates.forget(request_id)
        if not self.requests:  # the loop idles now: the next step's start times nothing
            self.gates.idle()
        return req

    # -- disaggregation: blocks reserved ahead of a KV transfer (kv.reserved_blocks, .release)
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Hold blocks for a prompt whose KV will arrive from a prefill worker; None when
        they do not fit now. Decode reserves first, so a transfer never lands in a full cache."""
        if request_id in self.requests or request_id in self.kv.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.kv.reserve(request_id, num_tokens)

    def add_prefilled(self, req: Request) -> None:
        """Admit a request whose KV (for every token but the last output token, just sampled)
        fills its reserved blocks: it joins the running batch at its next decode."""
        if req.request_id not in self.kv.reserved:
            raise ValueError(f"request {req.request_id!r} has no reserved blocks")
        assert req.output_token_ids, "a prefilled request carries its first token"
        need = self.kv.blocks_needed(req.num_tokens - 1)
        if need > len(self.kv.block_table(req.request_id)):
            raise ValueError(f"request {req.request_id!r} reserved fewer than {need} blocks")
        self.kv.claim(req.request_id)
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
            self._swap_seats()
        gate = self.gates.open(self.running, self.waiting, self.kv, admit)
        budget = self._schedule_running(out, budget, gate, admit and self.policy.admits_ahead)
        for ghost in self.padding:
            if budget <= 0:
                break
            budget -= 1
            self._emit(out, gate, ghost, 1, padding=True)
        if admit and not out.preempted_ids:  # room was just made by force: admit nothing
            self._schedule_waiting(out, gate, budget)
        out.block_copies = self.kv.take_copies()
        self.policy.end_step()
        self.gates.close(gate, out)
        return out

    def _swap_seats(self) -> None:
        """Every seat taken and waiting requests owed one (fair share): the running requests
        the policy names give their seats up, preempted before anything is scheduled this
        step, and the waiting ones are admitted first in their place."""
        swaps = self.policy.seat_swaps(self.waiting, self.running, self.config.max_num_seqs)
        for victim, _ in swaps:
            self._preempt(victim)
        given = [w for _, w in swaps]
        if given:
            seated = {id(r) for r in given}
            self.waiting = given + [r for r in self.waiting if id(r) not in seated]

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, gate: StepGate, ahead: bool
    ) -> int:
        self.running.sort(key=self.policy.key)
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted (or failed) earlier in this loop to make room
            if ahead and not out.preempted_ids:
                budget = self._schedule_waiting(out, gate, budget, before=self.policy.key(req))
            if req.pending and ends_by_length(req, self.config.max_model_len):
                continue  # the token in flight is its last, whatever its value
            if gate.holds_back(req):
                continue
            n = gate.new_tokens(req, budget)
            if n == 0 or (ahead and gate.defers_chunk(req, n, out)):
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
                self._emit(out, gate, req, n)
        return budget

    def _schedule_waiting(
        self, out: SchedulerOutput, gate: StepGate, budget: int, before=None
    ) -> int:
        """Admit waiting requests in policy order (`waiting` is sorted by `schedule`; only
        those whose key is below `before`, when given); returns the budget left."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if before is not None and self.policy.key(req) >= before:
                break
            if req.pending and ends_by_length(req, self.config.max_model_len):
                i += 1  # preempted with its last token in flight: nothing left to compute
                continue
            ahead = self.policy.admits_ahead
            if ahead and gate.defers_chunk(req, gate.new_tokens(req, budget), out):
                i += 1
                continue
            # A request that will fork counts all its choices against max_num_seqs, and so do
            # running ones that have not forked yet.
            seqs = sum(r.sampling.n if r.forks_pending else 1 for r in [*self.running, req])
            if self.running and seqs > self.config.max_num_seqs:
                break
            n = self._admit(req, gate, budget)
            if n == 0:
                if self.running or gate.prompts_paused or self._held_elsewhere():
                    break  # wait for running requests or transfers to free blocks, or pacing
                # An empty cache has no room for it: it can never fit.
                self._fail_unfittable(req, out)
                continue
            self.waiting.pop(i)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.policy.admitted(req)
            budget -= n
            self._emit(out, gate, req, n)
        return budget

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
        """`advance` and `resolve` at once: the step's tokens are already on the host."""
        self.advance(out)
        return self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """What a step changes before its tokens are known: each scheduled request counts
        its computed tokens and publishes its full blocks, and a row that samples appends
        PENDING, which `resolve` replaces. The next step may be scheduled in between: it
        computes the pending token (the model runner fetches its value on the device)."""
        for sched in out.scheduled:
            req = self.requests.get(sched.request_id)
            if req is None:
                continue  # cancelled while the step ran; its blocks are already free
            out.advanced[req.request_id] = req
            req.num_computed_tokens += sched.num_tokens
            self.kv.publish(req)  # every token it hashes was resolved before this step ran
            if sched.sample:
                req.output_token_ids.append(PENDING)

    def advanced(self, out: SchedulerOutput, request_id: str) -> Request | None:
        """The request `advance` advanced under this id, if it is still live here (not
        ended, nor its id taken again by another)."""
        req = out.advanced.get(request_id)
        return req if req is not None and self.requests.get(request_id) is req else None

    def resolve(
        self, out: SchedulerOutput, sampled: list[SampledToken]
    ) -> list[tuple[Request, list[int]]]:
        """The step's tokens in place of its PENDING ones (forks made first); returns
        (request, new token ids) for each that gained a token, ended ones having released
        their blocks."""
        by_id = {s.request_id: s for s in sampled}
        results = []
        now = self.clock()
        for sched in out.scheduled:
            req = self.advanced(out, sched.request_id)
            if req is None or not sched.sample:
                continue  # ended while the step ran: its token is dropped with it
            assert req.pending, f"{req.request_id}: resolved without a pending token"
            members = [(req, by_id[sched.request_id])]
            for index in sched.forks:  # before the parent may end and free its blocks
                child = self._fork(req, index)  # shares the parent's computed tokens
                members.append((child, by_id[choice_id(req.request_id, index)]))
            req.output_token_ids.pop()
            for r, t in members:
                r.output_token_ids.append(t.token_id)
                if t.logprob is not None:
                    r.output_logprobs.append(t.logprob)
                if t.top_logprobs is not None:
                    r.output_top_logprobs.append(t.top_logprobs)
                if r.paced_since is None and r.status is RequestStatus.RUNNING:
                    r.paced_since = (now, r.num_output_tokens)
                status = stop_status(r, t.token_id, self.config.max_model_len)
                if status is not None:
                    self.finish_request(r.request_id, status)
                results.append((r, [t.token_id]))
        self.gates.landed(out)
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
        child = parent.fork(index)
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.policy.inherit(child, parent)  # served, and preempted, as its parent
        self.running.append(child)
        self.kv.fork(parent.request_id, child.request_id)
        return child

    # -- helpers --------------------------------------------------------------------------
    def _admit(self, req: Request, gate: StepGate, budget: int) -> int:
        """Reserve blocks for a waiting request's first chunk; returns its size, 0 if it
        does not fit. Prefix hits are used when they fit, else the prefix is recomputed."""
        # The watermark only protects running sequences; with none, the whole pool is fair game.
        admitting = bool(self.running)
        cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
        for hits in [cached, []] if cached else [[]]:
            num_cached = len(hits) * self.pool.block_size
            n = gate.new_tokens(req, budget, skip=num_cached)
            if n and self.kv.can_allocate(req, n, hits, admitting=admitting):
                if req.num_computed_tokens == 0 and self.pool.enable_prefix_caching:
                    self.num_prefix_queries += (req.num_tokens - 1) // self.pool.block_size
                self.kv.allocate(req, n, hits)
                req.num_computed_tokens += num_cached
                req.num_cached_tokens = num_cached
                return n
        return 0

    def _emit(
        self, out: SchedulerOutput, gate: StepGate, req: Request, n: int, padding: bool = False
    ) -> None:
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
        gate.took(req, n, padding)

    def _preempt(self, req: Request) -> None:
        drop(self.running, req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.paced_since = None  # paced afresh from its next token, once recomputed
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)
        self.policy.preempted(req)
