"""Page values of the 4-bit format with sinks and a window (blockstore/codec_q4w.py, docs/kv_file_format.md "In the
block store (frozen)"): the committed fixtures (tests/golden/q4w_page*.block, make_q4w_pages.py) decode to
quant4w.encode_sequence of their inputs and encode back to the same bytes; runs of fresh random inputs (ragged head
counts and head_dims, runs of 1 to 3 pages) assemble to the stored form of 64 j positions bit for bit; every damaged,
foreign or out-of-domain value is refused with a typed error before anything is built from it."""

from __future__ import annotations

import pathlib
import struct

import numpy as np
import pytest
import xxhash

from int8kv.blockstore import (
    BlockEncodeError,
    BlockValueError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockValues,
    MisplacedBlock,
    NewerBlock,
    UnauthenticatedBlock,
)
from int8kv.blockstore.codec_q4w import END, SEALED, PageSpec, assemble_run, decode_page, encode_page, end_key
from int8kv.cache.state import KvLayout
from int8kv.cache.state_q4w import Q4WState
from int8kv.formats import INT4_SINK_WINDOW_V1, KvStorageFormat
from int8kv.quant4w import encode_sequence

GOLDEN = pathlib.Path(__file__).with_name("golden")
Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
FINGERPRINT, SECRET = "golden-tiny-model", b"golden-q4w-page-secret"
KEYS = [bytes([i + 1]) * 32 for i in range(3)]
SPEC = PageSpec(KvLayout(2, 2, 8, Q4W), FINGERPRINT)
SEALED_NAMES = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")


def page_arrays(k: np.ndarray, v: np.ndarray, pages: int) -> list[dict]:
    """The sealed arrays of pages 0 .. pages - 2 and the end arrays of page pages - 1 of ``k`` / ``v`` ``[L, n, H,
    d]`` (n >= 64 pages), from quant4w.encode_sequence of the first 64 pages positions."""
    n = 64 * pages
    rows = [encode_sequence(k[layer, :n], v[layer, :n]) for layer in range(k.shape[0])]
    out = [{name: np.stack([getattr(r, name)[p] for r in rows]) for name in SEALED_NAMES} for p in range(pages - 1)]
    if out:
        out[0]["k_sink"] = np.stack([r.k_sink for r in rows])
        out[0]["v_sink"] = np.stack([r.v_sink for r in rows])
        out.append({"k_rows": np.stack([r.k_window for r in rows]), "v_rows": np.stack([r.v_window for r in rows])})
    else:
        out.append({"k_rows": np.stack([np.concatenate([r.k_sink, r.k_window]) for r in rows]),
                    "v_rows": np.stack([np.concatenate([r.v_sink, r.v_window]) for r in rows])})  # fmt: skip
    return out


def expected_state(layout: KvLayout, k: np.ndarray, v: np.ndarray, n: int) -> Q4WState:
    return Q4WState.of(layout, [[encode_sequence(k[layer, :n], v[layer, :n])] for layer in range(layout.num_layers)])


def redigest(value: bytearray) -> bytes:
    """``value`` (no HMAC) with its digest recomputed: damage the checksum cannot see, for the value checks."""
    end = len(value) - 16
    value[end:] = xxhash.xxh3_128_digest(bytes(value[:end]))
    return bytes(value)


def test_golden_pages_decode_to_the_stored_form_and_encode_to_the_same_bytes():
    expected = np.load(GOLDEN / "q4w_pages_expected.npz", allow_pickle=False)
    k, v = expected["k_input"], expected["v_input"]
    p0, p1, end = ((GOLDEN / name).read_bytes() for name in ("q4w_page0.block", "q4w_page1_hmac.block",
                                                             "q4w_page2_end.block"))  # fmt: skip
    assert p0[:8] == b"I8KVQ4W\x00" and struct.unpack_from("<HHH", p0, 8)[:2] == (1, 1)
    assert (p0[17], p1[17], end[17]) == (SEALED, SEALED, END) and (p0[18], p1[18], end[18]) == (0, 1, 0)
    assert struct.unpack_from("<IIIII", end, 20) == (2, 0, 2, 8, 2)  # layers, head range, head_dim, page index
    a0 = decode_page(SPEC, p0, KEYS[0], SEALED, 0)
    a1 = decode_page(SPEC, p1, KEYS[1], SEALED, 1, SECRET)
    a2 = decode_page(SPEC, end, end_key(KEYS[2]), END, 2)
    assert assemble_run(SPEC, [a0, a1], a2).equal(expected_state(SPEC.layout, k, v, 192))
    assert encode_page(SPEC, KEYS[0], SEALED, 0, a0) == p0
    assert encode_page(SPEC, KEYS[1], SEALED, 1, a1, SECRET) == p1
    assert encode_page(SPEC, end_key(KEYS[2]), END, 2, a2) == end
    assert len(p0) == SPEC.value_bytes(SEALED, 0) and len(p1) == SPEC.value_bytes(SEALED, 1, authenticated=True)
    with pytest.raises(UnauthenticatedBlock):
        decode_page(SPEC, p1, KEYS[1], SEALED, 1)
    with pytest.raises(UnauthenticatedBlock):
        decode_page(SPEC, p0, KEYS[0], SEALED, 0, SECRET)


@pytest.mark.parametrize(("layers", "heads", "dim", "pages"), [(1, 3, 6, 1), (2, 1, 10, 2), (3, 2, 4, 3)])
def test_fresh_runs_assemble_to_the_stored_form_of_their_length(layers, heads, dim, pages):
    rng = np.random.default_rng(layers * 100 + heads * 10 + dim)
    n = 64 * pages
    k = (rng.standard_normal((layers, n, heads, dim)) * rng.choice([1e-3, 1.0, 50.0], (1, n, 1, 1))).astype(np.float32)
    v = rng.standard_normal((layers, n, heads, dim)).astype(np.float32)
    spec = PageSpec(KvLayout(layers, heads, dim, Q4W), "fresh")
    arrays = page_arrays(k, v, pages)
    keys = [rng.bytes(32) for _ in range(pages)]
    kinds = [SEALED] * (pages - 1) + [END]
    values = [encode_page(spec, end_key(key) if kind == END else key, kind, i, a)
              for i, (key, kind, a) in enumerate(zip(keys, kinds, arrays, strict=True))]  # fmt: skip
    for i, value in enumerate(values):
        assert len(value) == spec.value_bytes(kinds[i], i)
    decoded = [decode_page(spec, value, end_key(key) if kind == END else key, kind, i)
               for i, (key, kind, value) in enumerate(zip(keys, kinds, values, strict=True))]  # fmt: skip
    state = assemble_run(spec, decoded[:-1], decoded[-1])
    assert state.length == n and state.equal(expected_state(spec.layout, k, v, n))
    # The wire cost of a run: the sealed pages at the format's own size (page 0 with 4 sink rows), one page of F16
    # rows at its end.
    per_page = layers * heads * INT4_SINK_WINDOW_V1.bytes_per_page(dim)
    sinks = layers * heads * 2 * 4 * dim * 2 if pages > 1 else 0
    assert sum(spec.payload_bytes(SEALED, i) for i in range(pages - 1)) == (pages - 1) * per_page + sinks
    assert spec.payload_bytes(END, pages - 1) == layers * heads * 2 * 64 * dim * 2


def test_damaged_and_foreign_values_are_refused_by_type():
    p0 = (GOLDEN / "q4w_page0.block").read_bytes()
    end = (GOLDEN / "q4w_page2_end.block").read_bytes()
    rng = np.random.default_rng(5)
    for value, key, kind, index in ((p0, KEYS[0], SEALED, 0), (end, end_key(KEYS[2]), END, 2)):
        for bit in rng.choice(len(value) * 8, 64, replace=False):  # any flipped bit: header, payload or digest
            bad = bytearray(value)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(BlockValueError):
                decode_page(SPEC, bytes(bad), key, kind, index)
        for cut in (0, 10, 47, 64, len(value) - 17, len(value) - 1):
            with pytest.raises(CorruptBlock):
                decode_page(SPEC, value[:cut], key, kind, index)
        with pytest.raises(CorruptBlock):
            decode_page(SPEC, value + b"\x00", key, kind, index)
    with pytest.raises(MisplacedBlock):
        decode_page(SPEC, p0, KEYS[1], SEALED, 0)  # a value copied under another key
    for spec, kind, index in ((PageSpec(SPEC.layout, "another-model"), SEALED, 0),
                              (PageSpec(KvLayout(2, 2, 6, Q4W), FINGERPRINT), SEALED, 0),
                              (PageSpec(SPEC.layout, FINGERPRINT, head_start=2), SEALED, 0),
                              (SPEC, END, 0), (SPEC, SEALED, 1)):  # fmt: skip
        with pytest.raises(IncompatibleBlock):
            decode_page(spec, p0, KEYS[0], kind, index)
    newer = bytearray(p0)
    newer[8] = 2
    with pytest.raises(NewerBlock):
        decode_page(SPEC, redigest(newer), KEYS[0], SEALED, 0)
    block_value = (GOLDEN / "v1_int8.block").read_bytes()
    with pytest.raises(CorruptBlock, match="magic"):
        decode_page(SPEC, block_value, KEYS[0], SEALED, 0)
    huge = bytearray(p0)
    struct.pack_into("<Q", huge, 40, 1 << 60)  # a claimed payload: refused by size, nothing allocated
    with pytest.raises(CorruptBlock, match="announces"):
        decode_page(SPEC, redigest(huge), KEYS[0], SEALED, 0)


def test_values_outside_the_format_are_refused_even_with_a_valid_digest():
    p0 = (GOLDEN / "q4w_page0.block").read_bytes()
    end = (GOLDEN / "q4w_page2_end.block").read_bytes()
    h0 = SPEC.header_len()
    a0 = decode_page(SPEC, p0, KEYS[0], SEALED, 0)
    offsets, at = {}, h0
    for name, dt, shape in SPEC.arrays(SEALED, 0):
        offsets[name] = at
        at += dt.itemsize * int(np.prod(shape))
    cases = {
        "k_scale NaN": ("k_scale", np.float16(np.nan).tobytes()),
        "v_scale -0": ("v_scale", np.float16(-0.0).tobytes()),
        "v_scale negative": ("v_scale", np.float16(-1.0).tobytes()),
        "k_min inf": ("k_min", np.float16(np.inf).tobytes()),
        "sink code": ("k_codes", b"\x01"),  # page 0 stores nothing at a sink position
        "sink v_scale": ("v_scale", np.float16(1.0).tobytes()),
        "k_sink NaN": ("k_sink", np.float16(np.nan).tobytes()),
    }
    for what, (name, raw) in cases.items():
        bad = bytearray(p0)
        bad[offsets[name] : offsets[name] + len(raw)] = raw
        with pytest.raises(InvalidBlockValues):
            decode_page(SPEC, redigest(bad), KEYS[0], SEALED, 0)
        if what != "sink code":
            arrays = {n: a.copy() for n, a in a0.items()}
            arrays[name].reshape(-1).view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)
            with pytest.raises(BlockEncodeError):  # the writer never stores what its readers delete
                encode_page(SPEC, KEYS[0], SEALED, 0, arrays)
    bad = bytearray(end)
    bad[h0 + 100 : h0 + 102] = np.float16(np.inf).tobytes()
    with pytest.raises(InvalidBlockValues, match="finite"):
        decode_page(SPEC, redigest(bad), end_key(KEYS[2]), END, 2)
    with pytest.raises(BlockEncodeError):
        encode_page(SPEC, KEYS[0], SEALED, 0, {n: a for n, a in a0.items() if n != "k_sink"})
    with pytest.raises(BlockEncodeError):
        encode_page(SPEC, KEYS[0], 3, 0, a0)
