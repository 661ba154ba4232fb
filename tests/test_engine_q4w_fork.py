"""Forked groups (`LLM.add_forked_request`, n > 1) over int4_kchan64_vtok_asym_sink4_win64_v1 (cache/paged_q4w.py):
the choices share the prompt's full pages and their pins, and copy the shared partial page's F16 rows (and, inside
page 0, its sink slot) on their first write. Greedy forks are n copies of the unforked request, seeded ones equal
the same seeds run as separate requests, every choice's stored form is quant4w.encode_sequence of its own rows,
preemption and an aborted choice give back exactly what they hold, and no block, window page or sink slot is
held at the end. Forks at 3 prompt tokens (inside the sinks of page 0), 64 (a page boundary: nothing to copy)
and 150 (past the seal of page 0, mid-page 2).

The tiny model and its fixtures are tests/test_engine_q4w.py's (4 seats, chunks of 64 tokens, the window pages
and sink slots of plan_sizes): every engine here runs at that exact budget."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from q4w_helpers import sharp_llama
from test_engine_q4w import assert_all_given_back, engine
from test_pool_q4w import Sequences

from int8kv import quant4w
from int8kv.cache.paged import PagedKvCache
from int8kv.cache.state import KvLayout
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import KvPoolExhausted, ShapeMismatch
from int8kv.formats import KvStorageFormat

FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_sink", "v_sink", "k_window", "v_window")
VOCAB, PAGE = 96, 64
# Prompt length -> new tokens: 3 decodes in each choice's copy of page 0 (its sink slot copied too), 64 in each
# choice's own page 1, 150 in each choice's copy of page 2 and seals the shared page 1 at 192.
LENGTHS = {3: 30, 64: 8, 150: 44}


@pytest.fixture(scope="module")
def model():
    return sharp_llama(0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The prompts the tests fork, each with the most new tokens a test asks of it.
PROMPTS = {n: (tokens(n, n), new) for n, new in (*LENGTHS.items(), (70, 30), (130, 30))}


@pytest.fixture(scope="module")
def unforked(model) -> dict[int, list[int]]:
    """Greedy tokens of each of PROMPTS run as one unforked request (in one batch, without prefix caching)."""
    llm = engine(model, prefix_caching=False)
    outs = llm.generate(
        [p for p, _ in PROMPTS.values()],
        [SamplingParams(max_tokens=new, ignore_eos=True) for _, new in PROMPTS.values()],
    )
    return {n: o.token_ids for n, o in zip(PROMPTS, outs, strict=True)}


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [replace(params, seed=params.seed + j) for j in range(n)]


class Written:
    """The F16 rows an engine wrote into its pool, per layer by slot (block * 64 + offset), copied wherever the
    pool copies a block; every finished sequence's stored form is checked against quant4w.encode_sequence of
    the rows its block table reaches (``checked`` counts them)."""

    def __init__(self, llm: LLM) -> None:
        self.llm, pool = llm, llm.cache.pool
        self.k = [{} for _ in range(pool.num_layers)]
        self.v = [{} for _ in range(pool.num_layers)]
        self.checked = 0
        write, copy, finish = pool.write_step, pool.copy_block, llm.scheduler.finish

        def write_step(layer, plan, k16, v16):
            tables, lens, cu = plan.block_tables.tolist(), plan.context_lens.tolist(), plan.cu_seqlens_q.tolist()
            for b in range(plan.batch):
                first = lens[b] - (cu[b + 1] - cu[b])
                for i, p in enumerate(range(first, lens[b])):
                    slot = tables[b][p // PAGE] * PAGE + p % PAGE
                    self.k[layer][slot], self.v[layer][slot] = k16[cu[b] + i].clone(), v16[cu[b] + i].clone()
            write(layer, plan, k16, v16)

        def copy_block(src, dst):
            copy(src, dst)
            for rows in self.k + self.v:
                for o in range(PAGE):
                    if src * PAGE + o in rows:
                        rows[dst * PAGE + o] = rows[src * PAGE + o]

        def finished(seq):
            self.check(seq.seq_id)
            finish(seq)

        pool.write_step, pool.copy_block, llm.scheduler.finish = write_step, copy_block, finished

    def check(self, seq_id) -> None:
        cache = self.llm.cache
        table, n = cache.block_table(seq_id), cache.context_len(seq_id)
        slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(n)]
        for layer in range(cache.num_layers):
            k = torch.stack([self.k[layer][s] for s in slots]).numpy()
            v = torch.stack([self.v[layer][s] for s in slots]).numpy()
            got, want = cache.pool.stored_form(layer, table, n), quant4w.encode_sequence(k, v)
            for f in FIELDS:
                assert getattr(got, f).tobytes() == getattr(want, f).tobytes(), (seq_id, layer, n, f)
        self.checked += 1


def run(llm: LLM, ids: list[int], after_first_decode=None, cached=None) -> list[list[int]]:
    """Step until done; the tokens each id streamed (``cached``: a dict to fill with each id's cached prompt
    tokens). ``after_first_decode()`` runs once every id has 2 tokens.
    After every step, what cache/paged_q4w.plan_sizes counts on: between steps the running sequences hold at most
    2 window pages and 1 sink slot each, shared ones counted once (the rest is kept for prefix hits)."""
    out = {i: [] for i in ids}
    pool = llm.cache.pool
    while llm.has_unfinished():
        llm.step()
        kept_w, kept_s = pool.kept()
        assert pool.windows_held() - kept_w <= 2 * llm.num_running and pool.sinks_held() - kept_s <= llm.num_running
        for u in llm.pop_updates():
            out.setdefault(u.request_id, []).extend(u.new_token_ids)
            if cached is not None:
                cached[u.request_id] = u.num_cached_tokens
        if after_first_decode is not None and all(len(out[i]) == 2 for i in ids):
            after_first_decode()
            after_first_decode = None
    return [out[i] for i in ids]


# (window pages, sink slots, free blocks of 64) once each of the 4 choices decoded its first token: 3 tokens: each
# choice has its own copy of page 0 with its sink slot (the youngest kept the original); 64: page 0 shared (its
# F16 rows still unsealed), each choice's own page 1; 150: page 0 sealed and given back, page 1 shared (pinned:
# the next queries read it in F16), page 2 copied per choice.
HELD = {3: (4, 4, 60), 64: (5, 1, 59), 150: (5, 1, 58)}


@pytest.mark.parametrize("length", list(LENGTHS))
def test_greedy_forks_are_n_copies_of_the_unforked_request_each_storing_its_own_rows(model, unforked, length):
    (prompt, _), params = PROMPTS[length], SamplingParams(max_tokens=LENGTHS[length], ignore_eos=True)
    want = unforked[length]
    llm = engine(model)
    written = Written(llm)
    ids = llm.add_forked_request(prompt, params, n=4)
    held = []
    outs = run(llm, ids, lambda: held.append((llm.cache.pool.windows_held(), llm.cache.pool.sinks_held(),
                                              llm.cache.num_free_blocks)))  # fmt: skip
    assert outs == [want] * 4
    assert held == [HELD[length]]
    assert llm.stats.prefill_tokens == length and llm.stats.failed_requests == 0
    assert written.checked == 4
    assert_all_given_back(llm)


def test_seeded_forks_equal_the_same_seeds_run_as_separate_requests(model):
    """Chunked prefill (150 tokens in chunks of 64) and a fork mid-page; the choices diverge from their first
    token, so a choice reading a sibling's copy of the partial page would sample other tokens."""
    prompt = PROMPTS[150][0]
    # Temperature 30 undoes the model's x30 output layer: at 1, all 4 seeds sampled the same first token.
    params = SamplingParams(max_tokens=12, temperature=30.0, seed=3, ignore_eos=True)
    want = [o.token_ids for o in engine(model).generate([prompt] * 3, choices(params, 3))]
    assert len({w[0] for w in want}) > 1 and len({tuple(w) for w in want}) == 3
    llm = engine(model)
    written = Written(llm)
    assert run(llm, llm.add_forked_request(prompt, params, n=3)) == want
    assert llm.stats.prefill_tokens == 150 and written.checked == 3
    assert_all_given_back(llm)


def test_preempted_and_aborted_choices_give_back_exactly_what_they_hold(model, unforked):
    """Two groups of two greedy choices in 6 pages (the 70-token group needs 1 shared + 2 x 1 own, the 130-token one
    2 shared + 2 x 1 own): choices are preempted (their references dropped, the pages their sibling holds kept)
    and recomputed, hitting the prompt's pages again. Then a choice aborted mid-decode gives back its own copy of
    the partial page (a block and its window page) and nothing its siblings read."""
    prompts, params = [PROMPTS[70][0], PROMPTS[130][0]], SamplingParams(max_tokens=30, ignore_eos=True)
    llm = engine(model, blocks=6)
    written = Written(llm)
    ids = [i for p in prompts for i in llm.add_forked_request(p, params, n=2)]
    assert run(llm, ids) == [unforked[70]] * 2 + [unforked[130]] * 2
    assert llm.stats.preemptions > 0 and llm.stats.failed_requests == 0 and written.checked == 4
    assert_all_given_back(llm)
    llm = engine(model)
    pool, short = llm.cache.pool, SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.add_forked_request(prompts[1], short, n=3)
    victim, seen = ids[1], []

    def abort():  # after the prefill (3 chunks) and the first decode, which copied page 2 for each choice
        own = [b for b in llm.cache.block_table(victim) if llm.cache.allocator.refcount(b) == 1]
        seen.append((len(own), pool.windows_held(), pool.sinks_held(), llm.cache.num_free_blocks))
        assert llm.abort_request(victim)
        seen.append((pool.windows_held(), pool.sinks_held(), llm.cache.num_free_blocks))

    outs = run(llm, ids, abort)
    # Page 0 sealed and given back, page 1 shared (F16, pinned), three copies of page 2; the victim's copy goes.
    assert seen == [(1, 4, 1, 64 - 5), (3, 1, 64 - 4)]
    assert outs[0] == outs[2] == unforked[130][:6] and outs[1] == unforked[130][:2]
    assert_all_given_back(llm)


def test_a_forked_group_on_prefix_hits(model, unforked):
    """A request of 150 tokens leaves pages 0-1 cached (page 1 keeps its F16 rows); a group of the same prompt hits
    them (128 tokens), prefills the other 22 once and forks: its tokens are those computed without the cache, its
    stored forms those of its own rows."""
    prompt, params = PROMPTS[150][0], SamplingParams(max_tokens=12, ignore_eos=True)
    llm = engine(model)
    written = Written(llm)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    prefilled = llm.stats.prefill_tokens
    ids, cached = llm.add_forked_request(prompt, params, n=3), {}
    outs = run(llm, ids, cached=cached)
    assert outs == [unforked[150][:12]] * 3 and llm.stats.prefill_tokens - prefilled == 22
    assert [cached[i] for i in ids] == [128] * 3
    assert written.checked == 4
    assert_all_given_back(llm)


def test_the_cache_copies_a_shared_partial_page_or_refuses_with_nothing_changed():
    """On the cache and pool alone (2 layers, 2 KV heads x 16): a fork inside page 0 shares its sink slot until
    the child writes; the copy then takes a window page and a sink slot of its own, or is refused
    (KvPoolExhausted) with the allocator and the pool as they were. The copy continues past the seal of its page
    0 (the sinks' rule) storing encode_sequence of the parent's rows then its own."""
    layout = KvLayout(2, 2, 16, KvStorageFormat.INT4_SINK_WINDOW_V1)
    tight = PagedKvCache.with_groups(4, PAGE, [layout], window_pages=1, sink_slots=1)
    tight.add_sequence("a", 3)
    Sequences(tight.pool, [tight.block_table("a")], seed=1).step([3])
    tight.fork("a", "b")
    books = (tight.block_table("b"), tight.num_free_blocks, tight.pool.windows_held(), tight.pool.sinks_held())
    with pytest.raises(KvPoolExhausted, match="window page or a sink slot"):
        tight.grow("b", 1)
    assert books == (tight.block_table("b"), tight.num_free_blocks, tight.pool.windows_held(),
                     tight.pool.sinks_held()) and tight.context_len("b") == 3  # fmt: skip
    spare = next(b for b in range(4) if tight.allocator.refcount(b) == 0)
    with pytest.raises(KvPoolExhausted, match="window page or a sink slot"):
        tight.pool.copy_block(tight.block_table("a")[0], spare)
    with pytest.raises(ShapeMismatch, match="onto itself"):
        tight.pool.copy_block(0, 0)
    assert (tight.pool.windows_held(), tight.pool.sinks_held()) == (1, 1)
    tight.free("b")
    tight.free("a")
    assert (tight.pool.windows_held(), tight.pool.sinks_held(), tight.num_free_blocks) == (0, 0, 4)

    cache = PagedKvCache.with_groups(6, PAGE, [layout], window_pages=6, sink_slots=2)
    cache.add_sequence("a", 3)
    seqs = Sequences(cache.pool, [cache.block_table("a")], seed=2)
    seqs.step([3])
    cache.fork("a", "b")
    cache.grow("b", 125)  # the copy of page 0, then pages 1 (new)
    assert cache.block_table("b")[0] != cache.block_table("a")[0]
    assert (cache.pool.windows_held(), cache.pool.sinks_held()) == (2, 2)  # page 1 takes its own when written
    for layer in range(2):  # the copy holds the parent's stored form
        got, want = (cache.pool.stored_form(layer, cache.block_table(s), 3) for s in "ab")
        assert all(np.array_equal(getattr(got, f), getattr(want, f)) for f in FIELDS)
    # The child goes on alone past 128 positions: its page 0 is sealed from its own copy (sinks included).
    child = Sequences(cache.pool, [cache.block_table("b")], seed=3)
    for layer in range(2):
        child.k[layer][0], child.v[layer][0] = seqs.k[layer][0].clone(), seqs.v[layer][0].clone()
    child.step([125])
    child.check_stored()
    seqs.check_stored()  # the parent's page 0 is untouched
    cache.free("b")
    assert (cache.pool.windows_held(), cache.pool.sinks_held()) == (1, 1)  # the parent's page 0 and sink slot
    cache.free("a")
    assert (cache.pool.windows_held(), cache.pool.sinks_held(), cache.num_free_blocks) == (0, 0, 6)
