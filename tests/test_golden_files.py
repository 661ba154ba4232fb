"""V1 files and block values written before the storage format became an object load unchanged.

The fixtures in tests/golden/ (v1_{f16,int8}.kv, v1_{f16,int8}.block) were written by make_v1_files.py with
the code of the day they were committed; v1_files_expected.npz holds their inputs and stored tensors.
"""

import pathlib

import numpy as np
import pytest
import torch

from int8kv import KvStorageFormat
from int8kv.blockstore.codec import BlockSpec, decode_block, encode_block
from int8kv.cache.contiguous import QuantizedKvCache
from int8kv.cache.state import KvLayout
from int8kv.store import load_kv

GOLDEN = pathlib.Path(__file__).with_name("golden")
EXPECTED = dict(np.load(GOLDEN / "v1_files_expected.npz", allow_pickle=False))
LAYERS, HEADS, DIM, TOKENS, BLOCK = 2, 3, 5, 7, 8
KEY, FINGERPRINT = b"golden-v1-block-key", "golden-tiny-model"
FORMATS = {"f16": KvStorageFormat.F16, "int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1}
NAMES = {"f16": ("k_codes", "v_codes"), "int8": ("k_codes", "v_codes", "k_scales", "v_scales")}


def stacked(state, name: str) -> np.ndarray:
    return torch.stack([t[0] for t in getattr(state, name)]).numpy()


def check_state(state, short: str) -> None:
    assert state.layout == KvLayout(LAYERS, HEADS, DIM, FORMATS[short])
    assert (state.batch, state.length) == (1, TOKENS)
    for name in NAMES[short]:
        got, want = stacked(state, name), EXPECTED[f"{short}_{name}"]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name  # bit for bit (NaN-safe, -0.0-safe)
    if short == "f16":
        assert state.k_scales is None and state.v_scales is None


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_saved_v1_file_loads_unchanged(short):
    loaded = load_kv(GOLDEN / f"v1_{short}.kv")
    assert loaded.format is FORMATS[short]
    assert loaded.token_ids.tolist() == [list(range(100, 100 + TOKENS))]
    assert loaded.metadata == {"fixture": short}
    check_state(loaded.cache.export_state(), short)


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_v1_block_value_decodes_unchanged_and_encodes_to_the_same_bytes(short):
    value = (GOLDEN / f"v1_{short}.block").read_bytes()
    spec = BlockSpec(KvLayout(LAYERS, HEADS, DIM, FORMATS[short]), BLOCK, FINGERPRINT)
    state = decode_block(spec, value, KEY, tokens=TOKENS)
    check_state(state, short)
    assert encode_block(spec, state, KEY) == value


@pytest.mark.parametrize("short", sorted(FORMATS))
def test_todays_encoder_writes_the_stored_tensors(short):
    cache = QuantizedKvCache(LAYERS, BLOCK, HEADS, DIM, FORMATS[short])
    k, v = torch.from_numpy(EXPECTED["k_input"]), torch.from_numpy(EXPECTED["v_input"])
    for t in range(TOKENS):
        cache.push_step(list(k[:, t]), list(v[:, t]))
    check_state(cache.export_state(), short)
