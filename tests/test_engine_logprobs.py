"""Per-token log-probabilities (opt-in per request: SamplingParams.logprobs, LLM.prompt_logprobs) and the prompt
tokens each request found in the prefix cache (RequestOutput.num_cached_tokens)."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import int8kv.engine.llm as llm_module
from int8kv.engine import LLM, SamplingParams
from int8kv.engine.sampler import token_logprobs
from int8kv.errors import InvalidRequest, NonFiniteError

VOCAB = 96


def tiny_llm(**kwargs) -> LLM:
    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=None)
    return LLM(LlamaForCausalLM(config).eval(), memory=40 * 2560, block_size=16, **kwargs)


def ragged_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in (3, 17, 29)]


def reference(logits_row: torch.Tensor) -> list[float]:
    """float64 log-softmax by hand: x - log(sum(exp(x - max))) - max."""
    row = [float(x) for x in logits_row.double()]
    top = max(row)
    total = math.log(sum(math.exp(x - top) for x in row)) + top
    return [x - total for x in row]


def test_token_logprobs_equal_a_float64_reference_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=gen) * 6
    tokens = torch.randint(0, 300, (7,), generator=gen).tolist()
    got = token_logprobs(logits, tokens, 4)
    for row, t, entry in zip(logits, tokens, got, strict=True):
        ref = reference(row)
        assert entry.token_id == t and entry.logprob == pytest.approx(ref[t], abs=1e-9)
        order = sorted(range(300), key=lambda i: -ref[i])[:4]
        assert [i for i, _ in entry.top] == order
        assert [lp for _, lp in entry.top] == pytest.approx([ref[i] for i in order], abs=1e-9)
    assert all(e.top == () for e in token_logprobs(logits, tokens, 0))
    masked = logits.clone()
    masked[:, 7] = float("-inf")  # a masked token, which sampling allows: probability 0, the others exact
    got = token_logprobs(masked, [7, *tokens[1:]], 2)
    assert got[0].logprob == float("-inf") and got[1].logprob == pytest.approx(reference(masked[1])[tokens[1]])
    for bad_value in (float("nan"), float("inf")):
        bad = logits.clone()
        bad[2, 5] = bad_value
        with pytest.raises(NonFiniteError):
            token_logprobs(bad, tokens, 1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generated_logprobs_are_the_teacher_forced_distribution_and_change_no_token(temperature):
    llm = tiny_llm()
    prompts = ragged_prompts(1)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=temperature, seed=3))
    asked = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=temperature, seed=3, logprobs=3))
    for p, o, a in zip(prompts, plain, asked, strict=True):
        assert a.token_ids == o.token_ids and o.logprobs is None
        assert len(a.logprobs) == len(a.token_ids)
        # Row i of the teacher-forced logits of prompt + output predicts token i + 1.
        scored = llm.score(p + a.token_ids[:-1])[len(p) - 1 :]
        for row, token, entry in zip(scored, a.token_ids, a.logprobs, strict=True):
            ref = reference(row)
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(ref[token], abs=2e-3)  # step and score batch differently
            assert [i for i, _ in entry.top] == sorted(range(VOCAB), key=lambda i: -ref[i])[:3]
            if temperature == 0:
                assert entry.top[0][0] == token
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_logprobs_cost_nothing_unless_asked(monkeypatch):
    llm = tiny_llm()
    monkeypatch.setattr(llm_module, "token_logprobs", lambda *a: pytest.fail("computed without being asked"))
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert out.logprobs is None and len(out.token_ids) == 4


def test_online_updates_carry_the_new_tokens_logprobs():
    llm = tiny_llm()
    a = llm.add_request([4, 5, 6], SamplingParams(max_tokens=5, logprobs=1))
    b = llm.add_request([7, 8], SamplingParams(max_tokens=5))
    seen = {a: [], b: []}
    while llm.has_unfinished():
        llm.step()
        for u in llm.pop_updates():
            if u.request_id == a:
                assert [e.token_id for e in u.new_logprobs] == u.new_token_ids
            else:
                assert u.new_logprobs is None
            seen[u.request_id] += u.new_token_ids
    assert len(seen[a]) == len(seen[b]) == 5


@pytest.mark.parametrize("chunk_size", [5, 256])
def test_prompt_logprobs_equal_a_float64_reference_across_chunks(chunk_size):
    llm = tiny_llm()
    for ids in ragged_prompts(2):
        got = llm.prompt_logprobs(ids, 2, chunk_size=chunk_size)
        assert len(got) == len(ids) and got[0] is None
        scored = llm.score(ids)
        for i in range(1, len(ids)):
            ref = reference(scored[i - 1])
            assert got[i].token_id == ids[i] and got[i].logprob == pytest.approx(ref[ids[i]], abs=1e-6)
            assert [t for t, _ in got[i].top] == sorted(range(VOCAB), key=lambda t: -ref[t])[:2]
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


@pytest.mark.parametrize("bad", [21, -1, True, 2.0, "3"])
def test_bad_logprobs_counts_are_refused_and_change_nothing(bad):
    llm = tiny_llm()
    with pytest.raises(InvalidRequest, match="logprobs must be None or an int in"):
        SamplingParams(logprobs=bad)
    with pytest.raises(InvalidRequest, match="logprobs must be None or an int in"):
        llm.prompt_logprobs([1, 2, 3], bad)
    assert llm.cache.num_free_blocks == llm.cache.num_blocks and not llm.has_unfinished()


def test_cached_prompt_tokens_are_reported_per_request_and_for_every_fork():
    llm = tiny_llm()
    prompt = ragged_prompts(3)[2] + [9] * 11  # 40 tokens: two full blocks of 16
    (first,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    (second,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    ids = llm.add_forked_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=1), n=3)
    cached = {}
    while llm.has_unfinished():
        llm.step()
        cached |= {u.request_id: u.num_cached_tokens for u in llm.pop_updates()}
    assert cached == dict.fromkeys(ids, 32)
