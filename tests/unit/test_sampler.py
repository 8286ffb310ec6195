import torch

from workers.engine.sampler import SamplingTensors, sample, uniform_noise


def tensors(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, counters=None, logprobs=False):
    t = torch.full((n,), float(temperature))
    return SamplingTensors(
        temperature=t,
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), float(top_p)),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.long),
        counters=torch.tensor(counters if counters is not None else [0] * n, dtype=torch.long),
        all_greedy=temperature == 0,
        any_filter=top_k > 0 or top_p < 1,
        want_logprobs=logprobs,
    )


def test_greedy_is_argmax_with_its_logprob():
    logits = torch.randn(5, 100)
    out = sample(logits, tensors(5, temperature=0, logprobs=True))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).max(-1).values
    torch.testing.assert_close(out.logprobs, expected)


def test_noise_is_uniform_and_a_pure_function_of_seed_and_counter():
    u = uniform_noise(torch.tensor([7, 7, 8]), torch.tensor([3, 3, 3]), 50000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


def test_noise_never_reaches_zero_or_one_over_millions_of_draws():
    """Every value of the noise for 2,000 (seed, position) pairs over a 49,152-token
    vocabulary (98 million): none may be 0 or 1, where -log(u) would be inf or 0 and the
    Gumbel-max draw would pick a token whatever its probability."""
    lo, hi = 1.0, 0.0
    for start in range(0, 2000, 100):
        seeds = torch.arange(start, start + 100, dtype=torch.long) * 7919 + (1 << 40)
        counters = torch.arange(start, start + 100, dtype=torch.long) % 997
        u = uniform_noise(seeds, counters, 49152)
        lo, hi = min(lo, u.min().item()), max(hi, u.max().item())
        assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()
    assert 0 < lo and hi < 1
    assert lo == 2.0**-24 and hi == 1 - 2.0**-24  # the grid's ends are reached, not passed


def test_a_draw_never_leaves_the_support_of_its_filters():
    """3,000 seeded first-token draws over a real-sized vocabulary: with top_k=20 or a
    nucleus, every token is inside the support (the exact noise's whole point)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(49152, generator=gen) * 3
    top20 = set(logits.topk(20).indices.tolist())
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) - sorted_p < 0.8).sum())].tolist())
    for start in range(0, 3000, 250):
        seeds = list(range(start, start + 250))
        rows = logits.expand(250, -1).contiguous()
        k = sample(rows, tensors(250, top_k=20, seeds=seeds)).token_ids.tolist()
        p = sample(rows, tensors(250, top_p=0.8, seeds=seeds)).token_ids.tolist()
        assert set(k) <= top20 and set(p) <= nucleus


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
    k2 = sample(logits, tensors(2000, top_k=2, seeds=list(range(2000)))).token_ids
    assert set(k2.tolist()) == {0, 1}
    # softmax: [0.636, 0.234, 0.086, ...]: top_p=0.8 keeps the first two.
    p = sample(logits, tensors(2000, top_p=0.8, seeds=list(range(2000)))).token_ids
    assert set(p.tolist()) == {0, 1}
    tiny = sample(logits[:50], tensors(50, top_p=0.01, seeds=list(range(50)))).token_ids
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
