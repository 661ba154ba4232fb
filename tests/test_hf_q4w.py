"""The transformers drop-in with the 4-bit format int4_kchan64_vtok_asym_sink4_win64_v1: logits against a float64
attention over the codec's stored form (quant4w.encode_sequence of each query's prefix), prefill and decode past
several page seals, a ragged left-padded batch, the cpu and reference backends, growth, crop / rollback / row
selection, and the refusals (by name, the cache unchanged)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from int8kv import quant4w
from int8kv.errors import NonFiniteError, UnsupportedFormat
from int8kv.formats import INT4_SINK_WINDOW_V1 as FMT
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache, Int8KvLayer
from int8kv.ops import check_kernels
from int8kv.ops.parts import KERNELS as PARTS_KERNELS
from int8kv.ops.reference_q4w import attend_q4w, query_runs

VOCAB = 96
ORACLE = "int8kv-test-q4w-oracle"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(7)


def tiny_model(layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def oracle_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Float64 attention of each query over the stored form of its own prefix (quant4w.encode_sequence of the
    rows a DynamicCache holds, padding included), keys from the row's first unmasked one: what a decode step at
    that position reads, per attend_q4w."""
    batch, hq, n, d = query.shape
    length = key.shape[2]
    out = torch.zeros(batch, n, hq, d, dtype=torch.float64)
    for b in range(batch):
        start = 0
        if attention_mask is not None:
            seen = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0, -1]
            start = int(seen.int().argmax()) if seen.dtype == torch.bool else int((seen == 0).int().argmax())
        k, v = key[b].transpose(0, 1).numpy(), value[b].transpose(0, 1).numpy()  # [length, H, d]
        q = query[b].transpose(0, 1)  # [n, Hq, d]
        for lo, hi in query_runs(length, n):
            lo = max(lo, start - (length - n))  # queries on padding: the kernels leave them out (zeros)
            if lo < hi:
                upto = length - n + hi
                form = quant4w.encode_sequence(k[:upto], v[:upto])
                out[b, lo:hi] = attend_q4w(q[lo:hi], form, scaling, start)
    return out.to(query.dtype), None


AttentionInterface.register(ORACLE, oracle_attention)
AttentionMaskInterface.register(ORACLE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def ragged(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width))
    mask = (torch.arange(width)[None, :] >= torch.tensor([[width - n] for n in lengths])).long()
    return ids * mask, mask


@torch.no_grad()
def fed(model, cache, ids, mask, bounds) -> torch.Tensor:
    """Logits of every position, ``ids`` fed in the chunks ``bounds`` (teacher forcing)."""
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out.append(model(ids[:, lo:hi], attention_mask=mask[:, :hi], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


@torch.no_grad()
def oracle_logits(model, ids, mask, bounds) -> torch.Tensor:
    before = model.config._attn_implementation
    model.config._attn_implementation_internal = ORACLE
    try:
        return fed(model, DynamicCache(), ids, mask, bounds)
    finally:
        model.config._attn_implementation_internal = before


def q4w_cache(model, backend="reference", **kwargs) -> Int8KvCache:
    return Int8KvCache(model.config, format=FMT.name, backend=backend, **kwargs)


def valid(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


# A prefill of 120 positions (no page sealed), decode steps sealing page 0 (at 128), a chunk of 60, decode steps
# sealing page 1 (at 192), up to 200 positions.
BOUNDS = [0, 120, 121, 122, *range(123, 131), 190, *range(191, 201)]


def test_both_spellings_and_the_enum_name_select_the_4bit_path():
    model = tiny_model(1)
    for fmt in (FMT, FMT.name):
        cache = Int8KvCache(model.config, format=fmt)
        assert cache.format is FMT and all(la.paged for la in cache.kv_layers())
    assert not Int8KvCache(model.config, format=KvStorageFormat.F16).kv_layers()[0].paged
    assert Int8KvLayer(format=FMT.name).paged


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_logits_match_float64_over_the_stored_form(backend):
    """A ragged left-padded batch of 2 to 200 positions (pages 0 and 1 sealed during decode): the drop-in's logits
    equal the float64 oracle's over the codec's stored form; the cache grew past its first capacity."""
    model = tiny_model(1)
    ids, mask = ragged([200, 187])
    cache = q4w_cache(model, backend, chunk_size=64)
    got = fed(model, cache, ids, mask, BOUNDS)
    want = oracle_logits(model, ids, mask, BOUNDS)
    layer = cache.layers[0]
    assert layer.capacity > 256 and layer.seq_len == 200 and cache.attention_calls == len(BOUNDS) - 1
    assert layer.capacity > -(-(120 + 64) // 64) * 64  # grew from its first capacity
    torch.testing.assert_close(valid(got, mask), valid(want, mask), atol=2e-4, rtol=0)
    assert cache.memory_bytes() == 2 * 2 * FMT.stored_bytes(200, 16)


def test_cpu_and_reference_backends_agree_on_a_two_layer_generation():
    """Greedy generation past two seals through both backends: the same tokens, logits within float32 noise."""
    model = tiny_model(2)
    ids, mask = ragged([130, 121])
    outs = []
    for backend in ("reference", "cpu"):
        cache = q4w_cache(model, backend)
        outs.append(
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                cache=cache,
                max_new_tokens=66,
                return_dict_in_generate=True,
                output_logits=True,
            )
        )
        assert cache.get_seq_length() == 130 + 65
    ref, cpu = outs
    assert torch.equal(ref.sequences, cpu.sequences)
    torch.testing.assert_close(torch.stack(cpu.logits), torch.stack(ref.logits), atol=1e-3, rtol=0)


def test_crop_within_the_window_equals_a_shorter_run_and_past_it_is_refused():
    model = tiny_model(2)
    ids, mask = ragged([170, 170])
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 100, *range(101, 150)])
    cache.crop(140)  # positions 128-139 are F16 rows still held (page 1 is sealed at 192)
    assert cache.get_seq_length() == 140
    got = fed(model, cache, ids, mask, [140, 141, 142, 170])
    fresh = q4w_cache(model)
    want = fed(model, fresh, ids, mask, [0, 100, *range(101, 141), 142, 170])[:, 140:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # A chunk to 195 seals page 1 (positions 64-127) at 192; the decode step from 195 reads it sealed, so its F16
    # rows are given back: a length of 150 would read them.
    fed(model, cache, torch.cat([ids, ids], 1), torch.cat([mask, mask], 1), [170, 195, 196])
    before = [la.seq_len for la in cache.layers], [la.pool.generation for la in cache.layers]
    with pytest.raises(UnsupportedFormat, match="gave back the F16 rows"):
        cache.crop(150)
    assert ([la.seq_len for la in cache.layers], [la.pool.generation for la in cache.layers]) == before
    cache.crop(-1)  # the last position: its page's rows are held
    assert cache.get_seq_length() == 195


def test_a_failed_step_rolls_every_layer_back():
    """NaN keys in layer 1 of a decode step that seals page 0 (layer 0 already wrote and sealed it): both layers
    back to where the step began, and the next steps equal an unfailed run's."""
    model = tiny_model(2)
    ids, mask = ragged([135, 135])
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 127])
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: o * math.nan)
    with pytest.raises(NonFiniteError):
        fed(model, cache, ids, mask, [127, 128])
    hook.remove()
    assert [la.seq_len for la in cache.layers] == [127, 127]
    got = fed(model, cache, ids, mask, [127, 128, 129, 135])
    want = fed(model, q4w_cache(model), ids, mask, [0, 127, 128, 129, 135])[:, 127:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reorder_and_beam_search():
    model = tiny_model(2)
    ids, mask = ragged([143, 136])
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 140])
    cache.reorder_cache(torch.tensor([1, 1, 0]))  # a row picked twice: independent copies
    order = torch.tensor([1, 1, 0])
    got = fed(model, cache, ids[order], mask[order], [140, 141, 143])
    want = fed(model, q4w_cache(model), ids[order], mask[order], [0, 140, 141, 143])[:, 140:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    beams = model.generate(
        ids, attention_mask=mask, cache=q4w_cache(model), num_beams=2, max_new_tokens=4, do_sample=False
    )
    assert beams.shape == (2, 147)


def test_refusals_by_name_leave_the_cache_unchanged():
    # Layers with a state beside their K/V: tests/test_q4w_sliding.py (sliding and chunked layers are served).
    model = tiny_model(1)
    ids, mask = ragged([20, 20])
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 20])
    with pytest.raises(UnsupportedFormat, match=FMT.name):
        cache.layers[0].stored()  # rows as parts: the stored form is export_state's (tests/test_hf_q4w_state.py)
    assert cache.get_seq_length() == 20
    # A backend whose KERNELS lack this pool's (a stand-in named triton, with the INT8 and F16 kernels only) refuses
    # it by the format's name.
    triton = SimpleNamespace(__name__="int8kv.ops.triton", KERNELS=PARTS_KERNELS)
    with pytest.raises(UnsupportedFormat, match=f"triton backend has no kernels for the {FMT.name}"):
        check_kernels(triton, cache.layers[0].pool)
