"""Writes the fixtures of states of several K/V shapes: KV files of version 2 and block values of version 3, for
F16 and for INT8.

Run once, with the code of the day the fixtures were committed; the files are committed and must never be
regenerated to make a failing test pass (a changed output means a format changed). Two groups, ragged on purpose
(2 layers x 3 KV heads x head_dim 5, and 1 layer x 2 KV heads x head_dim 6), 7 tokens in a block of 8, rows of mixed
magnitudes with an all-zero row and float16 subnormals. ``groups_int8_mapped.kv`` records a layer map (the
drop-in's export: layers 0 and 2 in the first group, 1 in the second). ``groups_expected.npz`` holds the inputs
and the stored tensors the files must give back (npz of plain arrays: no pickle).
"""

import itertools
import pathlib

import numpy as np
import torch

from int8kv import KvStorageFormat
from int8kv.blockstore.codec import BlockSpec, encode_block
from int8kv.cache.paged import PagedKvCache
from int8kv.cache.state import GroupedKvState, KvLayout
from int8kv.store import save_kv
from int8kv.store._util import raw_bytes
from int8kv.store.files import write_atomic
from int8kv.store.format import encode

HERE = pathlib.Path(__file__).parent
DIMS = [(2, 3, 5), (1, 2, 6)]
TOKENS, BLOCK = 7, 8
KEY = b"golden-groups-block-key"
FINGERPRINT = "golden-tiny-gemma4"
FORMATS = {"f16": KvStorageFormat.F16, "int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1}


def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(20261202)
    mags = torch.tensor([1e-3, 0.1, 1.0, 7.0, 300.0, 2e-6, 40.0])[:, None, None]
    out = {}
    for g, (layers, heads, dim) in enumerate(DIMS):
        for side in "kv":
            x = torch.randn(layers, TOKENS, heads, dim, generator=gen) * mags
            out[f"{side}{g}_input"] = x
    out["k0_input"][0, 2, 1] = 0.0  # an all-zero row: scale 1
    out["v1_input"][0, 4, 0] = torch.tensor([6e-8, -3e-8, 1e-7, 0.0, 2e-6, -1e-7])  # float16 subnormals
    return out


def main() -> None:
    x = inputs()
    expected = {name: t.numpy() for name, t in x.items()}
    for short, fmt in FORMATS.items():
        cache = PagedKvCache.with_groups(2, BLOCK, [KvLayout(*d, fmt) for d in DIMS])
        cache.add_sequence(0, TOKENS)
        slots = cache.slots(0)
        for g, pool in enumerate(cache.pools):
            for layer in range(pool.layout.num_layers):
                k, v = (fmt.spec.encode(x[f"{side}{g}_input"][layer]) for side in "kv")
                pool.write_rows(layer, slots, k, v)
        state = cache.export_state(0)
        save_kv(HERE / f"groups_{short}.kv", cache, seq_id=0, token_ids=list(range(200, 200 + TOKENS)),
                metadata={"fixture": short})  # fmt: skip
        spec = BlockSpec(cache.layouts, BLOCK, FINGERPRINT)
        (HERE / f"groups_{short}.block").write_bytes(encode_block(spec, state, KEY))
        for g, section in enumerate(state.sections):
            for name, group in section.groups.items():
                expected[f"{short}_{name}_{g}"] = torch.stack([t[0] for t in group]).numpy()
        if short == "int8":
            # Group 0 holds model layers 0 and 2, group 1 layer 1 (Gemma 4's interleaving).
            mapped = GroupedKvState.of(state.sections, [[0, 2], [1]])
            header, tensors, _ = encode(mapped, None, None, {"fixture": "mapped"}, "Int8KvCache", "int8kv")
            write_atomic(HERE / "groups_int8_mapped.kv", itertools.chain((header,), (raw_bytes(t) for t in tensors)))
    np.savez(HERE / "groups_expected.npz", **expected)


if __name__ == "__main__":
    main()
