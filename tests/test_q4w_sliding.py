"""The 4-bit format int4_kchan64_vtok_asym_sink4_win64_v1 on models with sliding-window and chunked layers: such
a layer keeps every page (its stored form is quant4w.encode_sequence of the whole sequence) and the kernels apply
its window or chunk. The drop-in's logits against a float64 attention over each query's stored form with the
window (and softcap) applied, on a ragged left-padded batch past a seal; the engine's greedy tokens against the
drop-in's, every layer on one full block table, its books empty at the end; the hybrid refusal kept.

Tiny random models of tests/test_engine_models.py: mistral-window (window 8 on every layer) and gemma2 (softcaps,
sliding and full layers alternating); prompts of 90 to 150 positions, so the window is far smaller than the prompt
and page 0 is sealed (at 128)."""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_models import build, prompts
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from int8kv import quant4w
from int8kv.cache.paged_q4w import plan_sizes
from int8kv.cache.state import KvLayout
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import UnsupportedFormat
from int8kv.formats import INT4_SINK_WINDOW_V1 as FMT
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache, Int8KvLayer
from int8kv.hf.layers import LayerSpec
from int8kv.ops.plan import AttentionVariant
from int8kv.ops.reference_q4w import attend_q4w, query_runs

Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
ORACLE = "int8kv-test-q4w-sliding-oracle"
VOCAB = 128


def oracle_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Float64 attention of each query over the stored form of its own prefix (encode_sequence of every row a
    full-layer DynamicCache holds, padding included), with the layer's window and softcap (kwargs), keys from the
    first one any query of the row sees (the mask's)."""
    variant = AttentionVariant(window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    batch, _, n, _ = query.shape
    length = key.shape[2]
    out = torch.zeros(batch, n, query.shape[1], query.shape[3], dtype=torch.float64)
    for b in range(batch):
        allowed = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0]  # [n, length] bool (SDPA's mask)
        start = int(allowed.any(dim=0).int().argmax())
        k, v = key[b].transpose(0, 1).numpy(), value[b].transpose(0, 1).numpy()  # [length, H, d]
        q = query[b].transpose(0, 1)  # [n, Hq, d]
        for lo, hi in query_runs(length, n):
            lo = max(lo, start - (length - n))  # queries on padding: the kernels leave them out (zeros)
            if lo < hi:
                form = quant4w.encode_sequence(k[: length - n + hi], v[: length - n + hi])
                out[b, lo:hi] = attend_q4w(q[lo:hi], form, scaling, start, variant)
    return out.to(query.dtype), None


AttentionInterface.register(ORACLE, oracle_attention)
AttentionMaskInterface.register(ORACLE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def ragged(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts(*lengths)])
    mask = (torch.arange(width)[None, :] >= torch.tensor([[width - n] for n in lengths])).long()
    return ids, mask


@torch.no_grad()
def fed(model, cache, ids, mask, bounds) -> torch.Tensor:
    """Logits of every position, ``ids`` fed in the chunks ``bounds`` (teacher forcing)."""
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out.append(model(ids[:, lo:hi], attention_mask=mask[:, :hi], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


# A prefill of 100 positions, decode steps to 110, a chunk to 131 (page 0 sealed at 128), decode steps to 140.
BOUNDS = [0, 100, *range(101, 111), 131, *range(132, 141)]


@pytest.mark.parametrize("name", ["mistral-window", "gemma2"])
def test_dropin_logits_match_float64_over_the_whole_stored_form_with_the_window(name):
    """Sliding layers (window 8) keep every page: seq_len positions held, no offset, the stored form's bytes of
    the whole sequence; logits equal the float64 oracle's (stored form of each query's prefix, window applied)."""
    model = build(name)
    ids, mask = ragged([140, 97])
    cache = Int8KvCache(model.config, format=FMT, backend="reference", chunk_size=64)
    got = fed(model, cache, ids, mask, BOUNDS)
    cache.finish_forward()  # the sliding layers' trim: nothing to drop in this format
    before = model.config._attn_implementation
    model.config._attn_implementation_internal = ORACLE
    try:
        want = fed(model, DynamicCache(), ids, mask, BOUNDS)  # no config: every layer keeps every row
    finally:
        model.config._attn_implementation_internal = before
    layers = cache.kv_layers()
    assert [la.spec.kind for la in layers] == (["sliding"] * 2 if name == "mistral-window" else ["sliding", "full"])
    assert all(la.seq_len == la.held == 140 and la.offset == 0 for la in layers)
    assert cache.attention_calls == 2 * (len(BOUNDS) - 1)
    assert cache.memory_bytes() == 2 * 2 * 2 * FMT.stored_bytes(140, 16)  # layers x batch x heads
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ["mistral-window", "gemma2"])
def test_engine_serves_sliding_layers_from_one_full_table(name):
    """The engine's greedy tokens equal the drop-in's (both the cpu kernels over the stored form, the window
    applied per layer); every layer sits on one block table sized by plan_sizes, and every block, window page and
    sink slot is back at the end."""
    model = build(name, seed=3)
    batch, params = prompts(150, 90, seed=5), SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(model, kv_format=FMT.name, memory="4MiB", backend="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    layers = model.config.num_hidden_layers
    layout = KvLayout(layers, 2, 16, Q4W)
    assert llm.cache.num_tables == 1 and llm.cache.layouts == (layout,)
    assert llm.cache.num_blocks == plan_sizes(4 << 20, layout, 4, 64)[0]
    assert llm.kv_bytes_per_token() == math.ceil(layout.bytes_per_token)
    outs = llm.generate(batch, params)
    cache = llm.cache
    assert cache.num_free_blocks == cache.num_blocks and len(cache.allocator) == 0
    assert (cache.pool.windows_held(), cache.pool.sinks_held()) == cache.pool.kept()
    cache.clear_prefix_cache()
    assert cache.pool.windows_held() == 0 and cache.pool.sinks_held() == 0
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               cache=Int8KvCache(model.config, format=FMT, backend="cpu"))[0, len(p):].tolist()
                for p in batch]  # fmt: skip
    assert [o.token_ids for o in outs] == want


def test_layers_with_a_state_stay_refused_by_name():
    for kind in ("full", "sliding"):
        spec = LayerSpec("hybrid", kind, window=8 if kind == "sliding" else None, state=True)
        with pytest.raises(UnsupportedFormat, match=f"{FMT.name}.*with a state"):
            Int8KvLayer(FMT, spec=spec)
