"""Drive a Scheduler with hand-made model outputs: no model, no torch."""

from workers.engine.block_pool import BlockPool
from workers.engine.config import SchedulerConfig
from workers.engine.request import NO_TENANCY, Request, SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_output import SampledToken

EOS = 0


def make_scheduler(
    num_blocks=64, block_size=4, prefix_caching=True, clock=None, **cfg
) -> Scheduler:
    cfg.setdefault("watermark", 0.0)
    pool = BlockPool(num_blocks, block_size, prefix_caching)
    if clock is None:
        return Scheduler(SchedulerConfig(**cfg), pool)
    return Scheduler(SchedulerConfig(**cfg), pool, clock)


def make_request(
    rid, prompt_len=6, max_tokens=4, priority=0, first_token=1, tenancy=NO_TENANCY, **sp
) -> Request:
    prompt = [first_token + (i % 50) for i in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sp),
        eos_token_ids=(EOS,),
        priority=priority,
        tenancy=tenancy,
    )


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = [SampledToken(r.request_id, token) for r in out.scheduled if r.sample]
    return out, s.update_from_output(out, sampled)


def assert_no_leak(s: Scheduler):
    held = sum(len(t) for t in s.kv.tables.values())
    pool = s.pool
    assert pool.num_free_blocks + held >= pool.num_blocks - 0  # shared blocks counted per holder
    refs = [b.ref_count for b in pool.blocks]
    assert all(r >= 0 for r in refs)
    assert sum(1 for r in refs if r == 0) == pool.num_free_blocks
    if not s.has_unfinished():
        assert pool.num_free_blocks == pool.num_blocks
