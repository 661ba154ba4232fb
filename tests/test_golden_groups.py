"""KV files of version 2 and block values of version 3 (states of several K/V shapes) load unchanged.

The fixtures in tests/golden/ (groups_{f16,int8}.kv, groups_int8_mapped.kv, groups_{f16,int8}.block) were written
by make_groups_files.py with the code of the day they were committed; groups_expected.npz holds their inputs and
stored tensors.
"""

import json
import pathlib
import struct

import numpy as np
import pytest
import torch

from int8kv import KvStorageFormat
from int8kv.blockstore.codec import BlockSpec, decode_block, encode_block
from int8kv.cache.paged import PagedKvCache
from int8kv.cache.state import KvLayout
from int8kv.store import inspect_kv, load_kv

GOLDEN = pathlib.Path(__file__).with_name("golden")
EXPECTED = dict(np.load(GOLDEN / "groups_expected.npz", allow_pickle=False))
DIMS = [(2, 3, 5), (1, 2, 6)]
TOKENS, BLOCK = 7, 8
KEY, FINGERPRINT = b"golden-groups-block-key", "golden-tiny-gemma4"
FORMATS = {"f16": KvStorageFormat.F16, "int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1}


def layouts(short):
    return [KvLayout(*d, FORMATS[short]) for d in DIMS]


def check_state(state, short: str) -> None:
    assert list(state.layouts) == layouts(short) and (state.batch, state.length) == (1, TOKENS)
    for g, section in enumerate(state.sections):
        assert sorted(section.groups) == sorted(FORMATS[short].spec.tensor_names())
        for name, group in section.groups.items():
            got, want = torch.stack([t[0] for t in group]).numpy(), EXPECTED[f"{short}_{name}_{g}"]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), (g, name)  # bit for bit


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_saved_version_2_file_loads_unchanged(short):
    cache = PagedKvCache.with_groups(2, BLOCK, layouts(short))
    loaded = load_kv(GOLDEN / f"groups_{short}.kv", cache, seq_id=0)
    assert loaded.token_ids.tolist() == [list(range(200, 200 + TOKENS))] and loaded.metadata == {"fixture": short}
    check_state(cache.export_state(0), short)


def test_the_layer_map_of_a_version_2_file_reads_unchanged():
    groups = inspect_kv(GOLDEN / "groups_int8_mapped.kv")["groups"]
    assert [g["layers"] for g in groups] == [[0, 2], [1]]
    cache = PagedKvCache.with_groups(2, BLOCK, layouts("int8"))
    load_kv(GOLDEN / "groups_int8_mapped.kv", cache, seq_id=0)
    check_state(cache.export_state(0), "int8")


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_version_3_block_value_decodes_unchanged_and_encodes_to_the_same_bytes(short):
    value = (GOLDEN / f"groups_{short}.block").read_bytes()
    # The documented layout, read independently of the codec: version 3, two groups, their table after 56 bytes.
    version, count = struct.unpack_from("<H", value, 8)[0], struct.unpack_from("<I", value, 16)[0]
    table = [struct.unpack_from("<IIII", value, 56 + 16 * i) for i in range(count)]
    assert (version, count, table) == (3, 2, [(L, 0, H, D) for L, H, D in DIMS])
    spec = BlockSpec(layouts(short), BLOCK, FINGERPRINT)
    state = decode_block(spec, value, KEY, tokens=TOKENS)
    check_state(state, short)
    assert encode_block(spec, state, KEY) == value


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_todays_encoder_writes_the_stored_tensors(short):
    fmt = FORMATS[short]
    for g, (layers, _, _) in enumerate(DIMS):
        for layer in range(layers):
            for side in "kv":
                parts = fmt.spec.encode(torch.from_numpy(EXPECTED[f"{side}{g}_input"][layer]))
                for name, part in zip(fmt.spec.part_names, parts, strict=True):
                    want = EXPECTED[f"{short}_{side}_{name}_{g}"][layer]
                    assert part.numpy().tobytes() == want.tobytes()


def test_fixture_headers_are_what_the_spec_says():
    raw = (GOLDEN / "groups_int8.kv").read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    assert meta["format_version"] == "2" and json.loads(meta["groups"])[1] == {
        "head_dim": 6, "layers": None, "num_kv_heads": 2, "num_layers": 1
    }  # fmt: skip
