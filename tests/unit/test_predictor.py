"""The router's online predictions (router/admission/predictor.py): output length per tenant and
prompt length, falling back to wider keys, capped at max_tokens, its error reported; and
the linear fit used for times."""

import random

import pytest

from router.admission.predictor import MAX_KEYS, MIN_SAMPLES, LengthPredictor, LinearFit


def test_a_tenants_lengths_are_learned_and_capped_at_max_tokens():
    p = LengthPredictor(prior_tokens=64)
    assert p.predict("a", 100, 16) == 16  # the prior, capped
    for _ in range(MIN_SAMPLES + 20):
        p.observe("a", 100, 512, p.predict("a", 100, 512), 300)
        p.observe("b", 100, 512, p.predict("b", 100, 512), 20)
    assert p.predict("a", 100, 512) == pytest.approx(300, rel=0.05)
    assert p.predict("b", 100, 512) == pytest.approx(20, rel=0.05)
    assert p.predict("a", 100, 50) == 50  # never past what the request allows
    # A prompt length a has not sent: its tenant's figure, not the prior.
    assert p.predict("a", 5000, 512) == pytest.approx(300, rel=0.05)
    # A new tenant: everyone's.
    assert 20 < p.predict("new", 100, 512) < 300


def test_the_error_falls_as_it_learns_and_is_reported():
    rng = random.Random(0)
    p = LengthPredictor()
    assert p.mean_abs_error is None
    errors = []
    for i in range(400):
        tenant = "chat" if i % 2 else "essay"
        true = rng.randint(10, 30) if tenant == "chat" else rng.randint(300, 400)
        guess = p.predict(tenant, 50, 1024)
        errors.append(abs(guess - true))
        p.observe(tenant, 50, 1024, guess, true)
    early, late = sum(errors[:20]) / 20, sum(errors[-100:]) / 100
    assert late < early / 4 and late < 40
    assert p.mean_abs_error == pytest.approx(late, rel=0.5)


def test_linear_fit_follows_a_line_and_keeps_sense_with_little_data():
    f = LinearFit(prior=0.5)
    assert f(100) == 0.5
    f.add(100, 1.0)
    assert f(1000) == 1.0  # one x: the mean
    for x in range(0, 2000, 50):
        f.add(x, 0.1 + 0.001 * x)
    assert f(1000) == pytest.approx(1.1, rel=0.05)
    g = LinearFit(prior=0.5)
    g.add(10, 2.0)
    g.add(1000, 1.0)  # longer and faster: noise, not a negative cost
    assert g(5000) == pytest.approx(1.5, rel=0.02)  # the (recency-weighted) mean


def test_what_it_keeps_is_bounded_and_the_busy_tenants_stay():
    p = LengthPredictor()
    for _ in range(MIN_SAMPLES):
        p.observe("busy", 100, 512, 64, 300)
    for i in range(MAX_KEYS):  # a router without keys: any tenant name comes, once each
        p.observe(f"t{i}", 100, 512, 64, 10)
        if i % 1000 == 0:
            p.observe("busy", 100, 512, 64, 300)
    assert len(p._means) <= MAX_KEYS
    assert p.predict("busy", 100, 512) == pytest.approx(300, rel=0.05)
