"""Scheduler alone, on a real (tiny) paged cache: admission, token budget, chunking, preemption, no leak."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from int8kv import KvPoolExhausted, PagedKvCache
from int8kv.engine import InvalidEngineConfig, SamplingParams, Scheduler, Sequence, Status

BLOCK = 4


def make(num_blocks=64, max_num_seqs=8, budget=64):
    cache = PagedKvCache(num_blocks, BLOCK, num_layers=1, num_kv_heads=1, head_dim=2)
    return cache, Scheduler(cache, max_num_seqs, budget)


def seq(prompt_len, max_tokens=4):
    return Sequence(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched, phases=None):
    """What the engine does around a forward: advance each item, sample (token 7) when due, retire. `phases`,
    if given, gets `in_decode_phase` of the batch (read before the batch advances)."""
    batch = sched.schedule()
    if phases is not None:
        phases.append(sched.in_decode_phase(batch))
    for item in batch:
        if sched.advance(item) and item.seq.append(7, ()):
            sched.finish(item.seq)
    return batch


def test_admission_is_fifo_and_capped_by_max_num_seqs():
    cache, sched = make(max_num_seqs=2)
    a, b, c = seq(3, 2), seq(5, 2), seq(2, 2)
    sched.add([a, b, c])
    batch = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 3), (b, 5)]
    assert list(sched.waiting) == [c] and c.status is Status.WAITING
    batch = step(sched)  # a and b decode their last token and finish; c still waits for a free seat
    assert [i.seq for i in batch] == [a, b] and all(i.is_decode for i in batch)
    assert a.status is b.status is Status.FINISHED
    assert [(i.seq, i.num_tokens) for i in step(sched)] == [(c, 2)]


def test_budget_caps_each_step_and_running_sequences_go_first():
    cache, sched = make(budget=10)
    a, b, c = seq(6), seq(6), seq(6)
    sched.add([a, b, c])
    assert [(i.seq, i.num_tokens) for i in step(sched)] == [(a, 6), (b, 4)]
    # a decodes (1), b finishes its prompt (2), c gets what is left (7 > its 6).
    assert [(i.seq, i.num_tokens) for i in step(sched)] == [(a, 1), (b, 2), (c, 6)]
    while sched.has_work():
        assert sum(i.num_tokens for i in step(sched)) <= 10
    assert cache.num_free_blocks == cache.num_blocks


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    cache, sched = make(budget=16)
    s = seq(50, 3)
    sched.add([s])
    chunks = []
    while sched.has_work():
        batch = step(sched)
        chunks.append(batch[0].num_tokens)
    assert chunks == [16, 16, 16, 2, 1, 1]  # 50 prompt tokens, then 2 decodes (the first token comes from prefill)
    assert s.output == [7, 7, 7] and cache.num_free_blocks == cache.num_blocks


def test_preemption_takes_the_youngest_first_and_requeues_it_at_the_front():
    # 6 blocks of 4: three 4-token prompts fill 3 blocks, their growth fills the rest, then someone must yield.
    cache, sched = make(num_blocks=6, budget=100)
    a, b, c, d = seq(4, 10), seq(4, 10), seq(4, 10), seq(1, 1)
    sched.add([a, b, c])
    preempted = []
    while sched.has_work():
        before = list(sched.running)
        counts = {s: s.num_preemptions for s in (a, b, c)}
        step(sched)
        now = [s for s in (a, b, c) if s.num_preemptions > counts[s]]
        if now:
            assert now == before[len(before) - len(now):]  # a suffix of the running list: the youngest
            preempted.extend(now)
    assert preempted[0] is c and sched.num_preemptions == len(preempted)
    assert all(s.status is Status.FINISHED and s.output == [7] * 10 for s in (a, b, c))
    assert cache.num_free_blocks == cache.num_blocks
    sched.add([d])  # still usable afterwards
    step(sched)
    assert d.status is Status.FINISHED


def test_a_preempted_sequence_waits_at_the_front_with_nothing_cached():
    cache, sched = make(num_blocks=3, budget=100)
    a, b = seq(4, 8), seq(4, 8)
    sched.add([a, b])
    step(sched)  # both prefilled: 2 blocks used, each holds 4 tokens + 1 sampled
    step(sched)  # a grows into the last block; b cannot grow: b (the youngest) is preempted
    assert b.status is Status.WAITING and list(sched.waiting) == [b]
    assert b.num_cached == 0 and b.num_preemptions == 1 and b.seq_id not in cache.allocator


def test_fail_removes_a_running_or_waiting_sequence_and_frees_its_blocks():
    cache, sched = make(max_num_seqs=1)
    a, b = seq(9), seq(3)
    sched.add([a, b])
    step(sched)
    sched.fail(a, ValueError("boom"))
    sched.fail(b, "refused")
    assert a.status is b.status is Status.FAILED and a.finish_reason == "error"
    assert a.error == "ValueError: boom" and b.error == "refused"
    assert not sched.has_work() and cache.num_free_blocks == cache.num_blocks


def test_add_checks_every_request_before_queueing_any():
    cache, sched = make(num_blocks=4)
    with pytest.raises(KvPoolExhausted, match="needs 5 blocks"):
        sched.add([seq(2), seq(16, 4)])
    assert not sched.has_work()


def phases_until_idle(sched):
    """Run to the end as `step` does, recording `in_decode_phase` of each step."""
    phases = []
    while sched.has_work():
        step(sched, phases)
    return phases


def test_decode_phase_means_the_whole_batch_decodes():
    cache, sched = make(budget=8)
    sched.add([seq(4, 5), seq(8, 3)])
    # a4+b4 | a1 (decode) + b4 (prefill) | a, b decode x2 (b's third token ends it) | a alone: not the batch
    assert phases_until_idle(sched) == [False, False, True, True, False]
    sched.add([seq(2, 3)])  # the scheduler was idle: a new batch of one
    assert sched.batch_size == 1
    assert phases_until_idle(sched) == [False, True, True]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_sizes_are_positive_ints(bad):
    cache = PagedKvCache(4, BLOCK, 1, 1, 2)
    with pytest.raises(InvalidEngineConfig):
        Scheduler(cache, bad, 16)
    with pytest.raises(InvalidEngineConfig):
        Scheduler(cache, 4, bad)


@given(
    prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8),
    num_blocks=st.integers(14, 40),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 48),
)
def test_random_workloads_finish_within_limits_and_leak_no_block(prompts, num_blocks, max_num_seqs, budget):
    cache, sched = make(num_blocks, max_num_seqs, budget)
    seqs = [seq(p, m) for p, m in prompts]
    sched.add(seqs)
    for _ in range(10_000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert batch, "a step with work left scheduled nothing"
        assert sum(i.num_tokens for i in batch) <= budget and len(sched.running) <= max_num_seqs
        for item in batch:  # the reservation covers exactly the tokens cached after this step
            assert cache.context_len(item.seq.seq_id) == item.seq.num_cached + item.num_tokens
        for item in batch:
            if sched.advance(item) and item.seq.append(7, ()):
                sched.finish(item.seq)
    assert all(s.status is Status.FINISHED and len(s.output) == s.params.max_tokens for s in seqs)
    assert cache.num_free_blocks == cache.num_blocks and len(cache.allocator) == 0
