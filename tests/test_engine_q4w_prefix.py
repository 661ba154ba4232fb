"""Prefix caching over int4_kchan64_vtok_asym_sink4_win64_v1 (cache/paged_q4w.py): a request served from the prefix
cache stores the same form and generates the same greedy tokens as without it; multi-turn chat hits at the end of
the previous turn; a hit whose F16 rows are gone is shortened (to the longest usable run, honestly counted);
kept window pages and sink slots are taken back under pressure; sharers, preemption and eviction; no window page,
sink slot or block leaked once the prefix cache is cleared. A state machine drives the engine's scheduler over
the cache with rows that depend on the tokens only (as a model's K/V do) and checks every step's stored form
against quant4w.encode_sequence.

The tiny model and its fixtures are tests/test_engine_q4w.py's. Stored forms are compared on requests run one at a
time: the CPU matmuls are not batch-invariant (without a prefix cache, a prompt run alone and in a batch of four
stored a few F16 rows that differ in their last bit, with the same greedy tokens), so in a batch only tokens are
compared."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from q4w_helpers import sharp_llama
from test_engine_q4w import NAME, engine
from test_pool_q4w import Sequences

from int8kv import ops, quant4w
from int8kv.cache.paged_q4w import Int4SinkWindowCache, plan_sizes
from int8kv.cache.pool_q4w import Int4SinkWindowPool
from int8kv.cache.prefix import PrefixHasher
from int8kv.cache.state import KvLayout
from int8kv.engine import LLM, SamplingParams
from int8kv.engine.scheduler import Scheduler
from int8kv.engine.sequence import Sequence
from int8kv.errors import KvPoolExhausted, ShapeMismatch, UnsupportedFormat
from int8kv.formats import KvStorageFormat
from int8kv.ops.plan import plan_attention

FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_sink", "v_sink", "k_window", "v_window")
VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return sharp_llama(0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record_forms(llm: LLM) -> list[tuple[tuple[int, ...], list]]:
    """Hook the scheduler's finish: each finished request's (tokens, stored form of every layer) in order."""
    forms, finish = [], llm.scheduler.finish

    def finished(seq):
        table, n = llm.cache.block_table(seq.seq_id), llm.cache.context_len(seq.seq_id)
        forms.append((tuple(seq.tokens), [llm.cache.pool.stored_form(la, table, n) for la in range(2)]))
        finish(seq)

    llm.scheduler.finish = finished
    return forms


def same_form(a, b) -> bool:
    return all(getattr(x, f).tobytes() == getattr(y, f).tobytes() for x, y in zip(a, b, strict=True) for f in FIELDS)


def assert_clean(llm: LLM) -> None:
    """Nothing referenced; the pool holds only what cached pages keep, and nothing once the cache is cleared."""
    cache, pool = llm.cache, llm.cache.pool
    assert len(cache.allocator) == 0 and cache.num_free_blocks == cache.num_blocks
    assert (pool.windows_held(), pool.sinks_held()) == pool.kept()
    assert all(pool.pins(b) == 0 for b in range(cache.num_blocks))
    cache.clear_prefix_cache()
    assert cache.allocator.num_cached_blocks == 0 and len(cache.allocator.free_blocks()) == cache.num_blocks
    assert pool.windows_held() == pool.sinks_held() == 0 and pool.kept() == (0, 0)


def test_prefix_on_and_off_store_the_same_form_and_tokens(model):
    """Prompts sharing 30, 64, 150 and 200 tokens of one text (under a page, a page, ending mid-page in the third)
    and another 200, each with its own tail: one at a time (stored forms and tokens), then all at once (tokens)."""
    base = tokens(200, 1)
    prompts = [base[:n] + tokens(7, 10 + i) for i, n in enumerate((30, 64, 150, 200, 200))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for on in (False, True):
        llm = engine(model, prefix_caching=on)
        forms = record_forms(llm)
        solo = [llm.generate([p], params)[0] for p in prompts]
        batch = llm.generate(prompts, params)
        runs[on] = (llm, forms, solo, batch)
    (off, off_forms, off_solo, off_batch), (on, on_forms, on_solo, on_batch) = runs[False], runs[True]
    assert [o.token_ids for o in on_solo] == [o.token_ids for o in off_solo]
    assert [o.token_ids for o in on_batch] == [o.token_ids for o in off_batch]
    for (toks_a, a), (toks_b, b) in zip(off_forms[: len(prompts)], on_forms[: len(prompts)], strict=True):
        assert toks_a == toks_b and same_form(a, b)
    hits = [o.num_cached_tokens for o in on_solo]
    assert off.stats.prefix_hit_tokens == 0 and all(o.num_cached_tokens == 0 for o in off_solo + off_batch)
    assert hits[0] == 0 and max(hits) >= 128 and all(h % 64 == 0 for h in hits)
    assert on.stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in on_solo + on_batch)
    assert on.stats.prefix_hit_tokens < on.stats.prefix_queried_tokens
    assert on.stats.failed_requests == 0
    assert_clean(on)
    assert_clean(off)


def test_multi_turn_chat_hits_at_the_end_of_the_previous_turn(model):
    """Each turn's prompt is the previous prompt, its answer and a new message: the hit is every full page of the
    previous turn's stored positions (the F16 rows of its last full page were kept), and the tokens are those
    computed afresh. (The stored forms are not compared past the first turn: the answer's rows were computed one
    decode step at a time, a fresh prefill computes them 64 at a time, and the CPU matmuls differ in the last bit
    of a few F16 rows between the two; the state machine below checks hits bit for bit with rows that depend on
    the tokens only.)"""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    chats = {}
    for on in (False, True):
        llm = engine(model, prefix_caching=on)
        forms = record_forms(llm)
        prompt, outs = tokens(50, 2), []
        for turn in range(4):
            out = llm.generate([prompt], params)[0]
            outs.append(out)
            prompt = prompt + out.token_ids + tokens(9 + 13 * turn, 20 + turn)
        chats[on] = (llm, forms, outs)
    (_, off_forms, off_outs), (on_llm, on_forms, on_outs) = chats[False], chats[True]
    assert [o.token_ids for o in on_outs] == [o.token_ids for o in off_outs]
    assert same_form(off_forms[0][1], on_forms[0][1])  # the first turn, no hit: the same computation
    for prev, out in zip(on_outs, on_outs[1:], strict=False):
        stored = len(prev.prompt_token_ids) + len(prev.token_ids) - 1  # the last token is sampled, not stored
        assert out.num_cached_tokens == 64 * (stored // 64) > 0
    assert_clean(on_llm)


def test_a_hit_is_shortened_to_what_the_pool_still_holds(model):
    """A cached chain whose middle pages gave their F16 rows back: a prompt sharing only those pages gets no hit
    (the allocator alone would match them), tokens as without the cache; a kept page taken back under window
    pressure leaves its chain cached but unusable as a hit's end."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = tokens(260, 3)
    llm, plain = engine(model), engine(model, prefix_caching=False)
    alloc, pool = llm.cache.allocator, llm.cache.pool
    want = [o.token_ids for o in plain.generate([first], params)]
    assert [o.token_ids for o in llm.generate([first], params)] == want
    # 267 stored positions: pages 0-3 registered and sealed except page 3, whose F16 rows were kept.
    assert pool.kept() == (1, 1)
    short = first[:150] + tokens(5, 4)
    keys = llm.scheduler.hasher.block_keys(short[:128])
    alloc.hit_limit = None
    assert alloc.match_prefix(keys, len(short)) == 128  # without the pool's word: two pages
    alloc.hit_limit = pool.usable_prefix
    assert alloc.match_prefix(keys, len(short)) == 0  # page 1's F16 rows are gone (and page 0's)
    queried = llm.stats.prefix_queried_tokens
    out = llm.generate([short], params)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == plain.generate([short], params)[0].token_ids
    assert llm.stats.prefix_queried_tokens - queried == 128 and llm.stats.prefix_hit_tokens == 0
    # Pressure on the window pages: kept pages of many finished requests, then a batch that needs fresh ones.
    others = [tokens(70, 40 + i) for i in range(2 * pool.window_pages)]
    for p in others:
        llm.generate([p], SamplingParams(max_tokens=1))
    chain = first + want[0]  # the first request's whole text: page 3 is its last kept page, if still kept
    keys = llm.scheduler.hasher.block_keys(chain[:256])
    assert all(alloc.lookup(k) is not None for k in keys[:4])  # every page still cached ...
    assert alloc.match_prefix(keys, len(chain)) == 0  # ... but no usable end: its kept rows were taken back
    out = llm.generate([chain], params)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == plain.generate([chain], params)[0].token_ids
    assert llm.stats.failed_requests == 0
    assert_clean(llm)


def test_sharers_preemption_and_eviction_change_no_token(model):
    """Four requests share a warm 192-token prefix at once, their prefills of different lengths passing the
    shared page at different steps (a sharer still reading its F16 rows keeps them); then the same with 8 pages,
    so requests are preempted and cached pages evicted."""
    warm = tokens(200, 5)
    prompts = [warm[:192] + tokens(n, 50 + n) for n in (1, 20, 90, 150)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for blocks in (64, 9):
        plain, llm = engine(model, blocks=blocks, prefix_caching=False), engine(model, blocks=blocks)
        want = [o.token_ids for o in plain.generate([warm] + prompts, params)]
        llm.generate([warm], params)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want[1:]
        assert llm.stats.failed_requests == 0
        if blocks == 64:
            assert [o.num_cached_tokens for o in outs] == [192] * 4  # all hit the same kept page at once
        else:  # the hits were recomputed from the sequences' own cached pages; a longer request evicts them
            assert llm.stats.preemptions > 0
            other = tokens(400, 8)
            assert llm.generate([other], params)[0].token_ids == plain.generate([other], params)[0].token_ids
            assert llm.cache.allocator.evictions > 0
        assert_clean(llm)


def test_what_stays_refused_is_refused_by_name(model, tmp_path):
    llm = engine(model)
    cache = llm.cache
    cache.add_sequence("s", 70)
    with pytest.raises(UnsupportedFormat, match=NAME):
        cache.export_state("s")
    cache.free("s")
    assert_clean(llm)


def test_pool_pins_usable_prefixes_and_kept_rows():
    """The pool's books for sharing, on one sequence's pages [3, 1, 6, 0]: a usable prefix ends at a page holding
    its F16 rows after sealed pages; a pin keeps a page's F16 rows past settle; kept rows are taken back, least
    recently kept first, by a step short of window pages and sink slots."""
    pool = Int4SinkWindowPool(2, 2, 16, 8, 4, 1)
    first = Sequences(pool, [[3, 1, 6, 0]], seed=1)
    first.step([150], check_reads=False)
    pool.settle([3, 1, 6, 0], 150)  # page 0 sealed, its F16 rows given back; pages 1 and 2 still F16
    assert [pool.usable_prefix([3, 1, 6][:k]) for k in (1, 2, 3)] == [0, 2, 2]
    pool.pin([1])  # a sharer that hit pages [3, 1] reads page 1 in F16
    first.step([50], check_reads=False)
    pool.settle([3, 1, 6, 0], 200)  # page 1 sealed now, but pinned: its F16 rows stay
    assert pool.pins(1) == 1 and [pool.usable_prefix([3, 1, 6][:k]) for k in (2, 3)] == [2, 3]
    want = first.encoded(0, 0, 128)
    got = pool.stored_form(0, [3, 1], 128)  # what the sharer's next query reads
    assert all(getattr(got, f).tobytes() == getattr(want, f).tobytes() for f in FIELDS)
    with pytest.raises(ShapeMismatch, match="pinned"):
        pool.keep([1])
    pool.unpin([1])
    with pytest.raises(ShapeMismatch, match="not pinned"):
        pool.unpin([1])
    assert pool.settle([3, 1, 6, 0], 200) == 1 and pool.usable_prefix([3, 1]) == 0
    # The sequence ends; its pages 0-2 stay cached: page 2 keeps its window page, page 0 its sink slot.
    pool.release([0])
    pool.keep([3, 1, 6])
    assert pool.kept() == (1, 1) and (pool.windows_held(), pool.sinks_held()) == (1, 1)
    second = Sequences(pool, [[2, 4, 5, 7]], seed=2)
    second.step([256], check_reads=False)  # 4 window pages and a sink slot: 3 and 0 free, the rest kept
    second.check_stored()
    assert pool.kept() == (0, 0) and pool.usable_prefix([3, 1, 6]) == 0


# -- the scheduler over the cache, without a model --------------------------------------------------------------
LAYERS, HEADS, DIM = 2, 1, 16


_ROWS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def rows(toks: list[int], start: int, end: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K / V rows ``[end - start, HEADS, DIM]`` (float32) of positions [start, end): each a function of the tokens
    up to it (a running CRC of them), as a model's K/V are; keys with per-channel offsets."""
    ks, vs, h = [], [], 0
    for p in range(end):
        h = zlib.crc32(int(toks[p]).to_bytes(4, "little"), h)
        if p >= start:
            if (h, layer) not in _ROWS:
                g = np.random.default_rng([h, layer])
                keys = g.standard_normal((HEADS, DIM)) + np.arange(DIM) * 0.5
                _ROWS[h, layer] = (keys, g.standard_normal((HEADS, DIM)))
            ks.append(_ROWS[h, layer][0])
            vs.append(_ROWS[h, layer][1])
    shape = (0, HEADS, DIM)
    return tuple((np.stack(x) if x else np.zeros(shape)).astype(np.float32) for x in (ks, vs))


class PrefixMachine(RuleBasedStateMachine):
    """Requests drawn from three texts (any prefix of one, a tail of their own, or a finished request's whole text
    and more: multi-turn) run through the engine's Scheduler over an Int4SinkWindowCache sized by plan_sizes
    with few pages; each step writes the rows of ``rows`` and checks each scheduled sequence's stored form at its
    first query and at its end against quant4w.encode_sequence; the step never meets KvPoolExhausted."""

    SEATS, BUDGET = 3, 64

    @initialize(blocks=st.sampled_from([8, 30]))
    def start(self, blocks):
        """8 pages: preemption and eviction; 30: many cached pages keeping window pages, taken back."""
        layout = KvLayout(LAYERS, HEADS, DIM, KvStorageFormat.INT4_SINK_WINDOW_V1)
        _, windows, sinks = plan_sizes(0, layout, self.SEATS, self.BUDGET)
        self.cache = Int4SinkWindowCache(blocks, LAYERS, HEADS, DIM, windows, sinks)
        self.scheduler = Scheduler(self.cache, self.SEATS, self.BUDGET, PrefixHasher([layout], "rows", 64))
        self.texts = [tokens(320, 100 + i) for i in range(3)]
        self.finished: list[list[int]] = []
        self.live: list[Sequence] = []

    @rule(text=st.integers(0, 2), shared=st.integers(0, 320), tail=st.integers(0, 40), new=st.integers(1, 12),
          turn=st.booleans())  # fmt: skip
    def add(self, text, shared, tail, new, turn):
        prompt = self.texts[text][:shared]
        if turn and self.finished:
            prompt = self.finished[shared % len(self.finished)]
        prompt = (prompt + tokens(tail, shared * 41 + tail))[:300] or [7]
        seq = Sequence(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
        try:
            self.scheduler.add([seq])
        except KvPoolExhausted:
            return
        self.live.append(seq)

    @precondition(lambda self: self.scheduler.has_work())
    @rule(steps=st.integers(1, 8))
    def steps(self, steps):
        for _ in range(steps):
            if self.scheduler.has_work():
                self.step()

    def step(self):
        batch = self.scheduler.schedule()
        assert batch
        ids = [item.seq.seq_id for item in batch]
        tables, lens = self.cache.batch_tensors(ids)
        counts = [item.num_tokens for item in batch]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
        plan = plan_attention(self.cache.pool, tables, lens, cu_seqlens_q=cu)
        for layer in range(LAYERS):
            k, v = zip(*(rows(it.seq.tokens, it.seq.num_cached, it.seq.num_cached + it.num_tokens, layer)
                         for it in batch), strict=True)  # fmt: skip
            ops.append_paged_kv(self.cache.pool, layer, torch.from_numpy(np.concatenate(k)),
                                torch.from_numpy(np.concatenate(v)), plan=plan)  # fmt: skip
            for it in batch:
                table, first = self.cache.block_table(it.seq.seq_id), it.seq.num_cached
                for n in {first + 1, first + it.num_tokens}:  # the step's first query's prefix, and its end
                    got = self.cache.pool.stored_form(layer, table, n)
                    want = quant4w.encode_sequence(*rows(it.seq.tokens, 0, n, layer))
                    assert all(getattr(got, f).tobytes() == getattr(want, f).tobytes() for f in FIELDS), (layer, n)
        for it in batch:
            if self.scheduler.advance(it):
                seq = it.seq
                if seq.append(zlib.crc32(bytes(seq.tokens[-8:])) % VOCAB + 1, ()):
                    self.scheduler.finish(seq)
                    self.live.remove(seq)
                    self.finished.append(seq.tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def abort(self, i):
        seq = self.live.pop(i % len(self.live))
        self.scheduler.abort(seq)

    @rule()
    def clear(self):
        self.cache.clear_prefix_cache()
        assert self.cache.pool.kept() == (0, 0)

    @invariant()
    def books(self):
        pool, alloc = self.cache.pool, self.cache.allocator
        assert pool.windows_held() <= pool.window_pages and pool.sinks_held() <= pool.sink_slots
        assert sum(alloc.refcount(b) > 0 for b in range(alloc.num_blocks)) + alloc.num_free_blocks == alloc.num_blocks
        if not self.live:
            assert (pool.windows_held(), pool.sinks_held()) == pool.kept()

    def teardown(self):
        for seq in list(self.live):
            self.scheduler.abort(seq)
        self.cache.clear_prefix_cache()
        pool = self.cache.pool
        assert len(self.cache.allocator) == 0 and self.cache.num_free_blocks == self.cache.num_blocks
        assert pool.windows_held() == pool.sinks_held() == 0 and pool.kept() == (0, 0)
        assert all(pool.pins(b) == 0 for b in range(self.cache.num_blocks))


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
