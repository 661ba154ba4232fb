"""The sampler's distributions: the nucleus, temperature towards 0 and towards large values, seeding, NaN rows."""

import math

import pytest
import torch

from int8kv import NonFiniteError
from int8kv.engine import InvalidRequest, SamplingParams, probabilities, sample
from int8kv.engine.sampler import make_generator


def draw(logits, params, n, seed=0):
    gen = make_generator(params, seed)
    rows = logits.expand(n, -1)
    return sample(rows, [params] * n, [gen] * n)


def test_top_p_never_samples_outside_the_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order): top_p 0.7 keeps exactly the first two,
    # since the mass before the third (0.8) already exceeds 0.7.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    logits = probs.log().float()
    params = SamplingParams(temperature=1.0, top_p=0.7)
    tokens = draw(logits, params, 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=4)
    assert counts[0] == counts[2] == 0
    # Inside the nucleus the mass is renormalised: 0.5/0.8 and 0.3/0.8 (4000 draws: sd ~ 0.008).
    assert abs(counts[1] / 4000 - 0.625) < 0.03 and abs(counts[3] / 4000 - 0.375) < 0.03
    p = probabilities(logits, 1.0, 0.7)
    assert p[0] == p[2] == 0 and math.isclose(float(p.sum()), 0.8, rel_tol=1e-6)


def test_top_p_keeps_at_least_the_most_likely_token():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=1e-9), 200)) == {1}


@pytest.mark.parametrize("seed", range(5))
def test_temperature_towards_zero_equals_greedy(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 500, generator=gen) * 2
    greedy = logits.argmax(dim=-1).tolist()
    for t in (1e-3, 1e-8, 1e-300):
        params = [SamplingParams(temperature=t, seed=seed)] * 16
        gens = [make_generator(p, 0) for p in params]
        assert sample(logits, params, gens) == greedy
    assert sample(logits, [SamplingParams()] * 16, [None] * 16) == greedy


def test_high_temperature_spreads_and_low_temperature_concentrates():
    # 20 logits spaced 1.05 apart: at T=1 the distribution is sharp (exact entropy 1.53 nats, top token 65%),
    # at T=100 nearly uniform (entropy within 0.1% of log 20).
    logits = torch.linspace(0, 20, 20)

    def entropies(t):
        counts = torch.bincount(torch.tensor(draw(logits, SamplingParams(temperature=t), 4000)), minlength=20)
        freq = counts.double() / counts.sum()
        exact = probabilities(logits, t, 1.0)
        h = lambda p: float(-(p[p > 0] * p[p > 0].log()).sum())  # noqa: E731
        return h(freq), h(exact), int((counts > 0).sum())

    hot, hot_exact, hot_support = entropies(100.0)
    cold, cold_exact, _ = entropies(1.0)
    assert hot_support == 20 and hot > 0.98 * math.log(20) and abs(hot - hot_exact) < 0.03
    assert cold < 0.6 * math.log(20) and abs(cold - cold_exact) < 0.05


def test_the_sampled_frequencies_follow_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    want = torch.softmax(logits.double() / 2.0, dim=-1)
    counts = torch.bincount(torch.tensor(draw(logits, SamplingParams(temperature=2.0), 8000)), minlength=4)
    assert (counts.double() / 8000 - want).abs().max() < 0.025  # sd of each frequency <= 0.0056


def test_seed_repeats_and_different_seeds_differ():
    logits = torch.zeros(50)
    a = draw(logits, SamplingParams(temperature=1.0, seed=3), 30)
    assert a == draw(logits, SamplingParams(temperature=1.0, seed=3), 30)
    assert a != draw(logits, SamplingParams(temperature=1.0, seed=4), 30)


def test_a_non_finite_row_fails_alone():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    out = sample(logits, params, [make_generator(p, 0) for p in params])
    assert isinstance(out[1], NonFiniteError)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -0.1}, {"temperature": "1"},
        {"top_p": 0}, {"top_p": 1.5}, {"top_p": float("nan")}, {"top_p": True},
        {"max_tokens": 0}, {"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": "3"},
        {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 1.0}, {"seed": True}, {"ignore_eos": 1},
    ],
)
def test_sampling_params_refuse_bad_values_in_the_constructor(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    SamplingParams(temperature=0, top_p=1, max_tokens=1, seed=2**64 - 1)
    SamplingParams(temperature=1e-300, top_p=1e-9, seed=-(2**63))
