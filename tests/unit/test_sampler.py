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
