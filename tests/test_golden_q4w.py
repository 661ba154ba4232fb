"""The committed KV file of the 4-bit format with sinks and a window (tests/golden/q4w_state.kv, written by
make_q4w_files.py) loads to the stored form it was written with, which is quant4w.encode_sequence of its inputs,
re-saving the loaded state gives the same bytes, and its header is the layout docs/kv_file_format.md freezes."""

import json
import pathlib
import struct

import numpy as np

from int8kv import quant4w
from int8kv.cache.paged_q4w import Int4SinkWindowCache
from int8kv.cache.state import KvLayout
from int8kv.cache.state_q4w import Q4W, TENSOR_NAMES
from int8kv.store import inspect_kv, load_kv
from int8kv.store._util import raw_bytes
from int8kv.store.format import encode

GOLDEN = pathlib.Path(__file__).with_name("golden")
EXPECTED = dict(np.load(GOLDEN / "q4w_state_expected.npz", allow_pickle=False))
LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 150
PATH = GOLDEN / "q4w_state.kv"


def test_the_file_loads_to_the_codecs_stored_form_and_resaves_to_the_same_bytes():
    cache = Int4SinkWindowCache(4, LAYERS, HEADS, DIM, window_pages=4, sink_slots=1)
    loaded = load_kv(PATH, cache, seq_id="s")
    assert loaded.format is Q4W and loaded.token_ids.tolist() == [list(range(300, 300 + TOKENS))]
    assert loaded.metadata == {"fixture": "q4w"} and (loaded.batch, loaded.seq_len) == (1, TOKENS)
    state = cache.export_state("s")
    assert state.layout == KvLayout(LAYERS, HEADS, DIM, Q4W)
    for layer in range(LAYERS):
        want = quant4w.encode_sequence(EXPECTED["k_input"][layer], EXPECTED["v_input"][layer])
        for name in TENSOR_NAMES:
            got = state.arrays[name][layer, 0]
            assert got.dtype == EXPECTED[name].dtype and got.tobytes() == EXPECTED[name][layer, 0].tobytes(), name
            assert got.tobytes() == getattr(want, name).tobytes(), name
    info = inspect_kv(PATH)
    header, tensors, _ = encode(state, loaded.token_ids, None, loaded.metadata, info["source"], info["created_by"])
    assert header + b"".join(bytes(raw_bytes(t)) for t in tensors) == PATH.read_bytes()
    assert info["kv_bytes"] == LAYERS * HEADS * quant4w.stored_bytes(TOKENS, DIM)


def test_the_header_is_the_documented_layout():
    raw = PATH.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert meta["format_version"] == "1" and meta["storage_format"] == quant4w.NAME and meta["seq_len"] == "150"
    c, r = 1, TOKENS - 64  # block 0 sealed; the window: positions 64..149
    shapes = {
        "token_ids": [1, TOKENS], "k_codes": [2, 1, c, 64, 2, 4], "k_scale": [2, 1, c, 2, 8], "k_min": [2, 1, c, 2, 8],
        "k_sink": [2, 1, 4, 2, 8], "k_window": [2, 1, r, 2, 8], "v_codes": [2, 1, c, 64, 2, 4],
        "v_scale": [2, 1, c, 64, 2], "v_min": [2, 1, c, 64, 2], "v_sink": [2, 1, 4, 2, 8], "v_window": [2, 1, r, 2, 8],
    }  # fmt: skip
    assert {name: entry["shape"] for name, entry in header.items()} == shapes
    order = sorted(header, key=lambda name: header[name]["data_offsets"][0])
    assert order == ["token_ids", *TENSOR_NAMES]
    assert {header[name]["dtype"] for name in TENSOR_NAMES} == {"U8", "F16"}
