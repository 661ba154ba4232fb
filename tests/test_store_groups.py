"""States of several K/V shapes (Gemma 4: a larger head_dim on the full-attention layers): KV files of version 2
and block values of version 3, round trips bit exact per group, and every malformed field refused before
anything changes (docs/kv_file_format.md, docs/block_store.md)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from blockstore_helpers import reframe
from store_helpers import F16, INT8, canon, forge, read_raw

from int8kv import KvCacheError, KvPoolExhausted
from int8kv.blockstore import BlockSpec, decode_block, encode_block
from int8kv.blockstore.codec import assemble_blocks, read_header, verify_block
from int8kv.blockstore.errors import (
    BlockEncodeError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockValues,
    NewerBlock,
)
from int8kv.cache.paged import PagedKvCache
from int8kv.cache.state import GroupedKvState, KvLayout
from int8kv.store import (
    CorruptKvFile,
    HeaderShapeMismatch,
    IncompatibleCache,
    ModelFingerprint,
    ModelMismatch,
    inspect_kv,
    load_kv,
    save_kv,
)
from int8kv.store import format_inspect as format_report

# Ragged on purpose: three groups of different layer counts, heads and head_dims (one odd).
DIMS = [(2, 2, 16), (1, 1, 5), (3, 3, 8)]
TOKENS, BLOCK = 11, 4


def layouts(fmt):
    return [KvLayout(*d, fmt) for d in DIMS]


def filled(fmt, tokens: int = TOKENS, seed: int = 0, num_blocks: int = 8) -> PagedKvCache:
    """A grouped paged cache holding sequence 0: random K/V through the real encoder, in scattered blocks."""
    cache = PagedKvCache.with_groups(num_blocks, BLOCK, layouts(fmt))
    cache.add_sequence("pad", 3)  # sequence 0's blocks are not the first ones
    cache.add_sequence(0, tokens)
    cache.free("pad")
    slots = cache.slots(0)
    gen = torch.Generator().manual_seed(seed)
    for pool in cache.pools:
        for layer in range(pool.layout.num_layers):
            k, v = (torch.randn(tokens, pool.num_kv_heads, pool.head_dim, generator=gen) * 3 for _ in range(2))
            pool.write_rows(layer, slots, *(fmt.spec.encode(x) for x in (k, v)))
    return cache


@pytest.fixture(params=[INT8, F16], ids=str)
def fmt(request):
    return request.param


@pytest.fixture
def grouped_file(tmp_path, fmt) -> Path:
    path = tmp_path / "groups.kv"
    save_kv(path, filled(fmt), seq_id=0, token_ids=list(range(TOKENS)), metadata={"m": 1})
    return path


# ---------------------------------------------------------------------------------------------------------
# KV files, version 2
# ---------------------------------------------------------------------------------------------------------
def test_paged_file_round_trip_is_bit_exact_per_group(tmp_path, fmt, grouped_file):
    source = filled(fmt)
    state = source.export_state(0)
    target = PagedKvCache.with_groups(8, BLOCK, layouts(fmt))
    loaded = load_kv(grouped_file, target, seq_id="x")
    assert loaded.seq_len == TOKENS and loaded.token_ids.tolist() == [list(range(TOKENS))]
    assert target.export_state("x").equal(state)
    header, _ = read_raw(grouped_file)
    meta = header["__metadata__"]
    assert meta["format_version"] == "2" and "num_layers" not in meta
    assert json.loads(meta["groups"]) == [
        {"num_layers": L, "num_kv_heads": H, "head_dim": D, "layers": None} for L, H, D in DIMS
    ]
    names = sorted(n for n in header if n.startswith(("k_", "v_")))
    assert names == sorted(f"{t}.{g}" for t in fmt.spec.tensor_names() for g in range(3))
    info = inspect_kv(grouped_file)
    assert info["format_version"] == 2 and info["num_layers"] == 6 and info["head_dim"] is None
    assert [(g["num_layers"], g["num_kv_heads"], g["head_dim"]) for g in info["groups"]] == DIMS
    assert info["kv_bytes"] == TOKENS * sum(la.bytes_per_token for la in layouts(fmt))
    assert "(group 2)" in format_report(info)
    # Each group's tensor in the file is that pool's rows in position order (a generic safetensors reader).
    from safetensors.torch import load_file

    tensors = load_file(grouped_file)
    for g, (section, pool) in enumerate(zip(state.sections, source.pools, strict=True)):
        for name in fmt.spec.tensor_names():
            assert torch.equal(tensors[f"{name}.{g}"][:, 0], torch.stack([t[0] for t in section.groups[name]]))
        k_parts, _ = pool.export_rows(0, source.slots(0))
        assert torch.equal(tensors[f"k_codes.{g}"][0, 0], k_parts[fmt.spec.part_names.index("codes")])


def test_single_shape_files_stay_version_1(tmp_path):
    cache = PagedKvCache(4, BLOCK, 2, 2, 8)
    cache.add_sequence(0, 3)
    save_kv(tmp_path / "one.kv", cache, seq_id=0)
    meta = read_raw(tmp_path / "one.kv")[0]["__metadata__"]
    assert meta["format_version"] == "1" and "groups" not in meta and meta["head_dim"] == "8"
    assert inspect_kv(tmp_path / "one.kv")["groups"] == [
        {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "layers": None}
    ]


def test_grouped_files_into_the_wrong_cache_are_refused_unchanged(fmt, grouped_file):
    from int8kv.cache.contiguous import QuantizedKvCache

    with pytest.raises(IncompatibleCache, match="QuantizedKvCache holds one"):
        load_kv(grouped_file)
    with pytest.raises(IncompatibleCache, match="QuantizedKvCache holds one"):
        load_kv(grouped_file, QuantizedKvCache(2, 16, 2, 16, fmt))
    other = [KvLayout(*d, fmt) for d in DIMS[:2]]
    for target in (
        PagedKvCache(8, BLOCK, 6, 2, 16, fmt),
        PagedKvCache.with_groups(8, BLOCK, other),
        PagedKvCache.with_groups(8, BLOCK, list(reversed(layouts(fmt)))),
    ):
        with pytest.raises(IncompatibleCache, match="each group of K/V shapes"):
            load_kv(grouped_file, target, seq_id=1)
        assert target.num_free_blocks == target.num_blocks
    small = PagedKvCache.with_groups(2, BLOCK, layouts(fmt))
    with pytest.raises(KvPoolExhausted):
        load_kv(grouped_file, small, seq_id=1)
    assert small.num_free_blocks == 2 and 1 not in small.allocator


def _fingerprint(num_layers=6, kv_heads=3, head_dim=8) -> ModelFingerprint:
    return ModelFingerprint(None, "toy", num_layers, 4, kv_heads, head_dim, 32, 97, None, "0" * 64, None)


def test_a_grouped_file_records_a_model_of_its_layers_and_one_of_its_shapes(tmp_path, fmt):
    cache = filled(fmt)
    save_kv(tmp_path / "m.kv", cache, seq_id=0, model=_fingerprint())
    assert load_kv(tmp_path / "m.kv", PagedKvCache.with_groups(8, BLOCK, layouts(fmt)), seq_id=0,
                   model=_fingerprint()).seq_len == TOKENS  # fmt: skip
    for bad in (_fingerprint(num_layers=5), _fingerprint(head_dim=32)):
        with pytest.raises(ModelMismatch, match="one shape of"):
            save_kv(tmp_path / "bad.kv", cache, seq_id=0, model=bad)
    assert not (tmp_path / "bad.kv").exists()


def _set_groups(value):
    def edit(h):
        h["__metadata__"]["groups"] = value if isinstance(value, str) else canon(value).decode()

    return edit


def _groups(**change):
    out = [{"num_layers": L, "num_kv_heads": H, "head_dim": D, "layers": None} for L, H, D in DIMS]
    for key, value in change.items():
        out[0][key] = value
    return out


GROUP_FORGERIES = {
    "not JSON": ("[{", CorruptKvFile, "not valid JSON"),
    "an object": ({"a": 1}, CorruptKvFile, "2..64 groups"),
    "one group": (_groups()[:1], CorruptKvFile, "2..64 groups"),
    "65 groups": (_groups() * 22, CorruptKvFile, "2..64 groups"),
    "a missing field": ([{"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}, *_groups()[1:]], CorruptKvFile,
                        "exactly the fields"),
    "an extra field": (_groups(extra=1), CorruptKvFile, "exactly the fields"),
    "a bool size": (_groups(num_kv_heads=True), CorruptKvFile, "sizes > 0"),
    "a zero size": (_groups(head_dim=0), CorruptKvFile, "sizes > 0"),
    "a float size": (_groups(num_layers=2.0), CorruptKvFile, "sizes > 0"),
    "a size past 2^40": (_groups(num_layers=2**40), CorruptKvFile, "sizes > 0"),
    "two equal shapes": (_groups(num_kv_heads=3, head_dim=8), HeaderShapeMismatch, "shape"),
    "a half layer map": (_groups(layers=[0, 1]), CorruptKvFile, "all lists of ints or all null"),
    "not canonical": (canon(_groups()).decode().replace(":", ": "), CorruptKvFile, "canonical"),
    "more layers": (_groups(num_layers=3), HeaderShapeMismatch, "shape"),
    "more heads": (_groups(num_kv_heads=1, head_dim=5), HeaderShapeMismatch, "shape"),
    "a wider head": (_groups(head_dim=32), HeaderShapeMismatch, "shape"),
}


@pytest.mark.parametrize("case", list(GROUP_FORGERIES))
def test_forged_groups_are_refused_before_the_cache_changes(tmp_path, fmt, grouped_file, case):
    value, error, match = GROUP_FORGERIES[case]
    bad = forge(grouped_file, tmp_path / "bad.kv", _set_groups(value))
    target = PagedKvCache.with_groups(8, BLOCK, layouts(fmt))
    with pytest.raises(error, match=match) as info:
        load_kv(bad, target, seq_id=0)
    assert isinstance(info.value, KvCacheError)
    assert target.num_free_blocks == target.num_blocks and 0 not in target.allocator
    with pytest.raises(error):
        inspect_kv(bad)


def _layer_maps(maps):
    return _set_groups([{**g, "layers": m} for g, m in zip(_groups(), maps, strict=True)])


@pytest.mark.parametrize(
    "maps",
    [
        [[0, 1], [2], [3, 4, 6]],  # layer 5 missing
        [[0, 1], [2], [3, 4, 4]],  # a layer twice
        [[1, 0], [2], [3, 4, 5]],  # descending
        [[2, 3], [0], [1, 4, 5]],  # groups not in order of first use
        [[0, 1], [2], [3, 4, True]],  # a bool
        [[0, 1], [2], [3, 4]],  # too short for the group
    ],
)
def test_forged_layer_maps_are_refused(tmp_path, grouped_file, maps):
    with pytest.raises(CorruptKvFile, match="layer"):
        inspect_kv(forge(grouped_file, tmp_path / "bad.kv", _layer_maps(maps)))


def test_a_valid_layer_map_is_kept_and_one_shape_fields_in_version_2_are_refused(tmp_path, fmt, grouped_file):
    mapped = forge(grouped_file, tmp_path / "mapped.kv", _layer_maps([[0, 2], [1], [3, 4, 5]]))
    assert inspect_kv(mapped)["groups"][0]["layers"] == [0, 2]
    target = PagedKvCache.with_groups(8, BLOCK, layouts(fmt))
    load_kv(mapped, target, seq_id=0)  # a paged cache places sections by group
    assert target.export_state(0).equal(filled(fmt).export_state(0))

    def add_dims(h):
        h["__metadata__"]["num_layers"] = "6"

    def drop_groups(h):
        del h["__metadata__"]["groups"]

    def rename_tensor(h):
        h["k_codes.3"] = h.pop("k_codes.2")

    def widen_tensor(h):
        h["v_codes.1"]["shape"][3] = 2

    for edit, error in ((add_dims, CorruptKvFile), (drop_groups, CorruptKvFile), (rename_tensor, HeaderShapeMismatch),
                        (widen_tensor, HeaderShapeMismatch)):  # fmt: skip
        with pytest.raises(error):
            load_kv(forge(grouped_file, tmp_path / "bad.kv", edit), target, seq_id=1)
    assert 1 not in target.allocator


def test_values_no_writer_produces_are_refused_in_any_group(tmp_path, grouped_file):
    header, _ = read_raw(grouped_file)
    name = "v_scales.1" if "v_scales.1" in header else "v_codes.1"

    def poison(h, data):
        begin, _ = h[name]["data_offsets"]
        if name == "v_scales.1":
            data[begin : begin + 4] = struct.pack("<f", float("inf"))
        else:
            data[begin : begin + 2] = struct.pack("<e", float("nan"))
        return data

    with pytest.raises(CorruptKvFile):
        inspect_kv(forge(grouped_file, tmp_path / "bad.kv", data_fn=poison))


# ---------------------------------------------------------------------------------------------------------
# Block values, version 3
# ---------------------------------------------------------------------------------------------------------
KEY = b"k" * 32


def grouped_blocks(fmt, n: int = 2):
    cache = filled(fmt, tokens=n * BLOCK, num_blocks=n + 2)
    spec = BlockSpec(cache.layouts, BLOCK, "toy-model")
    state = cache.export_state(0)
    keys = [bytes([i]) * 32 for i in range(n)]
    values = [encode_block(spec, state.slice(i * BLOCK, (i + 1) * BLOCK), keys[i]) for i in range(n)]
    return spec, state, keys, values


def test_block_values_round_trip_bit_exact_per_group(fmt):
    spec, state, keys, values = grouped_blocks(fmt)
    header = verify_block(spec, values[0], keys[0])
    assert (header.version, header.num_layers) == (3, 6)
    assert header.groups == tuple((L, 0, H, D) for L, H, D in DIMS)
    assert len(values[0]) == spec.value_bytes()
    assert decode_block(spec, values[1], keys[1]).equal(state.slice(BLOCK, 2 * BLOCK))
    whole = assemble_blocks(spec, values)
    assert isinstance(whole, GroupedKvState) and whole.equal(state)
    # A partial block, and BlockSpec from a one-layout list is the plain spec (version 2).
    part = decode_block(spec, encode_block(spec, state.slice(0, 3), KEY), KEY, tokens=3)
    assert part.equal(state.slice(0, 3))
    one = BlockSpec([layouts(fmt)[0]], BLOCK, "toy-model")
    assert one == BlockSpec(layouts(fmt)[0], BLOCK, "toy-model") and one.version == 2


def test_block_specs_of_several_shapes_refuse_what_is_not_implemented(fmt):
    with pytest.raises(BlockEncodeError, match="head_start > 0"):
        BlockSpec(layouts(fmt), BLOCK, "m", head_start=1)
    with pytest.raises(BlockEncodeError, match="share one format"):
        BlockSpec([KvLayout(1, 2, 8, INT8), KvLayout(1, 2, 16, F16)], BLOCK, "m")
    # Sections of one shape (a block table each: sliding and full layers) are a grouped spec like any other.
    assert BlockSpec([KvLayout(1, 2, 8, fmt), KvLayout(3, 2, 8, fmt)], BLOCK, "m").version == 3
    with pytest.raises(BlockEncodeError, match="at most 64"):
        BlockSpec([KvLayout(1, 1, d, fmt) for d in range(1, 66)], BLOCK, "m")
    with pytest.raises(BlockEncodeError, match="non-empty sequence"):
        BlockSpec([], BLOCK, "m")
    spec, state, _, _ = grouped_blocks(fmt, 1)
    with pytest.raises(BlockEncodeError, match="layout"):
        encode_block(spec, state.sections[0].slice(0, BLOCK), KEY)
    with pytest.raises(BlockEncodeError, match="layout"):
        encode_block(BlockSpec(layouts(fmt)[0], BLOCK, "m"), state.slice(0, BLOCK), KEY)


def _patch_group(i: int, field: int, value: int):
    def patch(buf, _header_len):
        struct.pack_into("<I", buf, 56 + 16 * i + 4 * field, value)

    return patch


def test_forged_version_3_framing_is_refused(fmt):
    spec, _, keys, values = grouped_blocks(fmt, 1)
    value, key = values[0], keys[0]
    cases = [
        (reframe(value, version=4), NewerBlock, "version 4"),
        (reframe(value, num_layers=1), CorruptBlock, "2..64 groups"),
        (reframe(value, num_layers=65), CorruptBlock, "2..64 groups"),
        (reframe(value, num_layers=2), CorruptBlock, "header length"),  # a table one group short
        (reframe(value, head_dim=8), CorruptBlock, "zero head fields"),
        (reframe(value, version=2), CorruptBlock, "header length"),  # read as one shape: no group table
        (reframe(value, payload_patch=_patch_group(1, 3, 6)), IncompatibleBlock, "per group"),  # head_dim 5 -> 6
        (reframe(value, payload_patch=_patch_group(2, 0, 4)), IncompatibleBlock, "per group"),  # layers 3 -> 4
        (reframe(value, payload_patch=_patch_group(0, 1, 1)), IncompatibleBlock, "per group"),  # head range start
        (reframe(value, payload_len=len(value)), CorruptBlock, "announces"),
        (value[:-1], CorruptBlock, "announces"),
    ]
    for forged, error, match in cases:
        with pytest.raises(error, match=match):
            verify_block(spec, forged, key)
    # A value of another group order or of one shape, genuine otherwise, is another layout.
    other = BlockSpec(list(reversed(layouts(fmt))), BLOCK, "toy-model")
    with pytest.raises(IncompatibleBlock):
        verify_block(other, value, key)
    with pytest.raises(IncompatibleBlock):
        verify_block(BlockSpec(layouts(fmt)[0], BLOCK, "toy-model"), value, key)
    plain = BlockSpec(layouts(fmt)[0], BLOCK, "toy-model")
    single = filled(fmt).export_state(0).sections[0].slice(0, BLOCK)
    with pytest.raises(IncompatibleBlock):
        verify_block(spec, encode_block(plain, single, key), key)


def test_block_values_no_writer_produces_are_refused_in_any_group(fmt):
    spec, _, keys, values = grouped_blocks(fmt, 1)
    header = read_header(values[0])
    # The last group's last value: the payload's last bytes (V codes of group 2).
    end = header.header_len + header.payload_len

    def poison(buf, _header_len):
        if fmt is INT8:
            buf[end - 1] = 0x80  # code -128
        else:
            buf[end - 2 : end] = struct.pack("<e", float("inf"))

    with pytest.raises(InvalidBlockValues):
        verify_block(spec, reframe(values[0], payload_patch=poison), keys[0])


# ---------------------------------------------------------------------------------------------------------
# Gemma 4 (tiny): the drop-in and the engine save and load one prefix
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [INT8, F16], ids=str)
def test_gemma4_prefix_saved_by_the_drop_in_loads_into_it_and_into_the_engine(tmp_path, fmt):
    hf = pytest.importorskip("int8kv.hf")
    from test_engine_models import build, engine, prompts

    from int8kv.store import model_fingerprint

    model = build("gemma4_text", seed=2)
    fp = model_fingerprint(model)
    prefix = torch.tensor([prompts(7, seed=3)[0]])  # within the sliding window (8): nothing trimmed
    ids = torch.cat([prefix, torch.tensor([prompts(3, seed=4)[0]])], dim=1)
    original = hf.Int8KvCache(model.config, fmt)
    with torch.no_grad():
        model(prefix, cache=original, use_cache=True)
    state = original.export_state()
    assert isinstance(state, GroupedKvState) and state.layers == ((0, 2), (1, 3))  # sliding, full
    assert [la.dims for la in state.layouts] == [(2, 2, 16), (2, 2, 32)]
    save_kv(tmp_path / "g.kv", original, model=fp, token_ids=prefix)
    assert inspect_kv(tmp_path / "g.kv")["groups"][1]["layers"] == [1, 3]

    restored = hf.Int8KvCache(model.config, fmt)
    load_kv(tmp_path / "g.kv", restored, model=fp)
    assert restored.export_state().equal(state)

    def greedy(cache):
        with torch.no_grad():
            return model.generate(ids, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)

    assert torch.equal(greedy(restored), greedy(original))
    # The engine's pools take the same file (a section per pool, in the same group order).
    llm = engine(model, fmt)
    load_kv(tmp_path / "g.kv", llm.cache, seq_id="saved", model=fp)
    paged = llm.cache.export_state("saved")
    assert all(a.equal(b) for a, b in zip(paged.sections, state.sections, strict=True))
    # A paged cache's state has no layer map: the drop-in, which places layers by model layer, refuses it by name.
    save_kv(tmp_path / "paged.kv", llm.cache, seq_id="saved", model=fp)
    fresh = hf.Int8KvCache(model.config, fmt)
    with pytest.raises(IncompatibleCache, match="does not record which model layers"):
        load_kv(tmp_path / "paged.kv", fresh, model=fp)
    assert fresh.get_seq_length() == 0
