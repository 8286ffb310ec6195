import numpy as np
import pytest
import torch

from workers.engine.sampler import (
    FilterPlan,
    SamplingTensors,
    _apply_filters,
    row_uniforms,
    sample,
)


def uniforms(seeds, counters) -> torch.Tensor:
    return torch.from_numpy(row_uniforms(seeds, counters))


def tensors(
    n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, counters=None, logprobs=False, vocab=49152
):
    seeds = seeds if seeds is not None else list(range(n))
    return SamplingTensors(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), float(top_p)),
        uniforms=uniforms(seeds, counters if counters is not None else [0] * n),
        all_greedy=temperature == 0,
        filters=FilterPlan.of([top_k] * n, [top_p] * n, vocab),
        want_logprobs=logprobs,
    )


def filters(logits, top_k, top_p, sort_all=False):
    """_apply_filters with the plan the runner makes from the rows' parameters."""
    plan = FilterPlan.of(top_k.tolist(), top_p.tolist(), logits.shape[-1], sort_all)
    return _apply_filters(logits, top_k, top_p, plan) if plan is not None else logits


def test_greedy_is_argmax_with_its_logprob():
    logits = torch.randn(5, 100)
    out = sample(logits, tensors(5, temperature=0, logprobs=True))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).max(-1).values
    torch.testing.assert_close(out.logprobs, expected)


def test_uniforms_are_uniform_and_a_pure_function_of_seed_and_counter():
    seeds = torch.arange(200_000, dtype=torch.long)
    u = uniforms(seeds, torch.full_like(seeds, 3))
    assert torch.equal(u, uniforms(seeds.clone(), torch.full_like(seeds, 3)))
    assert not torch.equal(u, uniforms(seeds, torch.full_like(seeds, 4)))
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # Uniform over the unit interval: every one of 100 bins holds about 1% of the draws.
    counts = torch.histc(u.float(), bins=100, min=0, max=1)
    assert counts.min() > 1600 and counts.max() < 2400


def test_uniforms_on_the_host_are_the_draws_seeded_requests_always_had():
    """The hash moved from device kernels to NumPy on the host: the same bits, so a seeded
    request draws what it drew before (values from the device version, as hex floats)."""
    seeds = [0, 1, 42, 2**63 - 1, 1234567890123456789]
    counters = [0, 7, 3, 4098, 1 << 20]
    want = ["0x1.0e9a2p-34", "0x1.a5f875187a46cp-3", "0x1.127b0682af03bp-1"]
    want += ["0x1.4608404332ac9p-1", "0x1.2e156c0d75a38p-4"]
    got = row_uniforms(np.array(seeds, dtype=np.uint64), counters)
    assert [float.hex(float(u)) for u in got] == [float.hex(float.fromhex(w)) for w in want]


def test_uniforms_never_reach_zero_or_one_over_millions_of_pairs():
    """5 million (seed, position) pairs, seeds spread over all 64 bits: each uniform is an
    odd multiple of 2**-53, so never 0 or 1, whatever the hash gives."""
    for start in range(0, 5_000_000, 1_000_000):
        i = torch.arange(start, start + 1_000_000, dtype=torch.long)
        seeds = i * 0x9E3779B97F4A7C15 + (1 << 40)  # wraps: negative seeds too
        u = uniforms(seeds, i % 4099)
        assert 0 < u.min().item() and u.max().item() < 1
        k = u * 2.0**53
        assert torch.equal(k, k.round()) and bool((k.long() % 2 == 1).all())
    # What the draw needs: u * total strictly inside (0, total) for any total near 1.
    totals = torch.tensor([1 - 2.0**-40, 1.0, 1 + 2.0**-40], dtype=torch.float64)
    top = torch.tensor(1 - 2.0**-53, dtype=torch.float64)
    assert bool(((top * totals) < totals).all()) and bool(((2.0**-53 * totals) > 0).all())


def test_a_draw_never_leaves_the_support_of_its_filters():
    """3,000 seeded first-token draws over a real-sized vocabulary: with top_k=20 or a
    nucleus, every token is inside the support (the exact uniform's whole point)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(49152, generator=gen) * 3
    top20 = set(logits.topk(20).indices.tolist())
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    top80 = set(order[: int((sorted_p.cumsum(0) - sorted_p < 0.8).sum())].tolist())
    for start in range(0, 3000, 250):
        seeds = list(range(start, start + 250))
        rows = logits.expand(250, -1).contiguous()
        k = sample(rows, tensors(250, top_k=20, seeds=seeds)).token_ids.tolist()
        p = sample(rows, tensors(250, top_p=0.8, seeds=seeds)).token_ids.tolist()
        assert set(k) <= top20 and set(p) <= top80
        assert len(set(k)) > 10  # and spread over it, not collapsed onto a few tokens


def nucleus(row: torch.Tensor, k: int, p: float) -> tuple[set, set]:
    """Reference top-k/top-p in float64 from a sort of the whole row: the tokens kept (every
    token tied with the last one kept stays too), and those so near the cut (mass before
    them within 1e-9 of p) that rounding may place them either side."""
    ordered, order = row.double().sort(descending=True)
    ordered, order = ordered[: k or None], order[: k or None]
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    keep = before < p
    keep[0] = True
    threshold = ordered[keep][-1]
    near = order[(before - p).abs() < 1e-9]
    return set(torch.nonzero(row.double() >= threshold).flatten().tolist()), set(near.tolist())


def filter_rows(scale: float):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 49152, generator=gen) * scale
    top = logits[1].topk(22).indices
    logits[1, top[18:22]] = logits[1, top[18]].item()  # a tie across the top-20 cut
    top_k = torch.tensor([0, 20, 0, 3000, 0, 1], dtype=torch.long)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.95, 0.3, 0.5])
    return logits, top_k, top_p


@pytest.mark.parametrize("sort_all", [False, True])  # the CPU's plan, and a GPU's
@pytest.mark.parametrize("scale", [3.0, 0.05])  # peaked, and so flat the nucleus is wide
def test_candidate_filters_keep_the_nucleus_and_leave_unfiltered_rows_whole(scale, sort_all):
    """top-k / top-p from each row's best candidates keep what a float64 sort of the whole
    vocabulary keeps (ties at the cut included); a nucleus wider than the candidates (the
    flat rows) falls back to the full sort; a row with no filter keeps every token. Checked
    with 1,024 candidates (no wide top-k in the batch) and with 3,000."""
    logits, top_k, top_p = filter_rows(scale)
    for rows in ([0, 1, 2, 4, 5], [0, 1, 2, 3, 4, 5]):
        got = filters(logits[rows], top_k[rows], top_p[rows], sort_all)
        for g, r in zip(got, rows):
            if r == 2:
                assert torch.equal(g, logits[2])  # no filter on that row: nothing masked
                continue
            kept = set(torch.nonzero(~g.isinf()).flatten().tolist())
            want, near = nucleus(logits[r], int(top_k[r]), float(top_p[r]))
            assert not (kept ^ want) - near, r
            assert torch.equal(g[~g.isinf()], logits[r][~g.isinf()])
        assert (~got[1].isinf()).sum() == 22  # the top 20, and the two tied with the 20th


@pytest.mark.parametrize("scale", [3.0, 0.05])
def test_a_filtered_row_masks_and_draws_the_same_whatever_its_batch(scale):
    """A row's filters and draw depend on it alone: the same row, alone and batched with rows
    that widen the candidates or force the full sort, is masked and sampled the same; and the
    same whether the plan asks the device (a CPU's) or sorts at once (a GPU's)."""
    logits, top_k, top_p = filter_rows(scale)
    for r in (0, 1, 3, 4, 5):
        alone = filters(logits[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])[0]
        for batch in ([r, 2], [r, 1], [r, 3], [r, 0], [0, 1, 2, 3, 4, 5]):
            for sort_all in (False, True):
                got = filters(logits[batch], top_k[batch], top_p[batch], sort_all)
                assert torch.equal(got[batch.index(r)], alone), (r, batch, sort_all)
        t = tensors(1, top_k=int(top_k[r]), top_p=float(top_p[r]), seeds=[9], counters=[4])
        drawn = sample(logits[r : r + 1], t).token_ids[0]
        batch = [0, 1, 2, 3, 4, 5]
        tb = SamplingTensors(
            temperature=torch.ones(6),
            top_k=top_k,
            top_p=top_p,
            uniforms=uniforms([9] * 6, [4] * 6),
            all_greedy=False,
            filters=FilterPlan.of(top_k.tolist(), top_p.tolist(), logits.shape[-1]),
            want_logprobs=False,
        )
        assert sample(logits[batch], tb).token_ids[r] == drawn


def test_same_seed_same_draw_whatever_the_batch():
    logits = torch.randn(4, 1000)
    alone = sample(logits[2:3], tensors(1, seeds=[42], counters=[5])).token_ids
    batch = sample(logits, tensors(4, seeds=[1, 2, 42, 3], counters=[0, 0, 5, 9])).token_ids
    assert batch[2] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    ids = sample(logits, tensors(n, seeds=list(range(n)))).token_ids
    freq = torch.bincount(ids, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, 5).contiguous()
    k2 = sample(logits, tensors(2000, top_k=2, seeds=list(range(2000)), vocab=5)).token_ids
    assert set(k2.tolist()) == {0, 1}
    # softmax: [0.636, 0.234, 0.086, ...]: top_p=0.8 keeps the first two.
    p = sample(logits, tensors(2000, top_p=0.8, seeds=list(range(2000)), vocab=5)).token_ids
    assert set(p.tolist()) == {0, 1}
    tiny = sample(logits[:50], tensors(50, top_p=0.01, seeds=list(range(50)), vocab=5)).token_ids
    assert set(tiny.tolist()) == {0}  # the most likely token always stays


def test_low_temperature_sharpens_and_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(1000, 3).contiguous()
    cold = sample(logits, tensors(1000, temperature=0.05, seeds=list(range(1000)))).token_ids
    assert (cold == 0).float().mean() > 0.99
    t = tensors(1000, temperature=5.0, seeds=list(range(1000)))
    t.temperature[:500] = 0
    t.all_greedy = False
    ids = sample(logits, t).token_ids
    assert (ids[:500] == 0).all() and len(set(ids[500:].tolist())) == 3


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """As vLLM: logits / 1e-40 overflow to inf and the softmax to NaN, which drew the last id
    of the vocabulary; under GREEDY_BELOW the row is the argmax, in a batch or alone."""
    from workers.engine.request import SamplingParams

    assert SamplingParams(temperature=temperature).greedy
    logits = torch.randn(8, 1000) * 5
    t = tensors(8, temperature=temperature)
    t.all_greedy = False  # a mixed batch takes the sampling path
    assert sample(logits, t).token_ids.tolist() == logits.argmax(-1).tolist()
