"""Values and sizes a KV file may hold: forged values with valid digests, sparse files, metadata bounds.

Each test here failed on the single-module store.py it replaced (issue 10): a scale of 3e38 with both digests
recomputed loaded and inspected as "(verified)", inspecting a sparse file allocated what its header declared,
and 5000-deep metadata raised RecursionError.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from store_helpers import (
    DIM,
    F16,
    HEADS,
    INT8,
    LAYERS,
    filled_cache,
    forge,
    read_raw,
    refuses,
    tensor_slice,
    write_raw,
)

from int8kv.cache.paged import PagedKvCache
from int8kv.cli import main
from int8kv.formats import Int8V1Format
from int8kv.store import (
    MAX_METADATA_DEPTH,
    ChecksumMismatch,
    CorruptKvFile,
    SaveError,
    inspect_kv,
    load_kv,
    save_kv,
)

SCALE_MAX = Int8V1Format.SCALE_MAX


def _f32_after(x: float) -> float:
    """The next float32 above x."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(float("inf"))))


def _poke(src: Path, dst: Path, name: str, value: bytes, at: int = 0) -> Path:
    def data_fn(header: dict, data: bytearray) -> bytearray:
        tensor_slice(header, name, data)[at : at + len(value)] = value
        return data

    return forge(src, dst, data_fn=data_fn)  # both digests recomputed


@pytest.mark.parametrize(
    ("fmt", "name", "value"),
    [
        (INT8, "k_scales", struct.pack("<f", 3e38)),
        (INT8, "v_scales", struct.pack("<f", _f32_after(SCALE_MAX))),
        (INT8, "k_scales", struct.pack("<f", float("inf"))),
        (INT8, "v_scales", struct.pack("<f", -1.0)),
        (INT8, "v_codes", struct.pack("<b", -128)),
        (F16, "k_codes", struct.pack("<e", float("nan"))),
        (F16, "k_codes", struct.pack("<e", float("-inf"))),
    ],
)
def test_forged_values_with_valid_digests_are_refused_by_load_and_inspect(tmp_path, capsys, fmt, name, value):
    src = tmp_path / "src.kv"
    save_kv(src, filled_cache(fmt), token_ids=list(range(20)))
    # Far into the tensor, so a check of the first chunk or element only would miss it.
    begin, end = read_raw(src)[0][name]["data_offsets"]
    at = (end - begin) // 2 // len(value) * len(value)
    bad = _poke(src, tmp_path / "bad.kv", name, value, at)
    refuses(bad, filled_cache(fmt, tokens=5, seed=2), CorruptKvFile)
    with pytest.raises(CorruptKvFile, match=name):
        inspect_kv(bad)
    assert main(["cache", "inspect", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert "verified" not in out and name in err


def test_the_largest_scale_the_codec_writes_loads(tmp_path) -> None:
    # A row whose max |x| is float16's max gets the largest scale, which the reader must accept.
    _, scale = INT8.spec.encode(torch.full((1, 1, DIM), 65504.0))
    assert float(scale.flatten()[0]) == SCALE_MAX
    src = tmp_path / "src.kv"
    save_kv(src, filled_cache(INT8))
    edge = _poke(src, tmp_path / "edge.kv", "k_scales", struct.pack("<f", SCALE_MAX), 4)
    loaded = load_kv(edge)
    assert float(loaded.cache.layers[0].k_scales[0, 1]) == SCALE_MAX
    assert inspect_kv(edge)["seq_len"] == 20


def test_save_refuses_values_the_reader_would_refuse(tmp_path) -> None:
    # A paged cache stores pre-encoded rows as given; a code of -128 must not reach a file.
    cache = PagedKvCache(4, 4, LAYERS, HEADS, DIM, INT8)
    slots = cache.add_sequence("s", 3)
    for layer in range(LAYERS):
        codes = torch.zeros(3, HEADS, DIM, dtype=torch.int8)
        codes[1, 1, 2] = -128 if layer == 2 else 0
        scales = torch.ones(3, HEADS)
        cache.write_rows(layer, slots, (codes, scales), (codes.clone(), scales.clone()))
    with pytest.raises(SaveError, match="-128"):
        save_kv(tmp_path / "x.kv", cache, seq_id="s")
    assert list(tmp_path.iterdir()) == []


def _sparse(src: Path, dst: Path, tokens: int) -> int:
    """A file whose valid header (digest recomputed) declares `tokens` tokens, with the data section extended
    to the declared size as a hole: a few KiB on disk. Returns the declared data bytes."""
    header, data = read_raw(src)
    del header["token_ids"]  # inspect keeps only token ids: without them nothing needs to be kept
    header["__metadata__"]["seq_len"] = str(tokens)
    offset = 0
    for name in ("k_scales", "v_scales", "k_codes", "v_codes"):
        header[name]["shape"][2] = tokens
        size = 4 if name.endswith("scales") else 1
        for d in header[name]["shape"]:
            size *= d
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    written = bytes(data[:4096])
    write_raw(dst, header, written)  # data_sha256 covers these bytes only: the full data mismatches
    with open(dst, "r+b") as f:
        f.truncate(dst.stat().st_size - len(written) + offset)
    return offset


def test_inspecting_a_sparse_file_uses_bounded_memory(tmp_path) -> None:
    src = tmp_path / "src.kv"
    save_kv(src, filled_cache(INT8), token_ids=list(range(20)))
    declared = _sparse(src, tmp_path / "sparse.kv", tokens=1 << 20)
    assert declared > 100 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ChecksumMismatch):
            inspect_kv(tmp_path / "sparse.kv")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"inspect allocated {peak} bytes for a {declared}-byte data section"
    with pytest.raises(ChecksumMismatch):  # a load allocates the data only after matching it to the file's size
        load_kv(tmp_path / "sparse.kv")


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_metadata_depth_is_bounded(tmp_path) -> None:
    path = tmp_path / "m.kv"
    # The mapping is level 1, so a list of depth MAX - 1 under a key is exactly at the bound.
    at_bound = {"m": _nested(MAX_METADATA_DEPTH - 1)}
    save_kv(path, filled_cache(INT8), metadata=at_bound)
    assert load_kv(path).metadata == at_bound
    before = path.read_bytes()
    cyclic: list = []
    cyclic.append(cyclic)
    for bad in ({"m": _nested(MAX_METADATA_DEPTH)}, {"m": _nested(5000)}, {"m": cyclic}, {"m": {1: 2}}, ["x"]):
        with pytest.raises(SaveError):
            save_kv(path, filled_cache(F16), metadata=bad)  # type: ignore[arg-type]
        with pytest.raises(SaveError):
            save_kv(tmp_path / "new.kv", filled_cache(F16), metadata=bad)  # type: ignore[arg-type]
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.kv"]

    # A reader refuses what the writer cannot produce, digests recomputed.
    deep = forge(
        path,
        tmp_path / "deep.kv",
        lambda h: h["__metadata__"].__setitem__("metadata", json.dumps({"m": _nested(MAX_METADATA_DEPTH)})),
    )
    with pytest.raises(CorruptKvFile, match="nested deeper"):
        inspect_kv(deep)
    refuses(deep, filled_cache(INT8, tokens=5), CorruptKvFile)
