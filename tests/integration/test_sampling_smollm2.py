"""Sampled first tokens of SmolLM2 (fp32) through the offline engine, held against the softmax
transformers computes for the same prompt:

- 3,000 draws (seeds 0..2999) per filter, none outside its support (top-k, top-p, min-p);
- the counts against the filtered, renormalized distribution: a binned chi-square statistic,
  bounded by the spread of an exact multinomial sampler drawing as many tokens from the same
  distribution. Seeds are fixed, so the test is deterministic: it cannot flake, and a sampler
  whose draws are not distributed as the model says fails it.
"""

import pytest
import torch

from tests.reference import hf_logits, hf_model
from workers.engine.request import SamplingParams
from workers.offline import LLM, GenerationRequest

pytestmark = pytest.mark.integration

DRAWS = 3000
PROMPT = "Name one animal that lives in the sea."
TOL = 1e-3  # logits: engine and transformers agree to ~1e-5 in fp32


@pytest.fixture(scope="module")
def setup():
    # Blocks of 2 tokens: every draw finds all but the prompt's last token in the prefix
    # cache (filled by the first request), so 3,000 draws cost about 3,000 tokens of compute.
    llm = LLM(
        dtype="float32",
        block_size=2,
        num_kv_blocks=2048,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )
    ids = llm.tokenizer.encode_chat(PROMPT)
    llm.generate([GenerationRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_tokens=1))])
    logits = hf_logits(hf_model(llm.engine.source), ids)[-1].double()
    return llm, ids, logits


def draw(llm, ids, **kw) -> torch.Tensor:
    reqs = [
        GenerationRequest(
            prompt_ids=tuple(ids), sampling=SamplingParams(max_tokens=1, seed=s, **kw)
        )
        for s in range(DRAWS)
    ]
    out = llm.generate(reqs)
    assert all(len(c.token_ids) == 1 for c in out)
    return torch.tensor([c.token_ids[0] for c in out])


def support(logits: torch.Tensor, slack: float, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The tokens each filter keeps, in vLLM's order (min-p, then top-k, then top-p),
    computed directly; `slack` widens every cut by that much logit."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p:
        keep &= logits >= logits.max() + torch.log(torch.tensor(min_p)).double() - slack
    order = logits.masked_fill(~keep, float("-inf")).sort(descending=True)
    if top_k:
        keep &= logits >= order.values[top_k - 1] - slack
    if top_p < 1:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_p = probs[order.indices]
        before = sorted_p.cumsum(0) - sorted_p
        last = order.values[int((before < top_p).sum()) - 1]
        keep &= logits >= last - slack
    return keep


def chi_square(counts: torch.Tensor, expected: torch.Tensor, bins: torch.Tensor) -> float:
    """Tokens with an expected count >= 5 alone, the rest pooled into one bin."""
    obs = torch.cat([counts[bins], counts[~bins].sum()[None]])
    exp = torch.cat([expected[bins], expected[~bins].sum()[None]])
    live = exp > 0
    return float((((obs - exp) ** 2)[live] / exp[live]).sum())


def multinomial_bound(p: torch.Tensor, bins: torch.Tensor, sims: int = 400) -> float:
    g = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(sims):
        idx = torch.multinomial(p.float(), DRAWS, replacement=True, generator=g)
        counts = torch.bincount(idx, minlength=p.numel()).double()
        stats.append(chi_square(counts, p * DRAWS, bins))
    return max(stats) * 1.2


FILTERS = [
    pytest.param({}, id="plain"),
    pytest.param({"top_k": 20}, id="top_k"),
    pytest.param({"top_p": 0.8}, id="top_p"),
    pytest.param({"min_p": 0.05}, id="min_p"),
    pytest.param({"temperature": 0.7, "top_k": 50, "top_p": 0.9}, id="combined"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kw", FILTERS)
def test_draws_stay_in_support_and_follow_the_softmax(setup, kw):
    llm, ids, logits = setup
    filters = {k: v for k, v in kw.items() if k != "temperature"}
    scaled = logits / kw.get("temperature", 1.0)
    tokens = draw(llm, ids, **kw)
    loose = support(scaled, TOL, **filters)
    outside = sorted(set(tokens[~loose[tokens]].tolist()))
    assert not outside, f"drawn outside the support: {outside}"

    strict = support(scaled, 0.0, **filters)
    p = scaled.masked_fill(~strict, float("-inf")).softmax(-1)
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    bins = p * DRAWS >= 5
    stat, bound = chi_square(counts, p * DRAWS, bins), multinomial_bound(p, bins)
    assert stat <= bound, f"chi-square {stat:.1f} above an exact sampler's {bound:.1f}"
    # Not a trivial pass: the filters shrink the support, and a draw of the unfiltered
    # softmax would not fit this one.
    if filters:
        assert int(strict.sum()) < logits.numel()
