"""The 4-bit drop-in's states (Int8KvCache(config, format="int4"), cache/state_q4w.py): export_state of a ragged
left-padded batch is every row's stored form (quant4w.encode_sequence of the rows it was fed, padding included),
save_kv / load_kv and import_state into a fresh cache restore it bit for bit, and the restored cache continues
(teacher-forced past a seal, and greedy generation) exactly as the uninterrupted one; bad states are refused, the
target unchanged. The tiny model of tests/test_hf_q4w.py."""

from __future__ import annotations

import pytest
import torch
from test_hf_q4w import FMT, fed, q4w_cache, ragged, tiny_model
from transformers import DynamicCache

from int8kv import quant4w
from int8kv.cache.state import KvLayout
from int8kv.cache.state_q4w import Q4W, TENSOR_NAMES, Q4WState
from int8kv.errors import ShapeMismatch
from int8kv.hf import Int8KvCache
from int8kv.store import load_kv, save_kv
from int8kv.store.errors import IncompatibleCache


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(11)


def layer0_keys_values(model, ids, mask, bounds):
    """Layer 0's keys and values ``[batch, length, H, d]`` fed in the chunks ``bounds``, from the model's own
    forward over a DynamicCache (layer 0's K/V do not depend on the attention, so they are the drop-in's)."""
    cache = DynamicCache()
    fed(model, cache, ids, mask, bounds)
    return cache.layers[0].keys.transpose(1, 2).numpy(), cache.layers[0].values.transpose(1, 2).numpy()


def test_round_trip_is_exact_and_continuing_is_identical(tmp_path):
    model = tiny_model(2)
    ids, mask = ragged([150, 133])  # row 1 left-padded by 17
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 64, 100, 101, 130])  # page 0 sealed at 128
    state = cache.export_state()
    assert isinstance(state, Q4WState) and (state.batch, state.length) == (2, 130)
    assert state.arrays["k_codes"].shape == (2, 2, 1, 64, 2, 8)
    k, v = layer0_keys_values(model, ids, mask, [0, 64, 100, 101, 130])
    for b in range(2):  # the codec's stored form of what the row was fed, padding included
        want, got = quant4w.encode_sequence(k[b], v[b]), state.rows(0, b)
        for name in TENSOR_NAMES:
            assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name
    path = tmp_path / "batch.kv"
    save_kv(path, cache, model=model, token_ids=ids[:, :130])
    restored = q4w_cache(model)
    loaded = load_kv(path, restored, model=model)
    assert loaded.cache is restored and torch.equal(loaded.token_ids, ids[:, :130])
    assert restored.export_state().equal(state)
    direct = Int8KvCache(model.config, format="int4", backend="reference")
    direct.import_state(state)
    assert direct.export_state().equal(state)
    bounds = [130, 131, 140, 141, 150]  # decode steps and chunks, up to page 1 in F16
    want = fed(model, cache, ids, mask, bounds)
    for other in (restored, direct):
        assert torch.equal(fed(model, other, ids, mask, bounds), want)
        assert other.export_state().equal(cache.export_state())
    # Greedy generation from a restored cache: the tokens of a run that never stopped.
    prompt, pmask = ids[:1, :130], mask[:1, :130]
    solo = q4w_cache(model)
    fed(model, solo, prompt, pmask, [0, 129])
    save_kv(tmp_path / "solo.kv", solo)
    whole = model.generate(prompt, attention_mask=pmask, cache=q4w_cache(model), max_new_tokens=12, do_sample=False)
    again = load_kv(tmp_path / "solo.kv", q4w_cache(model)).cache
    cont = model.generate(prompt, attention_mask=pmask, cache=again, max_new_tokens=12, do_sample=False)
    assert torch.equal(cont, whole)


def test_bad_states_are_refused_and_change_nothing(tmp_path):
    model = tiny_model(1)
    ids, mask = ragged([70, 70])
    cache = q4w_cache(model)
    fed(model, cache, ids, mask, [0, 70])
    state = cache.export_state()
    pool = cache.layers[0].pool
    books = (pool.windows_held(), pool.sinks_held())
    wide = KvLayout(1, 1, 16, Q4W)
    narrow = Q4WState.from_arrays(wide, 2, 70, {n: state.arrays[n][:, :, ..., :1, :] if n[2:] in (
        "codes", "sink", "window") or n in ("k_scale", "k_min") else state.arrays[n][..., :1] for n in TENSOR_NAMES})
    int8 = Int8KvCache(model.config, format="int8", backend="reference")
    fed(model, int8, ids, mask, [0, 70])
    for bad, match in ((narrow, "kv heads"), (int8.export_state(), "stores int8"), ("x", "stores str")):
        with pytest.raises(ShapeMismatch, match=match):
            cache.import_state(bad)
        assert cache.layers[0].pool is pool and (pool.windows_held(), pool.sinks_held()) == books
        assert cache.export_state().equal(state)
    with pytest.raises(ShapeMismatch, match="stores int4"):
        int8.import_state(state)
    save_kv(tmp_path / "int8.kv", int8)
    with pytest.raises(IncompatibleCache, match=f"stores int8.*{FMT.name}"):
        load_kv(tmp_path / "int8.kv", cache)
    assert cache.export_state().equal(state) and cache.get_seq_length() == 70
