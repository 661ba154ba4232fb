"""The block store over the 4-bit format with sinks and a window (engine/store_tier.py PageStoreTier,
blockstore/codec_q4w.py): a second engine with the same store and an empty prefix cache loads the run of pages a
prompt can continue from (sealed values of pages 0 .. j - 2, the end value of page j - 1) and answers the same
greedy tokens with the same stored form as the first engine and as one without a store; a store without the end
value a run needs gives a shorter hit, never a wrong one; damaged or out-of-domain values are refused, deleted and
recomputed; every block, window page and sink slot comes back. The tiny model of tests/test_engine_q4w.py, a disk
store in the test's tmp dir."""

from __future__ import annotations

import numpy as np
import pytest
import valkey_servers
import xxhash
from q4w_helpers import sharp_llama
from test_engine_q4w import engine
from test_engine_q4w_prefix import assert_clean, record_forms, same_form, tokens

from int8kv.blockstore.codec_q4w import SEALED, PageSpec, end_key
from int8kv.blockstore.disk import DiskBlockStore
from int8kv.cache.paged_q4w import Int4SinkWindowCache
from int8kv.cache.state import KvLayout
from int8kv.cache.state_q4w import Q4W, Q4WState
from int8kv.engine import SamplingParams
from int8kv.errors import KvPoolExhausted, ShapeMismatch, UnsupportedFormat
from int8kv.quant4w import encode_sequence

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
SECRET = "q4w-store-test-secret-0123"
valkey_node = valkey_servers.valkey_node  # the module's fixture


@pytest.fixture(scope="module")
def model():
    return sharp_llama(0)


def run(model, prompts, store=None, params=PARAMS, **kw):
    """An engine (with ``store``: a disk store path or a URL), each prompt run alone; (engine, outputs, stored
    forms)."""
    if store is not None:
        kw["kv_store"] = store if isinstance(store, str) else f"disk:{store}"
    llm = engine(model, **kw)
    forms = record_forms(llm)
    outs = [llm.generate([p], params)[0] for p in prompts]
    if store is not None:
        assert llm.flush_kv_store(10)
    return llm, outs, forms


def keys_of(llm, prompt: list[int]) -> list[bytes]:
    return llm.scheduler.hasher.block_keys(prompt[: len(prompt) // 64 * 64], [])


def test_a_second_engine_loads_the_run_and_answers_as_the_first(model, tmp_path):
    prompt = tokens(200, 1)
    plain, want, plain_forms = run(model, [prompt])
    first, outs_a, forms_a = run(model, [prompt], tmp_path)
    tier = first.scheduler.tier
    # 207 positions at the end: pages 0 and 1 sealed, and one end value, page 2's (the prompt's last full page
    # before its last token, which is also the finished sequence's last full page).
    assert (tier.pushed_blocks, tier.pushed_ends, tier.faults) == (2, 1, 0)
    second, outs_b, forms_b = run(model, [prompt], tmp_path)
    assert outs_a[0].token_ids == outs_b[0].token_ids == want[0].token_ids
    assert second.stats.store_hit_tokens == 192 and second.stats.prefix_hit_tokens == 0
    assert outs_b[0].num_cached_tokens == 192 and second.stats.prefill_tokens == 200 - 192
    assert second.stats.store_faults == 0 and second.kv_store.stats().hits == 3
    for (ta, a), (tb, b), (tp, p) in zip(forms_a, forms_b, plain_forms, strict=True):
        assert ta == tb == tp and same_form(a, b) and same_form(a, p)
    for llm in (plain, first, second):
        assert_clean(llm)
        llm.close()


def test_the_next_turn_of_a_chat_hits_the_end_of_the_previous_one(model, tmp_path):
    prompt, params = tokens(100, 2), SamplingParams(max_tokens=30, ignore_eos=True)
    first, outs_a, _ = run(model, [prompt], tmp_path, params)
    tier = first.scheduler.tier
    # Page 0 ends the prompt's run ((100 - 1) // 64 - 1), page 1 the finished sequence's (129 // 64 - 1).
    assert (tier.pushed_blocks, tier.pushed_ends) == (1, 2)
    turn = prompt + outs_a[0].token_ids + tokens(20, 3)  # 150 tokens: a hit may cover 2 pages
    plain, want, plain_forms = run(model, [turn])
    second, outs_b, forms = run(model, [turn], tmp_path)
    assert outs_b[0].token_ids == want[0].token_ids
    assert second.stats.store_hit_tokens == 128 and outs_b[0].num_cached_tokens == 128
    for llm in (first, plain, second):
        assert_clean(llm)
        llm.close()


def test_without_the_end_value_the_hit_is_shorter_never_wrong(model, tmp_path):
    base = tokens(200, 4)
    first, _, _ = run(model, [base[:130], base], tmp_path)  # end values of pages (130 - 1) // 64 - 1 = 1 and 2
    store = DiskBlockStore(tmp_path)
    keys = keys_of(first, base)
    assert store.present([end_key(k) for k in keys]) == [False, True, True]
    assert store.lookup(keys) == 2  # 207 positions at the end: pages 0 and 1 sealed
    store.delete(end_key(keys[2]))
    plain, want, plain_forms = run(model, [base])
    second, outs, forms = run(model, [base], tmp_path)
    assert outs[0].token_ids == want[0].token_ids and same_form(forms[0][1], plain_forms[0][1])
    assert second.stats.store_hit_tokens == 128  # pages 0 sealed and 1 as F16 rows, page 2 recomputed
    for key in keys:  # the second engine pushed page 2's end value again: only sealed values are left
        store.delete(end_key(key))
    third, outs, _ = run(model, [base], tmp_path)  # only sealed values: pages 1 and 2 would need F16 rows
    assert outs[0].token_ids == want[0].token_ids and third.stats.store_hit_tokens == 0
    assert third.stats.store_faults == 0
    for llm in (first, plain, second, third):
        assert_clean(llm)
        llm.close()
    store.close()


def test_damaged_values_are_refused_deleted_and_recomputed(model, tmp_path):
    prompt = tokens(200, 5)
    first, want, _ = run(model, [prompt], tmp_path)
    store = DiskBlockStore(tmp_path)
    keys = keys_of(first, prompt)
    spec = PageSpec(first.cache.layout, first.fingerprint)
    sealed1 = store.path_of(keys[1])
    good = sealed1.read_bytes()
    cases = {
        "bit flip": lambda b: b.__setitem__(len(b) // 2, b[len(b) // 2] ^ 0x10),
        "truncated": lambda b: b.__delitem__(slice(len(b) - 5, None)),
        "NaN scale, digest recomputed": lambda b: nan_scale(b, spec),
    }
    for what, damage in cases.items():
        bad = bytearray(good)
        damage(bad)
        sealed1.write_bytes(bytes(bad))
        llm, outs, _ = run(model, [prompt], tmp_path)
        assert outs[0].token_ids == want[0].token_ids, what
        assert llm.stats.store_hit_tokens == 0 and llm.stats.store_faults == 1, what
        # Refused and deleted, so the engine that recomputed the run could put page 1's sealed value again (the
        # one put that found its key absent), which the next engine loads.
        stats = llm.kv_store.stats()
        assert (stats.invalid, stats.puts) == (1, 1) and sealed1.read_bytes() == good, what
        assert_clean(llm)
        llm.close()
    again, outs, _ = run(model, [prompt], tmp_path)
    assert outs[0].token_ids == want[0].token_ids and again.stats.store_hit_tokens == 192
    for e in (first, again):
        assert_clean(e)
        e.close()
    store.close()


def nan_scale(value: bytearray, spec: PageSpec) -> None:
    """A NaN where page 1's first key scale is, with the digest recomputed: only the value checks see it."""
    at = spec.header_len() + 2 * 64 * spec.layout.num_kv_heads * spec.layout.head_dim // 2
    assert spec.arrays(SEALED, 1)[1][0] == "k_scale"
    value[at : at + 2] = np.float16(np.nan).tobytes()
    value[-16:] = xxhash.xxh3_128_digest(bytes(value[:-16]))


def test_a_run_that_cannot_be_imported_is_computed_instead(model, tmp_path, monkeypatch):
    prompt = tokens(200, 6)
    first, want, _ = run(model, [prompt], tmp_path)
    llm = engine(model, kv_store=f"disk:{tmp_path}")
    calls = []

    def exhausted(seq_id, start, state):
        calls.append(state.length)
        raise KvPoolExhausted("every window page is held")

    monkeypatch.setattr(llm.cache, "write_state", exhausted)
    out = llm.generate([prompt], PARAMS)[0]
    assert calls == [192] and out.token_ids == want[0].token_ids and out.num_cached_tokens == 0
    assert llm.stats.store_hit_tokens == 0 and llm.stats.store_faults == 1 and llm.stats.prefill_tokens == 200
    for e in (first, llm):
        assert_clean(e)
        e.close()


def test_a_valkey_store_with_a_secret_shares_pages_only_with_its_holders(model, valkey_node):
    prompt = tokens(200, 7)
    first, want, _ = run(model, [prompt], valkey_node.url, kv_store_secret=SECRET, kv_namespace="q4w-secret")
    second, outs, _ = run(model, [prompt], valkey_node.url, kv_store_secret=SECRET, kv_namespace="q4w-secret")
    assert outs[0].token_ids == want[0].token_ids and second.stats.store_hit_tokens == 192
    assert second.kv_store.stats().hits == 3 and second.stats.store_faults == 0
    # Another secret names its keys otherwise (HMACs of the keys): nothing found, nothing refused, computed.
    other, outs, _ = run(model, [prompt], valkey_node.url, kv_store_secret=SECRET[::-1], kv_namespace="q4w-secret")
    assert outs[0].token_ids == want[0].token_ids and other.stats.store_hit_tokens == 0
    for llm in (first, second, other):
        assert_clean(llm)
        llm.close()


def test_write_state_takes_a_run_of_whole_pages_into_a_fresh_sequence_only():
    cache = Int4SinkWindowCache(8, 2, 2, 64, window_pages=6, sink_slots=2)
    rng = np.random.default_rng(8)
    k, v = (rng.standard_normal((2, 192, 2, 64)).astype(np.float32) for _ in range(2))

    def state(n):
        return Q4WState.of(cache.layout, [[encode_sequence(k[layer, :n], v[layer, :n])] for layer in range(2)])

    pool = cache.pool
    cache.add_sequence_with_prefix("s", 150, [])
    cache.write_state("s", 0, state(128))
    table = cache.block_table("s")
    want = state(128)
    for layer in range(2):
        got = pool.stored_form(layer, table, 128)
        assert all(np.array_equal(getattr(got, f), want.arrays[f][layer, 0]) for f in want.arrays)
    assert [pool.pins(b) for b in table] == [0, 1, 1]  # pinned from page j - 1 = 1, as after a hit of 2 pages
    before = (pool.windows_held(), pool.sinks_held(), cache.num_free_blocks)
    cache.add_sequence_with_prefix("t", 100, [])
    for seq, start, st in (("t", 64, state(64)), ("t", 0, state(100)), ("t", 0, state(128)), ("s", 0, state(64))):
        with pytest.raises(UnsupportedFormat):
            cache.write_state(seq, start, st)  # not from 0, not whole pages, longer than held, rows held
    with pytest.raises(ShapeMismatch):
        cache.write_state(
            "t",
            0,
            Q4WState.of(
                KvLayout(2, 1, 64, Q4W), [[encode_sequence(k[layer, :64, :1], v[layer, :64, :1])] for layer in (0, 1)]
            ),
        )
    assert (pool.windows_held(), pool.sinks_held(), cache.num_free_blocks + 2) == before
    cache.free("s")
    cache.free("t")
    assert pool.windows_held() == pool.sinks_held() == 0 and cache.num_free_blocks == 8


def test_a_longer_run_in_the_store_replaces_a_shorter_pool_hit(model, tmp_path):
    base = tokens(200, 9)
    first, want, plain_forms = run(model, [base], tmp_path)
    llm = engine(model, kv_store=f"disk:{tmp_path}")
    forms = record_forms(llm)
    short = llm.generate([base[:70] + tokens(7, 10)], PARAMS)[0]  # 85 positions: the pool keeps page 0's rows
    assert short.num_cached_tokens == 0 and llm.cache.allocator.match_prefix(keys_of(llm, base), 200) == 64
    out = llm.generate([base], PARAMS)[0]
    assert out.token_ids == want[0].token_ids and out.num_cached_tokens == 192
    assert llm.stats.prefix_hit_tokens == 0 and llm.stats.store_hit_tokens == 192
    assert same_form(forms[1][1], plain_forms[0][1])
    # Key 0 still names the short prompt's page (the first registration wins; the imported page 0 went back
    # unkeyed), which is not sealed: the pool's hit is 1 page again, and the store's run replaces it again.
    again = llm.generate([base], PARAMS)[0]
    assert again.token_ids == want[0].token_ids and again.num_cached_tokens == 192
    assert llm.stats.prefix_hit_tokens == 0 and llm.stats.store_hit_tokens == 384
    for e in (first, llm):
        assert_clean(e)
        e.close()
