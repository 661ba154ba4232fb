"""Writes the V1 file fixtures: a saved KV file and a block-store value, for F16 and for INT8.

Run once, with the code of the day the fixtures were committed; the files are committed and must never be
regenerated to make a failing test pass (a changed output means a format changed). The shape is tiny and
ragged on purpose (2 layers, 3 KV heads, head_dim 5, 7 tokens in a block of 8), the rows mix magnitudes, an
all-zero row and float16 subnormals. ``v1_files_expected.npz`` holds the inputs and the stored tensors the
files must give back (npz of plain arrays: no pickle).
"""

import pathlib

import numpy as np
import torch

from int8kv import KvStorageFormat
from int8kv.blockstore.codec import BlockSpec, encode_block
from int8kv.cache.contiguous import QuantizedKvCache
from int8kv.store import save_kv

HERE = pathlib.Path(__file__).parent
LAYERS, HEADS, DIM, TOKENS, BLOCK = 2, 3, 5, 7, 8
KEY = b"golden-v1-block-key"
FINGERPRINT = "golden-tiny-model"
FORMATS = {"f16": KvStorageFormat.F16, "int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(20261201)
    mags = torch.tensor([1e-3, 0.1, 1.0, 7.0, 300.0, 2e-6, 40.0])[:, None, None]
    k = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags
    v = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags
    k[0, 2, 1] = 0.0  # an all-zero row: scale 1
    v[1, 4, 0] = torch.tensor([6e-8, -3e-8, 1e-7, 0.0, 2e-6])  # float16 subnormals
    return k, v


def main() -> None:
    k, v = inputs()
    expected = {"k_input": k.numpy(), "v_input": v.numpy()}
    for short, fmt in FORMATS.items():
        cache = QuantizedKvCache(LAYERS, BLOCK, HEADS, DIM, fmt)
        for t in range(TOKENS):
            cache.push_step(list(k[:, t]), list(v[:, t]))
        state = cache.export_state()
        save_kv(HERE / f"v1_{short}.kv", cache, token_ids=list(range(100, 100 + TOKENS)), metadata={"fixture": short})
        spec = BlockSpec(state.layout, BLOCK, FINGERPRINT)
        (HERE / f"v1_{short}.block").write_bytes(encode_block(spec, state, KEY))
        for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
            group = getattr(state, name)
            if group is not None:
                expected[f"{short}_{name}"] = torch.stack([t[0] for t in group]).numpy()
    np.savez(HERE / "v1_files_expected.npz", **expected)


if __name__ == "__main__":
    main()
