"""States of the engine's 4-bit cache (cache/paged_q4w.py, cache/state_q4w.py): a sequence exported mid-generation
(as a Q4WState and as a KV file) and imported into a NEW engine continues with exactly the tokens of the
uninterrupted run, its stored form equal to the exporter's (at the import and after continuing past a seal), and
every bad state or file is refused with a typed error, the target's blocks, window pages and sink slots as they
were. The tiny model and engine of tests/test_engine_q4w.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from store_helpers import forge, tensor_slice
from test_engine_q4w import NAME, SEQS, assert_all_given_back, engine, model, prompts  # noqa: F401 (fixtures)

from int8kv.cache.paged import PagedKvCache
from int8kv.cache.paged_q4w import Int4SinkWindowCache
from int8kv.cache.state import KvLayout, KvState
from int8kv.cache.state_q4w import Q4W, TENSOR_NAMES, Q4WState
from int8kv.engine import SamplingParams
from int8kv.engine.scheduler import Scheduled
from int8kv.engine.sequence import Sequence
from int8kv.errors import InvalidKvState, KvCacheError, KvPoolExhausted, ShapeMismatch, UnsupportedFormat
from int8kv.store import load_kv, save_kv
from int8kv.store.errors import (
    ChecksumMismatch,
    CorruptKvFile,
    HeaderShapeMismatch,
    IncompatibleCache,
    TruncatedKvFile,
)

TOTAL = 64  # tokens generated: prompt 70 ends at 133 (page 0 sealed at 128), prompt 130 at 193 (page 1 at 192)


def run_until(llm, prompt, generated: int):
    """Queue ``prompt`` (greedy, TOTAL tokens) and step the engine until its sequence has ``generated`` tokens;
    returns the running Sequence."""
    llm.add_request(prompt, SamplingParams(max_tokens=TOTAL, ignore_eos=True))
    while True:
        llm.step()
        (seq,) = llm.scheduler.running
        if len(seq.output) == generated:
            return seq


def decode(llm, seq: Sequence, steps: int) -> list[int]:
    """``steps`` greedy decode steps of ``seq`` (its K/V already in ``llm.cache``), as the engine runs them: one
    token fed at ``num_cached``, the window pages settled after each step."""
    out = []
    for _ in range(steps):
        seq.slots = llm.cache.grow(seq.seq_id, 1)
        tok = int(llm.runner.forward([Scheduled(seq, 1)])[0].argmax())
        seq.num_cached += 1
        seq.append(tok, ())
        llm.cache.release_outside_windows(seq.seq_id, seq.num_cached)
        out.append(tok)
    return out


def books(llm):
    cache = llm.cache
    return cache.num_free_blocks, cache.pool.windows_held(), cache.pool.sinks_held(), len(cache.allocator)


@pytest.mark.parametrize(("which", "generated"), [(1, 20), (2, 3)])  # state at 89 (no seal) / 132 (page 0 sealed)
def test_export_import_into_a_new_engine_continues_exactly(model, prompts, tmp_path, which, generated):  # noqa: F811
    prompt = prompts[which]
    fresh = engine(model)  # uninterrupted: its stored form before the last token is fed, and its tokens
    ref = run_until(fresh, prompt, TOTAL - 1)
    last = fresh.cache.export_state(ref.seq_id)
    while fresh.step():
        pass
    whole = ref.output
    assert len(whole) == TOTAL and ref.finish_reason == "length"
    assert_all_given_back(fresh)
    one = engine(model)
    seq = run_until(one, prompt, generated)
    state = one.cache.export_state(seq.seq_id)
    n = len(prompt) + generated - 1  # the last generated token is not fed yet
    assert isinstance(state, Q4WState) and (state.batch, state.length) == (1, n) and seq.output == whole[:generated]
    path = tmp_path / "seq.kv"
    info = save_kv(path, one.cache, seq_id=seq.seq_id, token_ids=seq.tokens[:n], model=model)
    assert info["storage_format"] == NAME and info["seq_len"] == n
    for route in ("state", "file"):
        other = engine(model)
        copy = Sequence(list(seq.tokens), SamplingParams(max_tokens=TOTAL - generated, ignore_eos=True))
        if route == "state":
            other.cache.import_state(copy.seq_id, state)
        else:
            loaded = load_kv(path, other.cache, seq_id=copy.seq_id, model=model)
            assert loaded.token_ids[0].tolist() == seq.tokens[:n]
        copy.num_cached = n
        assert other.cache.export_state(copy.seq_id).equal(state)
        assert other.cache.pool.windows_held() == one.cache.pool.windows_held()
        got = decode(other, copy, TOTAL - generated - 1)
        assert other.cache.export_state(copy.seq_id).equal(last)  # past the next seal
        got += decode(other, copy, 1)
        assert whole[:generated] + got == whole
        other.cache.free(copy.seq_id)
        assert_all_given_back(other)
    while one.step():  # the exporter goes on as if nothing happened
        pass
    assert seq.output == whole
    assert_all_given_back(one)


def test_bad_states_and_files_are_refused_and_change_nothing(model, prompts, tmp_path):  # noqa: F811
    src = engine(model)
    seq = run_until(src, prompts[2], 2)  # 131 positions: page 0 sealed, pages 1-2 in F16
    state = src.cache.export_state(seq.seq_id)
    for start, end in ((1, None), (0, 100)):
        with pytest.raises(UnsupportedFormat, match=f"stored form of a whole sequence.*{NAME}"):
            src.cache.export_state(seq.seq_id, start, end)
    with pytest.raises(UnsupportedFormat, match=NAME):
        src.cache.write_state(seq.seq_id, 0, state)
    path = tmp_path / "a.kv"
    save_kv(path, src.cache, seq_id=seq.seq_id)

    dst = engine(model, blocks=8)
    dst.cache.import_state("held", state)  # a sequence already there, whose pages must stay as they are
    before, held = books(dst), dst.cache.export_state("held")

    def unchanged():
        assert books(dst) == before and dst.cache.export_state("held").equal(held)

    arrays = {n: state.arrays[n] for n in TENSOR_NAMES}
    codes, scales = [torch.zeros(1, 3, 2, 64, dtype=torch.int8)] * 2, [torch.ones(1, 3, 2)] * 2
    int8 = KvState.build(KvLayout(2, 2, 64), codes, codes, scales, scales)
    pair = Q4WState.from_arrays(state.layout, 2, state.length, {n: np.concatenate([a, a], 1)
                                                                 for n, a in arrays.items()})
    for bad, match in (("not a state", "imports a Q4WState"), (int8, "imports a Q4WState"),
                       (with_layers(state, 1), "layout"), (pair, "holds 2")):
        with pytest.raises(ShapeMismatch, match=match):
            dst.cache.import_state("x", bad)
        unchanged()
    with pytest.raises(KvCacheError, match="already registered"):  # an id the cache holds
        dst.cache.import_state("held", state)
    unchanged()
    dst.cache.import_state("b", state)  # 6 of 8 blocks now held: a third copy needs 3
    with pytest.raises(KvPoolExhausted):
        dst.cache.import_state("c", state)
    dst.cache.free("b")
    unchanged()
    # The pool's own window pages / sink slots short: KvPoolExhausted from import_sequence, the blocks back too.
    bare = Int4SinkWindowCache(8, 2, 2, 64, window_pages=3, sink_slots=2)
    bare.import_state("a", state)  # 2 window pages, 1 sink slot
    taken = (bare.num_free_blocks, bare.pool.windows_held(), bare.pool.sinks_held(), len(bare.allocator))
    with pytest.raises(KvPoolExhausted, match="window pages"):
        bare.import_state("b", state)
    assert (bare.num_free_blocks, bare.pool.windows_held(), bare.pool.sinks_held(), len(bare.allocator)) == taken

    # Values the encoder never writes, and states built by hand: refused where the state is built.
    nan = dict(arrays, k_scale=arrays["k_scale"].copy())
    nan["k_scale"][1, 0, 0, 0, 3] = np.nan
    sink = dict(arrays, v_codes=arrays["v_codes"].copy())
    sink["v_codes"][0, 0, 0, 2] = 7  # a byte at a sink position of block 0
    window = dict(arrays, k_window=arrays["k_window"].copy())
    window["k_window"][0, 0, 5, 1, 9] = np.inf
    for bad, match in ((nan, "key a scale"), (sink, "sink position"), (window, "k_window")):
        with pytest.raises(InvalidKvState, match=match):
            Q4WState.from_arrays(state.layout, 1, state.length, bad)
    with pytest.raises(ShapeMismatch, match="k_window of 130 positions"):
        Q4WState.from_arrays(state.layout, 1, state.length - 1, arrays)
    with pytest.raises(ShapeMismatch, match="arrays"):
        Q4WState.from_arrays(state.layout, 1, state.length, {n: arrays[n] for n in TENSOR_NAMES[1:]})

    # Files: damaged, truncated, forged with valid digests, for another layout or cache: typed, nothing changed.
    def data_fn(name, edit):
        def fn(header, data):
            view = np.frombuffer(tensor_slice(header, name, data), dtype=np.uint8 if "codes" in name else np.float16)
            edit(view)
            return data
        return fn

    raw = path.read_bytes()
    (tmp_path / "cut.kv").write_bytes(raw[:-5])
    flipped = bytearray(raw)
    flipped[-3] ^= 1
    (tmp_path / "flip.kv").write_bytes(bytes(flipped))
    cases = [
        (tmp_path / "cut.kv", TruncatedKvFile, "ended|holds"),
        (tmp_path / "flip.kv", ChecksumMismatch, "sha256"),
        (forge(path, tmp_path / "nan.kv", data_fn=data_fn("v_scale", lambda v: v.__setitem__(70, np.nan))),
         CorruptKvFile, "v_scale"),
        (forge(path, tmp_path / "sink.kv", data_fn=data_fn("k_codes", lambda v: v.__setitem__(1, 3))),
         CorruptKvFile, "sink position"),
        (forge(path, tmp_path / "shape.kv", header_fn=lambda h: h["k_window"].__setitem__("shape", [2, 1, 2, 2, 64])),
         HeaderShapeMismatch, "k_window"),
        (forge(path, tmp_path / "len.kv", header_fn=lambda h: h["__metadata__"].__setitem__("seq_len", "150")),
         HeaderShapeMismatch, "shape"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            load_kv(bad, dst.cache, seq_id="x")
        unchanged()
    for target, match in ((None, NAME), (PagedKvCache(16, 16, 2, 2, 64), "stores int4")):
        with pytest.raises(IncompatibleCache, match=match):
            load_kv(path, target, seq_id=None if target is None else "x")
    narrow = Int4SinkWindowCache(8, 2, 1, 64, window_pages=4, sink_slots=2)
    with pytest.raises(IncompatibleCache, match="kv heads"):
        load_kv(path, narrow, seq_id="x")
    assert narrow.num_free_blocks == 8 and narrow.pool.windows_held() == 0


def with_layers(state: Q4WState, layers: int) -> Q4WState:
    layout = KvLayout(layers, state.layout.num_kv_heads, state.layout.head_dim, Q4W)
    return Q4WState.from_arrays(layout, 1, state.length, {n: state.arrays[n][:layers] for n in TENSOR_NAMES})
