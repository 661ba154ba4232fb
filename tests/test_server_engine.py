"""The engine's online API (what the server drives): add_request at any time, step, pop_updates, abort_request."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from int8kv.engine import LLM, SamplingParams
from int8kv.errors import InvalidRequest, KvPoolExhausted


def tiny_llm(**kwargs) -> LLM:
    torch.manual_seed(11)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, eos_token_id=None)
    return LLM(LlamaForCausalLM(config).eval(), memory=kwargs.pop("memory", 40 * 2560), block_size=16, **kwargs)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def drain(llm: LLM, streams: dict[int, list[int]], reasons: dict[int, str]) -> None:
    for u in llm.pop_updates():
        assert u.num_output_tokens == len(streams[u.request_id]) + len(u.new_token_ids)
        streams[u.request_id].extend(u.new_token_ids)
        if u.finished:
            assert u.request_id not in reasons, "a finished request is reported once"
            reasons[u.request_id] = u.finish_reason


def test_requests_joining_between_steps_stream_the_tokens_generate_gives():
    ps = prompts(6)
    params = [SamplingParams(max_tokens=5 + 3 * i) for i in range(6)]
    expected = tiny_llm().generate(ps, params)
    llm = tiny_llm(max_num_seqs=3)
    streams: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    ids = []
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):  # one joins every two steps
        ids.append(llm.add_request(p, sp))
        streams[ids[-1]] = []
        for _ in range(2 if i < 5 else 0):
            llm.step()
            drain(llm, streams, reasons)
    while llm.has_unfinished():
        llm.step()
        drain(llm, streams, reasons)
    drain(llm, streams, reasons)
    assert [streams[i] for i in ids] == [o.token_ids for o in expected]
    assert [reasons[i] for i in ids] == [o.finish_reason for o in expected]
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert llm.pop_updates() == []


def test_abort_frees_blocks_at_once_and_the_others_go_on():
    ps = prompts(3, seed=1)
    params = SamplingParams(max_tokens=40)
    expected = tiny_llm().generate([ps[0], ps[2]], params)
    llm = tiny_llm()
    ids = [llm.add_request(p, params) for p in ps]
    for _ in range(4):
        llm.step()
    used_before = llm.cache.num_blocks - llm.cache.num_free_blocks
    victim_blocks = len(llm.cache.block_table(ids[1]))
    assert victim_blocks >= 1
    assert llm.abort_request(ids[1]) is True
    assert llm.cache.num_blocks - llm.cache.num_free_blocks == used_before - victim_blocks
    assert llm.abort_request(ids[1]) is False  # already gone
    assert llm.num_running == 2
    streams = {i: [] for i in ids}
    while llm.has_unfinished():
        llm.step()
    streams_seen = llm.pop_updates()
    for u in streams_seen:
        streams[u.request_id].extend(u.new_token_ids)
    assert {u.request_id for u in streams_seen} == {ids[0], ids[2]}
    assert [streams[ids[0]], streams[ids[2]]] == [o.token_ids for o in expected]
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_abort_of_a_waiting_request_and_unknown_ids():
    llm = tiny_llm(max_num_seqs=1)
    a = llm.add_request(prompts(1)[0], SamplingParams(max_tokens=3))
    b = llm.add_request(prompts(1, seed=2)[0], SamplingParams(max_tokens=3))
    llm.step()
    assert (llm.num_running, llm.num_waiting) == (1, 1)
    assert llm.abort_request(b) and llm.num_waiting == 0
    assert llm.abort_request(10**9) is False
    while llm.has_unfinished():
        llm.step()
    (update,) = llm.pop_updates()
    assert update.request_id == a and update.finished and len(update.new_token_ids) == 3


@pytest.mark.parametrize(
    ("prompt", "params", "error"),
    [
        ([], None, InvalidRequest),
        ([1, 500], None, InvalidRequest),
        ([1, -1], None, InvalidRequest),
        ([1] * 250, SamplingParams(max_tokens=10), InvalidRequest),  # past max_position_embeddings
        ([1] * 10, SamplingParams(max_tokens=200), KvPoolExhausted),  # more than the whole pool
        ("text", None, InvalidRequest),  # no tokenizer
    ],
)
def test_add_request_refuses_up_front_and_changes_nothing(prompt, params, error):
    llm = tiny_llm(memory=8 * 2560)
    ok = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    llm.step()
    free = llm.cache.num_free_blocks
    with pytest.raises(error):
        llm.add_request(prompt, params)
    assert (llm.num_running, llm.num_waiting, llm.cache.num_free_blocks) == (1, 0, free)
    while llm.has_unfinished():
        llm.step()
    assert [u.request_id for u in llm.pop_updates()] == [ok]
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_generate_runs_beside_online_requests_and_leaves_them_to_pop_updates():
    ps = prompts(3, seed=4)
    expected = tiny_llm().generate(ps, SamplingParams(max_tokens=6))
    llm = tiny_llm()
    online = llm.add_request(ps[0], SamplingParams(max_tokens=6))
    outs = llm.generate(ps[1:], SamplingParams(max_tokens=6))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected[1:]]
    while llm.has_unfinished():
        llm.step()
    updates = llm.pop_updates()
    assert [u.request_id for u in updates] == [online]
    assert sum((u.new_token_ids for u in updates), []) == expected[0].token_ids
