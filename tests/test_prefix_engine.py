"""Automatic prefix caching in the engine: same greedy outputs, fewer prefill tokens, no leaked block."""

import pytest
import torch
from test_engine import F16, INT8, SMALL, tiny

from int8kv.blockstore import InvalidBlockKey
from int8kv.cache.prefix import PrefixHasher
from int8kv.cache.state import KvLayout
from int8kv.engine import LLM, SamplingParams
from int8kv.engine.runner import ModelRunner
from int8kv.engine.scheduler import Scheduler
from int8kv.engine.sequence import Sequence
from int8kv.errors import InvalidEngineConfig

BS = 16


def prompts_with_shared_prefix(n: int, shared: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, SMALL["vocab_size"], (shared,), generator=g).tolist()
    return [prefix + torch.randint(1, SMALL["vocab_size"], (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def memory_for_blocks(fmt, blocks: int) -> int:
    layout = KvLayout(SMALL["num_hidden_layers"], SMALL["num_key_value_heads"], SMALL["head_dim"], fmt)
    return layout.bytes_per_block(BS) * blocks


def assert_no_leak(llm: LLM) -> None:
    alloc = llm.cache.allocator
    assert len(alloc) == 0
    assert len(alloc.free_blocks()) + alloc.num_cached_blocks == alloc.num_blocks
    assert all(alloc.refcount(b) == 0 for b in range(alloc.num_blocks))


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.mark.parametrize("fmt", [INT8, F16])
@pytest.mark.parametrize(("blocks", "budget"), [(200, 512), (13, 512), (14, 24)])
def test_greedy_outputs_equal_with_and_without_prefix_caching(model, fmt, blocks, budget):
    """Shared-prefix workload; 13-14 blocks force preemptions, a 24-token budget chunks every prefill."""
    prompts = prompts_with_shared_prefix(6, shared=70)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(kv_format=fmt, memory=memory_for_blocks(fmt, blocks), max_num_seqs=4, max_num_batched_tokens=budget)
    plain = LLM(model, prefix_caching=False, **kw)
    cached = LLM(model, **kw)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in cached.generate(prompts, params)]
    assert got == want
    s = cached.stats
    assert s.prefix_hit_tokens > 0 and s.prefill_tokens < plain.stats.prefill_tokens
    assert_no_leak(cached)
    assert_no_leak(plain)
    if blocks < 20:
        assert plain.stats.preemptions > 0 and s.preemptions > 0
        return
    # Without preemption every prompt token is computed once or hit once.
    assert s.prefill_tokens + s.prefix_hit_tokens == plain.stats.prefill_tokens == sum(map(len, prompts))
    # Served again from the pool: the same output, only the last block of the prompt recomputed.
    before = s.prefill_tokens
    assert [o.token_ids for o in cached.generate(prompts[:1], params)] == want[:1]
    assert s.prefill_tokens - before == len(prompts[0]) - (len(prompts[0]) - 1) // BS * BS
    assert_no_leak(cached)


def test_prefill_tokens_drop_by_the_shared_prefix(model):
    shared = 5 * BS + 3  # five full blocks shared, then the prompts differ inside the sixth
    a, b = prompts_with_shared_prefix(2, shared=shared, seed=1)
    llm = LLM(model, memory="1MiB")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate([a], params)[0].token_ids
    assert llm.stats.prefill_tokens == len(a) and llm.stats.prefix_hit_tokens == 0
    llm.stats = type(llm.stats)()
    second = llm.generate([b], params)[0].token_ids
    assert llm.stats.prefix_hit_tokens == 5 * BS
    assert llm.stats.prefill_tokens == len(b) - 5 * BS
    assert llm.stats.prefix_queried_tokens == (len(b) // BS) * BS
    assert llm.stats.prefix_hit_rate == pytest.approx(5 * BS / ((len(b) // BS) * BS))
    fresh = LLM(model, memory="1MiB", prefix_caching=False)
    assert fresh.generate([a, b], params)[0].token_ids == first
    assert fresh.generate([b], params)[0].token_ids == second
    # An identical prompt hits everything but its last block (a token is always left to compute).
    llm.stats = type(llm.stats)()
    llm.generate([b], params)
    assert llm.stats.prefill_tokens == len(b) - ((len(b) - 1) // BS) * BS
    assert_no_leak(llm)


def test_keys_are_rooted_in_the_model_fingerprint():
    same_a, same_b, other = tiny("llama", seed=0), tiny("llama", seed=0), tiny("llama", seed=1)
    a, b, c = (LLM(m, memory="1MiB") for m in (same_a, same_b, other))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    ids = list(range(1, 40))
    keys = [llm.scheduler.hasher.block_keys(ids) for llm in (a, b, c)]
    assert keys[0] == keys[1] and keys[0][0] != keys[2][0]
    f16 = LLM(same_a, memory="1MiB", kv_format=F16)
    assert f16.fingerprint == a.fingerprint and f16.scheduler.hasher.block_keys(ids)[0] != keys[0][0]
    named = LLM(same_a, memory="1MiB", model_id="my-model-v1")
    assert named.fingerprint not in (a.fingerprint, c.fingerprint)
    want = PrefixHasher(a.cache.layout, a.fingerprint, BS).block_keys(ids)
    assert keys[0] == want


def test_prefix_caching_off_and_bad_settings(model):
    llm = LLM(model, memory="1MiB", prefix_caching=False)
    assert llm.scheduler.hasher is None and llm.fingerprint is None
    llm.generate([list(range(1, 50))] * 2, SamplingParams(max_tokens=2))
    assert llm.stats.prefix_hit_tokens == 0 and llm.cache.allocator.num_cached_blocks == 0
    for bad in (dict(prefix_caching=1), dict(prefix_caching=False, kv_store="embedded"), dict(kv_store=3),
                dict(model_id="")):  # fmt: skip
        with pytest.raises(InvalidEngineConfig):
            LLM(model, memory="1MiB", **bad)
    with pytest.raises(InvalidBlockKey):  # refused before the store is opened
        LLM(model, memory="1MiB", kv_store="embedded", kv_namespace="no spaces")


def test_a_request_reuses_blocks_another_is_still_prefilling(model):
    """Chunked prefill registers blocks as chunks fill them; a later request with the same prefix hits them."""
    prompts = prompts_with_shared_prefix(2, shared=96, seed=2)
    llm = LLM(model, memory="1MiB", max_num_batched_tokens=40, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.stats.prefix_hit_tokens == 96
    plain = LLM(model, memory="1MiB", prefix_caching=False)
    assert got == [o.token_ids for o in plain.generate(prompts, params)]


def test_runner_block_table_follows_a_copy_on_write(model):
    """A reservation that copies a shared partial last block changes an entry the runner already copied."""
    llm = LLM(model, memory="1MiB")
    cache = llm.cache
    sched = Scheduler(cache, 4, 64, llm.scheduler.hasher)
    runner = ModelRunner(llm.model, cache)
    seq = Sequence(list(range(1, 21)), SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add([seq])
    batch = sched.schedule()
    runner.prepare(batch)
    sched.advance(batch[0])
    seq.output.append(5)
    cache.fork(seq.seq_id, "twin")  # the partial second block is now shared
    batch = sched.schedule()
    runner.prepare(batch)
    assert seq.block_table[: seq.num_table_blocks].tolist() == cache.block_table(seq.seq_id)
    assert cache.block_table(seq.seq_id)[1] != cache.block_table("twin")[1]
    cache.free("twin")
    sched.fail(seq, "done")
    assert cache.num_free_blocks == cache.num_blocks
