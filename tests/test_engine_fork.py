"""Forked requests (`LLM.add_forked_request`): n choices of one prompt, prefilled once, the other n - 1 forked off
its blocks copy-on-write. Every forked choice is checked against the same choice run as an independent request
(same prompt, params and seed) on an engine with room to spare."""

import random
from dataclasses import replace

import pytest
import torch
from test_engine import LLM_block_bytes, tiny
from test_engine_errors import POISON, poisoned

from int8kv import KvPoolExhausted, KvStorageFormat
from int8kv.engine import LLM, InvalidRequest, SamplingParams

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
VOCAB = 96  # tests/test_engine.py SMALL
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    # tests/test_engine's tiny Llama with its output layer at x6 instead of x30: sharp enough that a token's K/V
    # steers what follows (with the x1 random model, reading another choice's block went unnoticed: sampling
    # hardly depended on the context), flat enough that temperature-1 choices diverge from their first token.
    m = tiny("llama", seed=2)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.2)
    return m


def engine(model, blocks=64, fmt=INT8, **kw) -> LLM:
    return LLM(model, kv_format=fmt, memory=blocks * LLM_block_bytes(model, BLOCK, fmt), block_size=BLOCK, **kw)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def independent(model, prompts, params, fmt=INT8, **kw) -> list[list[int]]:
    """Each (prompt, params) as its own request, all in one `generate` on a pool that never preempts."""
    return [o.token_ids for o in engine(model, blocks=1024, fmt=fmt, **kw).generate(prompts, params)]


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [replace(params, seed=params.seed + j) for j in range(n)]


class Streams:
    """Every request's streamed tokens and finish reason, from pop_updates after each step."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokens: dict[int, list[int]] = {}
        self.reasons: dict[int, str] = {}

    def collect(self) -> None:
        for u in self.llm.pop_updates():
            got = self.tokens.setdefault(u.request_id, [])
            got.extend(u.new_token_ids)
            assert u.num_output_tokens == len(got)
            if u.finished:
                assert u.request_id not in self.reasons, "a finished request is reported once"
                self.reasons[u.request_id] = u.finish_reason

    def step(self) -> None:
        self.llm.step()
        check_tables(self.llm)
        self.collect()

    def run(self, ids: list[int]) -> list[list[int]]:
        while self.llm.has_unfinished():
            self.step()
        self.collect()
        return [self.tokens.get(i, []) for i in ids]


def check_tables(llm: LLM) -> None:
    """The runner's block-table copy of every running sequence equals the allocator's table (the entry a
    copy-on-write replaced included)."""
    for seq in llm.scheduler.running:
        n = seq.num_table_blocks
        if n:
            assert seq.block_table[:n].tolist() == llm.cache.block_table(seq.seq_id)[:n], seq.seq_id


def assert_idle(llm: LLM) -> None:
    """No request left and no block referenced: free + cached (the prefix cache's evictable) == the pool."""
    alloc = llm.cache.allocator
    assert not llm.scheduler.has_work() and len(alloc) == 0
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert all(alloc.refcount(b) == 0 for b in range(alloc.num_blocks))


# 3 tokens: one partial block; 8: two full blocks (no copy-on-write, each choice starts a block); 13: three full
# blocks and a partial one shared by all choices until each writes into it.
@pytest.mark.parametrize("length", [3, 8, 13])
@pytest.mark.parametrize("fmt", [INT8, F16], ids=["int8", "f16"])
def test_greedy_forks_are_n_copies_of_the_unforked_request(model, length, fmt):
    prompt = tokens(length, seed=length)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    (want,) = independent(model, [prompt], [params], fmt)
    llm = engine(model, fmt=fmt)
    ids = llm.add_forked_request(prompt, params, n=4)
    assert Streams(llm).run(ids) == [want] * 4
    assert llm.stats.prefill_tokens == length and llm.stats.generated_tokens == 40
    assert_idle(llm)


@pytest.mark.parametrize("length", [3, 8, 13, 30])
@pytest.mark.parametrize("budget", [512, 8], ids=["one-chunk", "chunked"])
def test_seeded_choice_j_equals_an_independent_request_with_seed_plus_j(model, length, budget):
    """The choices diverge from their first token, so a choice that read a sibling's copy of the shared partial
    block (a stale entry in the runner's block table after copy-on-write) would generate other tokens."""
    prompt = tokens(length, seed=100 + length)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=40 + length, ignore_eos=True)
    want = independent(model, [prompt] * 4, choices(params, 4), max_num_batched_tokens=budget)
    assert len({w[0] for w in want}) > 1 and len({tuple(w) for w in want}) == 4
    llm = engine(model, max_num_batched_tokens=budget)
    ids = llm.add_forked_request(prompt, params, n=4)
    assert Streams(llm).run(ids) == want
    assert llm.stats.prefill_tokens == length
    assert_idle(llm)


def test_one_params_per_choice(model):
    prompt = tokens(11, seed=5)
    params = [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=12, temperature=1.0, seed=3),
              SamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, seed=9, ignore_eos=True)]
    want = independent(model, [prompt] * 3, params)
    llm = engine(model)
    ids = llm.add_forked_request(prompt, params)
    assert Streams(llm).run(ids) == want
    assert_idle(llm)


def test_the_prompt_is_prefilled_once(model):
    prompt = tokens(29, seed=2)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    counted = {}
    for n in (1, 4):
        llm = engine(model, prefix_caching=False)
        Streams(llm).run(llm.add_forked_request(prompt, params, n=n))
        s = llm.stats
        counted[n] = (s.prefill_tokens, s.decode_tokens, s.generated_tokens)
    assert counted == {1: (29, 4, 5), 4: (29, 16, 20)}
    llm = engine(model, prefix_caching=False)  # the same four choices as independent requests
    Streams(llm).run([llm.add_request(prompt, p) for p in choices(params, 4)])
    assert llm.stats.prefill_tokens == 4 * 29


def test_forks_share_the_prompt_blocks_and_an_abort_frees_only_private_ones(model):
    prompt = tokens(13, seed=7)  # blocks: 3 full + 1 partial (1 token)
    n, params = 4, SamplingParams(max_tokens=14, temperature=1.0, seed=3, ignore_eos=True)
    want = independent(model, [prompt] * n, choices(params, n))
    llm = engine(model, blocks=64)
    alloc = llm.cache.allocator
    streams = Streams(llm)
    ids = llm.add_forked_request(prompt, params, n=n)
    assert llm.num_waiting == n and llm.num_running == 0
    streams.step()  # the prefill, then the fork: every choice holds every prompt block, nothing is copied yet
    tables = [alloc.block_table(i) for i in ids]
    assert tables == [tables[0]] * n and len(tables[0]) == 4
    assert [alloc.refcount(b) for b in tables[0]] == [n] * 4
    assert llm.cache.num_free_blocks == 64 - 4 and llm.num_running == n
    partial = tables[0][3]
    assert [len(streams.tokens[i]) for i in ids] == [1] * n
    streams.step()  # the first decode: n - 1 copies of the partial block; the last choice writes in place
    tables = [alloc.block_table(i) for i in ids]
    full = tables[0][:3]
    assert all(t[:3] == full for t in tables) and [alloc.refcount(b) for b in full] == [n] * 3
    lasts = [t[3] for t in tables]
    assert len(set(lasts)) == n and [alloc.refcount(b) for b in lasts] == [1] * n
    assert lasts[-1] == partial  # running order: the youngest fork grows last and keeps the original
    assert llm.cache.num_free_blocks == 64 - 3 - n
    for _ in range(4):  # past the next block boundary: each choice now holds two private blocks
        streams.step()
    victim = ids[1]
    private = [b for b in alloc.block_table(victim) if alloc.refcount(b) == 1]
    assert len(private) == 2
    free = llm.cache.num_free_blocks
    assert llm.abort_request(victim)
    assert llm.cache.num_free_blocks == free + len(private)
    assert [alloc.refcount(b) for b in full] == [n - 1] * 3
    outs = streams.run(ids)
    assert [outs[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert outs[1] == want[1][: len(outs[1])] and 0 < len(outs[1]) < len(want[1]) and victim not in streams.reasons
    assert_idle(llm)
    assert alloc.num_cached_blocks > 0  # the prompt's full blocks stay evictable in the prefix cache


def test_aborts_before_the_prefill_ends(model):
    prompt = tokens(30, seed=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    want = independent(model, [prompt] * 4, choices(params, 4), max_num_batched_tokens=8)
    llm = engine(model, max_num_batched_tokens=8)  # the prompt is prefilled in four steps
    streams = Streams(llm)
    ids = llm.add_forked_request(prompt, params, n=4)
    assert llm.abort_request(ids[2])  # a fork not started yet: it just leaves the group
    assert llm.num_waiting == 3
    streams.step()  # the first chunk: 8 tokens in 2 blocks
    assert llm.num_running == 3 and llm.cache.num_free_blocks == 64 - 2
    assert llm.abort_request(ids[0])  # the sequence prefilling for the group hands over its place and blocks
    assert llm.num_running == 2 and llm.cache.num_free_blocks == 64 - 2
    outs = streams.run(ids)
    assert [outs[1], outs[3]] == [want[1], want[3]] and outs[0] == outs[2] == []
    assert llm.stats.prefill_tokens == 30  # the chunk computed before the hand-over is not computed again
    assert_idle(llm)
    # Every choice of a group aborted before its prefill ends: nothing is left.
    ids = llm.add_forked_request(prompt, params, n=3)
    streams.step()
    assert all(llm.abort_request(i) for i in ids)
    assert not any(llm.abort_request(i) for i in ids)
    assert llm.pop_updates() == []
    assert_idle(llm)


def test_a_group_that_cannot_run_whole_is_refused_and_nothing_is_queued(model):
    llm = engine(model, blocks=20, max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="n=5 choices of one prompt"):
        llm.add_forked_request(tokens(5), SamplingParams(max_tokens=4), n=5)
    # 13 prompt tokens: 3 full blocks held once; each choice's own: ceil(33 / 4) - 3 = 6. 3 + 3 x 6 = 21 > 20.
    with pytest.raises(KvPoolExhausted, match="3 choices of 13 prompt .* needs 21 blocks; the whole pool has 20"):
        llm.add_forked_request(tokens(13), SamplingParams(max_tokens=20), n=3)
    bad = [dict(n=0), dict(n=True), dict(params=[]), dict(params=[SamplingParams(), "greedy"]),
           dict(params=[SamplingParams()], n=2), dict(params=SamplingParams(temperature=1.0, seed=2**64 - 2), n=3)]
    for kwargs in bad:
        with pytest.raises(InvalidRequest):
            llm.add_forked_request(tokens(5), **kwargs)
    with pytest.raises(InvalidRequest):
        llm.add_forked_request([1, VOCAB], SamplingParams(), n=2)
    assert_idle(llm)
    assert llm.pop_updates() == []
    # 3 + 2 x 6 = 15 blocks fit: the same prompt with n=2 runs.
    ids = llm.add_forked_request(tokens(13), SamplingParams(max_tokens=20, ignore_eos=True), n=2)
    outs = Streams(llm).run(ids)
    assert outs[0] == outs[1] and len(outs[0]) == 20
    assert_idle(llm)


def test_a_prefill_that_fails_fails_every_choice_of_its_group():
    model = poisoned()
    llm = engine(model)
    good = SamplingParams(max_tokens=5, ignore_eos=True)
    streams = Streams(llm)
    bad_ids = llm.add_forked_request([9, 8, POISON, 7], good, n=3)
    ok_ids = llm.add_forked_request([1, 2, 3, 4, 6], good, n=2)
    outs = streams.run(bad_ids + ok_ids)
    assert [streams.reasons[i] for i in bad_ids] == ["error"] * 3 and outs[:3] == [[], [], []]
    assert outs[3] == outs[4] == independent(model, [[1, 2, 3, 4, 6]], [good])[0] and len(outs[3]) == 5
    assert llm.stats.failed_requests == 3
    assert_idle(llm)


def test_preempted_forks_recompute_their_prompt_and_own_tokens(model):
    """Three groups of three in a pool that holds about two: forks are preempted (freeing only their own
    references), recomputed from prompt + their own tokens, and still equal their independent runs."""
    prompts = [tokens(n, seed=n) for n in (14, 9, 21)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=10 * i, ignore_eos=True) for i in range(3)]
    want = independent(model, [p for p in prompts for _ in range(3)], [c for p in params for c in choices(p, 3)])
    for caching in (True, False):
        llm = engine(model, blocks=24, prefix_caching=caching, max_num_batched_tokens=16)
        ids = [i for p, sp in zip(prompts, params, strict=True) for i in llm.add_forked_request(p, sp, n=3)]
        assert Streams(llm).run(ids) == want
        assert llm.stats.preemptions > 0
        assert_idle(llm)


@pytest.mark.parametrize("seed", range(30))
def test_random_forked_groups_aborts_and_preemption_match_unforked_runs(model, seed):
    """Groups arrive between steps into a 12-block pool, some choices are aborted (waiting, prefilling or
    decoding): a group is refused exactly when it needs more than the pool, every choice not aborted equals
    its independent run, an aborted one streamed a prefix of it, and no block stays referenced. Sizes are drawn
    uniformly from a seeded generator: hypothesis' draws favour small sizes, which rarely filled the pool (no
    preemption in 25 runs); here 15 of the 30 seeds preempt, forks holding shared blocks and sequences still
    prefilling for their group among them."""
    rng = random.Random(seed)
    specs = []
    for g in range(rng.randint(3, 6)):
        base = SamplingParams(max_tokens=rng.randint(4, 16), temperature=rng.choice([0.0, 1.0]),
                              seed=rng.randint(0, 1000), ignore_eos=rng.random() < 0.7)
        specs.append((tokens(rng.randint(1, 20), seed=100 * seed + g), choices(base, rng.randint(1, 3)),
                      rng.randint(0, 6)))  # (prompt, one params per choice, the step the group arrives before)
    aborts = [(rng.randint(0, 15), rng.randrange(len(specs)), rng.randrange(3)) for _ in range(rng.randint(0, 4))]
    budget, caching, blocks = rng.choice([4, 8, 32]), rng.random() < 0.5, 16
    want = independent(model, [p for p, ps, _ in specs for _ in ps], [c for _, ps, _ in specs for c in ps])
    llm = engine(model, blocks=blocks, max_num_seqs=6, max_num_batched_tokens=budget, prefix_caching=caching)
    streams = Streams(llm)
    ids: dict[int, list[int]] = {}
    aborted: set[int] = set()
    step = 0
    while llm.has_unfinished() or len(ids) < len(specs):
        for g, (prompt, ps, arrival) in enumerate(specs):
            if arrival != step:
                continue
            shared = len(prompt) // BLOCK  # held once; each choice holds the rest of its prompt + max_tokens
            need = shared + sum(-(-(len(prompt) + p.max_tokens) // BLOCK) - shared for p in ps)
            try:
                ids[g] = llm.add_forked_request(prompt, ps)
                assert need <= blocks
            except KvPoolExhausted:
                assert need > blocks
                ids[g] = []
        for when, g, j in aborts:
            if when == step and ids.get(g) and llm.abort_request(ids[g][j % len(ids[g])]):
                aborted.add(ids[g][j % len(ids[g])])
        if llm.has_unfinished():
            streams.step()
        step += 1
        assert step < 1000, "the engine stopped making progress"
    streams.collect()
    flat = [(g, j) for g, (_, ps, _) in enumerate(specs) for j in range(len(ps))]
    for (g, j), expected in zip(flat, want, strict=True):
        if not ids[g]:
            continue  # refused
        got = streams.tokens.get(ids[g][j], [])
        if ids[g][j] in aborted:
            assert got == expected[: len(got)] and ids[g][j] not in streams.reasons
        else:
            assert got == expected and streams.reasons[ids[g][j]] in ("length", "stop")
    assert_idle(llm)
