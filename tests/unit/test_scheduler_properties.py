"""Random admit / step / finish / cancel / preempt sequences against the real scheduler and
block pool: no block is leaked or double-freed, and every request finishes."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sched_helpers import EOS, make_request, make_scheduler
from workers.engine.request import RequestStatus, Tenancy
from workers.engine.scheduler_output import SampledToken

BLOCK = 4


def check_invariants(s):
    holders = Counter(b for table in s.kv.tables.values() for b in table)
    for table in s.kv.tables.values():
        assert len(table) == len(set(table)), "a block appears twice in one table"
    for block in s.pool.blocks:
        assert block.ref_count == holders[block.block_id], f"block {block.block_id} miscounted"
    assert s.pool.num_free_blocks == sum(1 for b in s.pool.blocks if b.ref_count == 0)
    padding = {r.request_id for r in s.padding}
    for rid in s.kv.tables:
        assert rid in s.requests or rid in padding, "a finished request still holds blocks"
    assert not padding or s.running, "padding outlived its static group"
    for req in s.running:
        need = -(-req.num_computed_tokens // BLOCK)
        assert len(s.kv.tables[req.request_id]) >= need


def step(s, token_for):
    out = s.schedule()
    sampled = [SampledToken(r.request_id, token_for(r)) for r in out.scheduled if r.sample]
    s.update_from_output(out, sampled)
    return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 40), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 9)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(4, 40),
    chunk=st.integers(1, 16),
    budget=st.integers(16, 64),
    caching=st.booleans(),
    batching=st.sampled_from(["continuous", "static"]),
    policy=st.sampled_from(["fcfs", "priority", "shortest-first", "sjf"]),
    fair=st.booleans(),
    prefill_share=st.sampled_from([1.0, 0.5, 0.1]),
)
def test_random_workloads_never_leak_and_always_finish(
    ops, num_blocks, chunk, budget, caching, batching, policy, fair, prefill_share
):
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        prefix_caching=caching,
        max_num_seqs=4,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=budget,
        batching=batching,
        policy=policy,
        fair_share=fair,
        aging_per_s=0.5,
        prefill_share=prefill_share,
    )
    ids = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, family = op
            rid = f"r{len(ids)}"
            # Requests of one family share a prompt prefix, exercising the prefix cache.
            # Two tenants of different weights and tiers, a prediction for some.
            tenancy = Tenancy(f"t{family % 2}", 1.0 + 2 * (family % 2), family // 2, family * 3.0)
            s.add_request(
                make_request(
                    rid, prompt_len, max_tokens, family, first_token=1 + family, tenancy=tenancy
                )
            )
            ids.append(rid)
        elif op[0] == "step":
            step(s, lambda r, x=op[1]: EOS if x == 0 else 5 + x)
        elif ids:
            s.finish_request(ids[op[1] % len(ids)], RequestStatus.FINISHED_CANCELLED)
        check_invariants(s)
    # Drain: every request ends within a bounded number of steps.
    for _ in range(2000):
        if not s.has_unfinished():
            break
        step(s, lambda r: 9)
        check_invariants(s)
    assert not s.has_unfinished()
    assert s.pool.num_free_blocks == s.pool.num_blocks
