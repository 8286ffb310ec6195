"""min_p, penalties, logit_bias, min_tokens and top_logprobs on the same logits as
transformers' own processors (where one exists) or vLLM's documented formula, built the way
the model runner builds them (`sampling_tensors` from scheduled rows)."""

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from cluster.requests_file import parse_request
from workers.engine.request import SamplingParams
from workers.engine.sampler import adjust_logits, apply_min_p, sample
from workers.engine.sampling_inputs import sampling_tensors
from workers.engine.scheduler_output import ScheduledRequest

VOCAB = 300
EOS = (2,)


def row(sp: SamplingParams, prompt=(5, 6, 7, 5), output=(), seed=0) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=f"r{seed}",
        token_ids=[1],
        start_position=len(prompt) + len(output),
        block_ids=[0],
        sample=True,
        sampling=sp,
        seed=seed,
        num_output_tokens=len(output),
        prompt_ids=list(prompt),
        output_ids=list(output),
        eos_token_ids=EOS,
    )


def adjusted(rows: list[ScheduledRequest], logits: torch.Tensor) -> torch.Tensor:
    return adjust_logits(logits, sampling_tensors(rows, logits.shape[-1], "cpu"))


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, VOCAB, generator=g) * 3


def test_repetition_penalty_equals_transformers_over_prompt_and_output(logits):
    prompt, output = [5, 6, 7, 5, 250], [9, 9, 6, 17]
    for penalty in (1.3, 0.7):
        sp = SamplingParams(repetition_penalty=penalty)
        ours = adjusted([row(sp, prompt, output)] * 3, logits)
        ids = torch.tensor([prompt + output] * 3)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_presence_and_frequency_follow_vllms_formula_on_the_output_only(logits):
    prompt, output = [5, 6, 7], [9, 9, 9, 6, 17]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)
    ours = adjusted([row(sp, prompt, output)], logits[:1])[0]
    # vLLM: logits -= frequency * count(output); logits -= presence * (count(output) > 0).
    expected = logits[0].clone()
    for t in set(output):
        n = output.count(t)
        expected[t] -= -0.25 * n + 0.5 * (n > 0)
    torch.testing.assert_close(ours, expected)
    assert ours[5] == logits[0, 5] and ours[7] == logits[0, 7]  # prompt-only tokens untouched


def test_penalties_touch_only_the_rows_that_ask(logits):
    rows = [
        row(SamplingParams(), output=[9, 9]),
        row(SamplingParams(repetition_penalty=2.0), output=[9, 9], seed=1),
        row(SamplingParams(), output=[9], seed=2),
    ]
    out = adjusted(rows, logits)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


def test_min_p_equals_transformers_warper(logits):
    for min_p in (0.02, 0.1, 0.5):
        ours = apply_min_p(logits, torch.full((3,), min_p))
        theirs = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(ours.isinf(), theirs.isinf())
        assert bool((ours.isinf().sum(-1) < VOCAB).all())  # the most likely token stays
    assert torch.equal(apply_min_p(logits, torch.zeros(3)), logits)


def test_min_tokens_equals_transformers_and_bans_stop_tokens_too(logits):
    prompt = [5, 6, 7]
    sp = SamplingParams(min_tokens=3, stop_token_ids=(40,), max_tokens=10)
    for n_out in range(5):
        output = [11] * n_out
        ours = adjusted([row(sp, prompt, output)], logits[:1])
        ids = torch.tensor([prompt + output])
        theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [*EOS, 40])(
            ids, logits[:1].clone()
        )
        assert torch.equal(ours, theirs), n_out
    # ignore_eos leaves EOS drawable; stop_token_ids stay banned.
    sp = SamplingParams(min_tokens=3, stop_token_ids=(40,), ignore_eos=True, max_tokens=10)
    out = adjusted([row(sp, prompt, [])], logits[:1])[0]
    assert out[40] == float("-inf") and out[EOS[0]] == logits[0, EOS[0]]


def test_logit_bias_adds_to_the_named_tokens_and_steers_greedy(logits):
    sp = SamplingParams(temperature=0, logit_bias={13: 100.0, 14: -5.5})
    out = adjusted([row(sp)], logits[:1])[0]
    expected = logits[0].clone()
    expected[13] += 100.0
    expected[14] -= 5.5
    torch.testing.assert_close(out, expected)
    t = sampling_tensors([row(sp)], VOCAB, "cpu")
    assert sample(logits[:1], t).token_ids.tolist() == [13]


def test_greedy_rows_take_the_argmax_after_penalties(logits):
    top = int(logits[0].argmax())
    sp = SamplingParams(temperature=0, frequency_penalty=2.0)
    t = sampling_tensors([row(sp, output=[top] * 50)], VOCAB, "cpu")
    assert sample(logits[:1], t).token_ids.tolist() != [top]


def test_top_logprobs_are_the_raw_distributions_best_and_the_token_its_own(logits):
    sp = SamplingParams(
        temperature=0.7, logprobs=True, top_logprobs=5, repetition_penalty=1.5, logit_bias={3: 9}
    )
    rows = [row(sp, seed=s) for s in range(3)]
    out = sample(logits, sampling_tensors(rows, VOCAB, "cpu"))
    raw = logits.log_softmax(-1)
    best = raw.topk(5, dim=-1)
    assert torch.equal(out.top_ids, best.indices)
    torch.testing.assert_close(out.top_logprobs, best.values)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])


def test_the_new_fields_are_validated_with_their_names():
    cases = {
        "min_p": dict(min_p=1.5),
        "presence_penalty": dict(presence_penalty=3.0),
        "frequency_penalty": dict(frequency_penalty=float("nan")),
        "repetition_penalty": dict(repetition_penalty=0.0),
        "logit_bias": dict(logit_bias={5: 101.0}),
        "min_tokens": dict(min_tokens=20, max_tokens=10),
        "top_logprobs": dict(top_logprobs=3),  # without logprobs
    }
    for name, kw in cases.items():
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
    assert SamplingParams(logit_bias={"7": 1, 3: -2}).logit_bias == ((3, -2.0), (7, 1.0))


def test_the_request_file_takes_the_new_fields():
    req = parse_request(
        {
            "prompt": "hi",
            "min_p": 0.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"42": -100, "7": 3},
            "min_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    sp = req.sampling
    assert sp.logit_bias == ((7, 3.0), (42, -100.0))
    assert (sp.min_p, sp.min_tokens, sp.top_logprobs) == (0.1, 4, 2)
    with pytest.raises(ValueError, match="logit_bias"):
        parse_request({"prompt": "hi", "logit_bias": {"x": 1}})
    with pytest.raises(ValueError, match="logit_bias"):
        parse_request({"prompt": "hi", "logit_bias": {"3": "high"}})
