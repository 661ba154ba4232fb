"""The engine over int4_kchan64_vtok_asym_sink4_win64_v1 (cache/paged_q4w.py): greedy tokens of the cpu backend
against the reference backend's and against a float64 forward whose attention reads each query's stored form
(quant4w.encode_sequence of its prefix), continuous batching of ragged requests past several seals with
chunked prefill and preemption, every block, window page and sink slot given back, and the refusals by name.

A tiny random Llama (2 layers, 2 KV heads of head_dim 64: the cpu kernel reads the codes in place) with a sharp
output layer, so greedy choices do not hinge on rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from q4w_helpers import LLAMA, sharp_llama
from transformers import LlamaForCausalLM
from transformers.modeling_utils import AttentionInterface

from int8kv import KvPoolExhausted, KvStorageFormat, QuantizedKvCache
from int8kv.blockstore.codec import BlockSpec
from int8kv.cache.paged import PagedKvCache
from int8kv.cache.paged_q4w import plan_sizes, sealed_page_bytes, sink_slot_bytes, window_page_bytes
from int8kv.cache.pool import KvPool
from int8kv.cache.state import KvLayout, KvState
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import InvalidEngineConfig, UnsupportedFormat
from int8kv.ops.reference_q4w import attend_q4w, query_runs
from int8kv.quant4w import encode_sequence

Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
NAME = "int4_kchan64_vtok_asym_sink4_win64_v1"
CFG = LLAMA
SEQS, BUDGET = 4, 64  # max_num_seqs, max_num_batched_tokens: prefills run in chunks of at most 64 tokens
# Ragged prompts: below the sinks, within the first page, across the first seal (64 + 64) and past it; each
# generates 40 tokens, so the longest ends at 240 positions (pages sealed at 128 and 192).
LENGTHS, NEW = (3, 70, 130, 200), 40
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return sharp_llama(0)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, CFG["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


def memory_for(blocks: int) -> int:
    """The budget holding exactly ``blocks`` sealed pages next to the window pages and sink slots."""
    layout = KvLayout(2, 2, 64, Q4W)
    _, windows, sinks = plan_sizes(0, layout, SEQS, BUDGET)
    return windows * window_page_bytes(layout) + sinks * sink_slot_bytes(layout) + blocks * sealed_page_bytes(layout)


def engine(model, backend="cpu", blocks=64, **kw) -> LLM:
    llm = LLM(model, kv_format=NAME, memory=memory_for(blocks), backend=backend, max_num_seqs=SEQS,
              max_num_batched_tokens=BUDGET, **kw)
    assert llm.cache.num_blocks == blocks and llm.cache.block_size == 64
    return llm


def assert_all_given_back(llm: LLM) -> None:
    """Every block free or cached; what the pool holds is only what cached pages keep for prefix hits, and
    nothing once the prefix cache is cleared."""
    cache = llm.cache
    assert cache.num_free_blocks == cache.num_blocks and len(cache.allocator) == 0
    assert (cache.pool.windows_held(), cache.pool.sinks_held()) == cache.pool.kept()
    cache.clear_prefix_cache()
    assert cache.pool.windows_held() == 0 and cache.pool.sinks_held() == 0


def float64_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention of float64 ``query [1, Hq, T, d]`` over the stored form of ``key`` / ``value``: each run
    of queries reading the same sealed pages reads quant4w.encode_sequence of its prefix, in float64."""
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, d]
    out = torch.zeros_like(q)
    for lo, hi in query_runs(q.shape[0], q.shape[0]):
        rows = encode_sequence(k[:hi].numpy(), v[:hi].numpy())
        out[lo:hi] = attend_q4w(q[lo:hi], rows, scaling)
    return out[None], None


AttentionInterface.register("q4w_float64", float64_attention)


def float64_argmax(model, ids: list[int]) -> torch.Tensor:
    """The float64 forward's greedy next token after each position of ``ids``."""
    ref = LlamaForCausalLM(model.config).double().eval()
    ref.load_state_dict(model.state_dict())
    ref.config._attn_implementation = "q4w_float64"
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].argmax(-1)


def test_greedy_matches_the_reference_backend_and_a_float64_decode_of_the_stored_form(model, prompts):
    one = engine(model, "cpu").generate(prompts, GREEDY)
    ref = engine(model, "reference", implementation="fused").generate(prompts, GREEDY)
    assert [o.token_ids for o in one] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW for o in one)
    for prompt, out in zip(prompts, one, strict=True):
        ids = prompt + out.token_ids
        want = float64_argmax(model, ids)[len(prompt) - 1 : -1].tolist()
        assert out.token_ids == want


def test_batching_chunks_and_preemption_change_no_token(model, prompts):
    solo = engine(model)
    alone = [solo.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert_all_given_back(solo)
    # 8 sealed pages for requests of 1, 2, 3 and 4 pages: the youngest are preempted and recomputed.
    small = engine(model, blocks=8)
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert small.stats.preemptions > 0 and small.stats.failed_requests == 0
    assert_all_given_back(small)
    # The engine's teacher-forced logits (score, chunks of the token budget) follow the same stored form.
    ids = prompts[3] + alone[3]
    logits = small.score(ids, chunk_size=500)
    assert logits.argmax(-1)[len(prompts[3]) - 1 : -1].tolist() == alone[3]
    assert_all_given_back(small)


def test_a_request_that_cannot_fit_is_refused_and_the_engine_goes_on(model, prompts):
    llm = engine(model, blocks=3)
    with pytest.raises(KvPoolExhausted, match="needs 4 blocks"):
        llm.generate([prompts[0], prompts[3]], GREEDY)  # 240 positions: 4 pages, of 3; neither is queued
    assert not llm.scheduler.has_work()
    assert_all_given_back(llm)
    fresh = engine(model, blocks=3).generate([prompts[1]], GREEDY)[0].token_ids
    assert llm.generate([prompts[1]], GREEDY)[0].token_ids == fresh
    assert_all_given_back(llm)


def test_refused_by_name(model, prompts, tmp_path):
    with pytest.raises(InvalidEngineConfig, match=f"{NAME}.*block_size=16"):
        LLM(model, kv_format=NAME, block_size=16)
    llm = engine(model, blocks=8)
    assert llm.scheduler.hasher is not None  # prefix caching on by default (tests/test_engine_q4w_prefix.py)
    cache = llm.cache  # forks are served (tests/test_engine_q4w_fork.py)
    cache.add_sequence("s", 5)
    for call in (lambda: cache.export_state("s", 1), lambda: cache.release_before("s", 64),
                 lambda: cache.read_rows(0, torch.zeros(1, dtype=torch.int64)), lambda: cache.state_layouts):
        with pytest.raises(UnsupportedFormat, match=NAME):
            call()
    cache.free("s")
    assert_all_given_back(llm)
    layout = KvLayout(2, 2, 64, Q4W)
    zeros = {n: [torch.zeros(1, 1, 2, 64, dtype=torch.float16)] * 2 for n in ("k_rows", "v_rows")}
    for call in (lambda: KvPool(layout, 4, 64), lambda: KvState.from_parts(layout, zeros),
                 lambda: QuantizedKvCache(2, 8, 2, 64, format=Q4W), lambda: PagedKvCache(4, 64, 2, 2, 64, Q4W),
                 lambda: BlockSpec(layout, 64, "m"), lambda: layout.bytes_per_block(64),
                 lambda: PagedKvCache.with_groups(4, 16, [layout], window_pages=4, sink_slots=1),
                 lambda: PagedKvCache.with_groups(4, 64, [layout], windows=(None, 8), window_pages=4, sink_slots=1),
                 lambda: PagedKvCache.with_groups(4, 64, [layout, KvLayout(1, 1, 128, Q4W)], window_pages=4,
                                                  sink_slots=1)):
        with pytest.raises(UnsupportedFormat, match=NAME):
            call()
    assert np.isfinite(layout.tokens_for_memory(1 << 20))  # sizing by the format's own figure
