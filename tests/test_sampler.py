"""The sampler's distributions: the nucleus, temperature towards 0 and towards large values, seeding, NaN rows."""

import math

import pytest
import torch

from int8kv import NonFiniteError
from int8kv.engine import InvalidRequest, SamplingParams, probabilities, sample
from int8kv.engine.sampler import adjust, make_generator


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
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, 2] = -float("inf")  # probability 0: still a usable row
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=1.0, seed=2)]
    out = sample(logits, params, [make_generator(p, 0) for p in params])
    assert isinstance(out[1], NonFiniteError) and isinstance(out[3], NonFiniteError)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert isinstance(out[4], int) and out[4] != 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -0.1}, {"temperature": "1"},
        {"top_p": 0}, {"top_p": 1.5}, {"top_p": float("nan")}, {"top_p": True},
        {"max_tokens": 0}, {"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": "3"},
        {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 1.0}, {"seed": True}, {"ignore_eos": 1},
        {"top_k": -2}, {"top_k": 2.0}, {"top_k": True}, {"min_p": -0.1}, {"min_p": 1.01}, {"min_p": float("nan")},
        {"repetition_penalty": 0}, {"repetition_penalty": 2.01}, {"frequency_penalty": -2.01},
        {"presence_penalty": 2.5}, {"presence_penalty": float("inf")}, {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1.0: 1.0}}, {"logit_bias": {1: 100.5}}, {"logit_bias": {1: float("nan")}},
        {"logit_bias": "1:2"}, {"logit_bias": [(1, 2, 3)]}, {"logit_bias": {i: 1.0 for i in range(301)}},
    ],
)
def test_sampling_params_refuse_bad_values_in_the_constructor(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    SamplingParams(temperature=0, top_p=1, max_tokens=1, seed=2**64 - 1)
    SamplingParams(temperature=1e-300, top_p=1e-9, seed=-(2**63))
    SamplingParams(top_k=-1, min_p=1, repetition_penalty=2, frequency_penalty=-2, presence_penalty=2,
                   logit_bias={i: -100.0 for i in range(300)})
    assert SamplingParams(logit_bias={5: 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))
    assert not SamplingParams(logit_bias={}).adjusts_logits and SamplingParams(logit_bias={}).logit_bias is None


def adjust_oracle(logits, params, histories):
    """float64, one row and one token at a time: logit_bias added, then the repetition penalty over the prompt
    and the output, then the frequency and presence penalties over the output."""
    out = logits.double().clone()
    for b, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        for t, v in p.logit_bias or ():
            out[b, t] += v
        for t in set(prompt) | set(output):
            x = out[b, t]
            out[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output):
            out[b, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


@pytest.mark.parametrize("seed", range(4))
def test_penalties_and_bias_equal_a_float64_oracle_on_ragged_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    rows, vocab = 7, 300
    logits = torch.randn(rows, vocab, generator=gen) * 4
    params, histories = [], []
    for _ in range(rows):
        pick = int(torch.randint(0, 4, (), generator=gen))  # some rows adjust nothing
        ids = torch.randint(0, vocab, (int(torch.randint(0, 5, (), generator=gen)),), generator=gen).tolist()
        params.append(SamplingParams(
            repetition_penalty=float(0.2 + 1.8 * rnd(())) if pick & 1 else 1.0,
            frequency_penalty=float(4 * rnd(()) - 2) if pick & 2 else 0.0,
            presence_penalty=float(4 * rnd(()) - 2) if pick & 2 else 0.0,
            logit_bias={t: float(200 * rnd(()) - 100) for t in ids} if pick else None))
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 40, (), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, 30, (int(torch.randint(0, 60, (), generator=gen)),), generator=gen).tolist()
        histories.append((prompt, output))
    got = adjust(logits, params, histories)
    want = adjust_oracle(logits, params, histories)
    assert got.dtype == logits.dtype
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-4)
    untouched = [b for b, p in enumerate(params) if not p.adjusts_logits]
    assert torch.equal(got[untouched], logits[untouched])
    greedy = sample(logits, params, [None] * rows, histories)
    assert greedy == want.argmax(dim=-1).tolist()


def test_sample_without_histories_refuses_rows_that_need_them():
    with pytest.raises(ValueError, match="history"):
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [None])


@pytest.mark.parametrize("seed", range(3))
def test_min_p_and_top_k_cuts_equal_a_float64_oracle(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(97, generator=gen) * 3
    for top_k, min_p, top_p, t in ((5, 0.0, 1.0, 1.0), (0, 0.1, 1.0, 0.7), (10, 0.02, 0.8, 1.3), (1, 0.5, 0.5, 2.0)):
        p = torch.softmax(logits.double() / t, dim=-1)
        keep = p >= min_p * p.max()
        if top_k:
            keep &= p >= p.sort(descending=True).values[top_k - 1]
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        if top_p < 1:
            order = q.argsort(descending=True)
            before = q[order].cumsum(0) - q[order]
            nucleus = torch.zeros_like(keep)
            nucleus[order[before < top_p]] = True
            q = torch.where(nucleus, q, 0.0)
        got = probabilities(logits, t, top_p, top_k, min_p)
        assert torch.allclose(got / got.sum(), q / q.sum(), atol=1e-12)
        drawn = set(draw(logits, SamplingParams(temperature=t, top_p=top_p, top_k=top_k, min_p=min_p), 300))
        assert drawn <= set(torch.nonzero(q).flatten().tolist())


def test_seeded_draws_with_penalties_repeat():
    logits = torch.zeros(3, 40)
    params = [SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.5, presence_penalty=1.0, top_k=8)] * 3
    hist = [([1, 2, 3], [4, 4, 5])] * 3
    a = sample(logits, params, [make_generator(p, 0) for p in params], hist)
    assert a == sample(logits, params, [make_generator(p, 0) for p in params], hist)
