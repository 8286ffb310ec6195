"""One step's limits beside the scheduler's core: pacing and first-token yields.

`Gatekeeper.open` builds a `StepGate` at the start of each `schedule()`; the gate lives for
that step alone and answers, as the step is built:
- may this decode run now (`holds_back`): a decode waits a step when its tenant, over its
  share of the seats, yields to another tenant's first token, or when it has no TPOT target
  of its own and pacing's decode cap is spent; none waits past MAX_DECODE_PAUSE_S since it
  last ran;
- how many tokens may this request's chunk take (`new_tokens`): never the running decodes'
  share of the budget, and under pacing (pacing.py) or decode-first (`prefill_share`) only
  what the running sequences can spare;
- whose decodes yield (`yielding`): when the first waiting request gets its seat, its blocks
  and its whole prompt in this step, the tenants over their share (the seat policy says
  which) wait that one step, so the first token comes from a short step. Once per request.

What outlives a step is the Gatekeeper's: pacing's cost model, fed the time between steps'
starts; when each held decode was first held back; the last request others yielded to.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.engine.config import SchedulerConfig
from workers.engine.kv_manager import KVCacheManager
from workers.engine.pacing import MAX_DECODE_PAUSE_S, DecodePacer
from workers.engine.policy import SeatPolicy
from workers.engine.request import Request
from workers.engine.scheduler_output import SchedulerOutput


class StepGate:
    """One step's limits, spent as the step is built: the running decodes' budget, the
    prompt tokens pacing allows, the decodes without a target pacing lets run, and whose
    decodes yield. Made by `Gatekeeper.open`; nothing of it outlives the step."""

    def __init__(
        self,
        keeper: Gatekeeper,
        decodes_due: int,
        prompt_allowance: int | None,
        decode_cap: int | None,
        now: float,
    ) -> None:
        self.keeper = keeper
        self.config = keeper.config
        self.decodes_due = decodes_due  # running decodes not yet served: their budget
        self.prompt_allowance = prompt_allowance  # prompt tokens left to take; None: no limit
        self.decode_cap = decode_cap  # decodes without a TPOT target still allowed; None: any
        self.yielding: set[str] = set()  # tenants whose decodes wait this step
        self.now = now

    @property
    def prompts_paused(self) -> bool:
        """Pacing lets no prompt token into this step."""
        return self.prompt_allowance == 0

    def holds_back(self, req: Request) -> bool:
        """Whether `req`'s decode waits this step (its budget then goes to others)."""
        if self._waits(req):
            self.keeper.held(req.request_id)
            self.decodes_due = max(0, self.decodes_due - 1)
            return True
        self.keeper.forget(req.request_id)  # it runs: a later wait counts afresh
        return False

    def _waits(self, req: Request) -> bool:
        if not req.is_decoding:
            return False
        yields = req.tenancy.tenant in self.yielding
        capped = self.decode_cap is not None and not self.keeper.pacer.target_of(req)
        if not (yields or capped):
            return False
        overdue = self.keeper.held_for(req.request_id) >= MAX_DECODE_PAUSE_S
        if overdue or (not yields and self.decode_cap > 0):
            if capped:
                self.decode_cap = max(0, self.decode_cap - 1)
            return False
        return True

    def new_tokens(self, req: Request, budget: int, skip: int = 0) -> int:
        """Tokens `req` may compute this step, out of `budget` (`skip`: prompt tokens found
        cached); 0 when it must wait."""
        remaining = req.num_tokens - req.num_computed_tokens - skip
        if remaining > 1:  # a prompt (or recompute) chunk
            # Never out of the running decodes' budget: a prompt served ahead of them (an
            # aged one, under shortest-first) would otherwise stall the whole batch.
            budget -= self.decodes_due
            if self.config.enable_chunked_prefill:
                remaining = min(remaining, self.config.prefill_chunk_size)
                if self.prompt_allowance is not None:
                    remaining = min(remaining, self.prompt_allowance)
            elif remaining > budget:
                return 0  # unchunked prompts wait for a step with room for all of them
        return max(0, min(remaining, budget))

    @staticmethod
    def defers_chunk(req: Request, n: int, out: SchedulerOutput) -> bool:
        """Under an admits-ahead policy, a chunk that does not end its prompt only goes into
        a step with no other prompt chunk: one long prompt advances at a time (as vLLM's
        max_num_partial_prefills=1), and a step that ends short prompts stays short."""
        partial = 1 < n < req.num_tokens - req.num_computed_tokens
        return partial and bool(out.prefills)

    def took(self, req: Request, n: int, padding: bool = False) -> None:
        """`n` tokens of `req` went into the step."""
        if n == 1 and not padding and req.is_decoding:
            self.decodes_due = max(0, self.decodes_due - 1)
        if n > 1 and self.prompt_allowance is not None:
            self.prompt_allowance = max(0, self.prompt_allowance - n)


class Gatekeeper:
    """What the steps' gates share across steps, and the maker of each step's gate. Called
    by the scheduler alone (the engine's loop thread)."""

    def __init__(
        self,
        config: SchedulerConfig,
        policy: SeatPolicy,
        block_size: int,
        clock: Callable[[], float],
    ) -> None:
        self.config, self.policy, self.clock = config, policy, clock
        self.block_size = block_size
        # With chunked prefill, pacing keeps the engine's target_tpot_ms, and each request's
        # own tpot_slo_ms (its tenancy); with neither, it limits nothing.
        target = config.target_tpot_ms / 1000 if config.target_tpot_ms else None
        self.pacer = DecodePacer(target, block_size) if config.enable_chunked_prefill else None
        self._held_back: dict[str, float] = {}  # decodes held back, since when
        self._yielded_for: str | None = None  # the last request others' decodes waited for
        self._began: float | None = None  # when the last step with work began
        self._landed: SchedulerOutput | None = None  # the last step whose tokens came in

    def open(
        self, running: list[Request], waiting: list[Request], kv: KVCacheManager, admit: bool
    ) -> StepGate:
        """This step's gate, over the batch as it stands once seats have changed hands;
        `waiting` is in the policy's order, and `admit` says whether this step admits."""
        decoding = [r for r in running if r.is_decoding]
        allowance = cap = None
        now = self.clock() if self.pacer is not None else 0.0
        if self.pacer is not None:
            self._observe_last_step(now)
            allowance = self.pacer.prompt_allowance(decoding, now, self.config.max_model_len)
            cap = self.pacer.decode_cap(decoding)
        share = self.config.prefill_share
        if decoding and share < 1:  # decode-first: prompts take at most this share
            most = max(self.block_size, int(share * self.config.max_num_batched_tokens))
            allowance = most if allowance is None else min(most, allowance)
        gate = StepGate(self, len(decoding), allowance, cap, now)
        if admit:
            gate.yielding = self._yielding_to_first_token(gate, running, waiting, kv)
        return gate

    def close(self, gate: StepGate, out: SchedulerOutput) -> None:
        """The step is scheduled: pacing times the span to the next one's start."""
        if self.pacer is not None and out.scheduled:
            self._began = gate.now

    def landed(self, out: SchedulerOutput) -> None:
        """A step's tokens came in: the span in which they did is charged to its shape."""
        self._landed = out

    def held(self, request_id: str) -> None:
        """Its decode is held back this step: since now, unless it already was."""
        self._held_back.setdefault(request_id, self.clock())

    def held_for(self, request_id: str) -> float:
        """Seconds its decode has been held back since it last ran (0: it is not)."""
        since = self._held_back.get(request_id)
        return 0.0 if since is None else self.clock() - since

    def forget(self, request_id: str) -> None:
        """It ran, or it ended: a later hold counts afresh."""
        self._held_back.pop(request_id, None)

    def idle(self) -> None:
        """Nothing is left to run: the next step's start times nothing."""
        self._began = self._landed = None

    def _observe_last_step(self, now: float) -> None:
        """Pacing learns what a step costs from the time between two steps' starts: the model
        run and all the worker does around it (its outputs handed on, commands applied),
        which is what the sequences' tokens wait for. The span is charged to the step that
        landed in it: the one it began, or with overlap (engine.py) the one before, whose
        device time the span waited out."""
        began, out = self._began, self._landed
        self._began = self._landed = None
        if began is not None and out is not None:
            prompt_tokens = sum(p.num_tokens for p in out.prefills)
            self.pacer.observe(len(out.decodes), prompt_tokens, now - began, now)

    def _yielding_to_first_token(
        self, gate: StepGate, running: list[Request], waiting: list[Request], kv: KVCacheManager
    ) -> set[str]:
        if not waiting or waiting[0].request_id == self._yielded_for:
            return set()
        first = waiting[0]
        seqs = sum(r.sampling.n if r.forks_pending else 1 for r in [*running, first])
        if seqs > self.config.max_num_seqs:
            return set()
        left = first.num_tokens - first.num_computed_tokens
        room = self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill:
            room = min(room, self.config.prefill_chunk_size)
            if gate.prompt_allowance is not None:
                room = min(room, gate.prompt_allowance)
        if left > room or not kv.can_allocate(first, left, admitting=bool(running)):
            return set()
        yielding = self.policy.yielding_to(first, running, self.config.max_num_seqs)
        if yielding:
            self._yielded_for = first.request_id
        return yielding
