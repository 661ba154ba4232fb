"""Writes the KV file fixture of the 4-bit format with sinks and a window (``q4w_state.kv``).

Run once, with the code of the day the fixture was committed; the file is committed and must never be
regenerated to make a failing test pass (a changed output means a format changed). 2 layers x 2 KV heads x head_dim
8, one sequence of 150 positions (block 0 sealed, the sinks, the window 64..149), written through the engine's
cache in steps of 64, 66, 1 and 19 positions; keys with per-channel offsets and mixed magnitudes, an all-zero
position, float16 subnormals. ``q4w_state_expected.npz`` holds the inputs and the stored form the file must give
back (npz of plain arrays: no pickle).
"""

import pathlib

import numpy as np
import torch

from int8kv.cache.paged_q4w import Int4SinkWindowCache
from int8kv.ops import write
from int8kv.ops.plan import plan_attention
from int8kv.store import save_kv

HERE = pathlib.Path(__file__).parent
LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 150
STEPS = (64, 66, 1, 19)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(20261203)
    mags = torch.tensor([1e-3, 0.1, 1.0, 7.0, 300.0])[torch.arange(TOKENS) % 5][:, None, None]
    k = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags + torch.randn(HEADS, DIM, generator=gen) * 4
    v = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags
    k[0, 70] = 0.0  # an all-zero position
    v[1, 90, 0] = torch.tensor([6e-8, -3e-8, 1e-7, 0.0, 2e-6, -1e-7, 3e-8, 5e-8])  # float16 subnormals
    return k, v


def main() -> None:
    k, v = inputs()
    cache = Int4SinkWindowCache(4, LAYERS, HEADS, DIM, window_pages=4, sink_slots=1)
    cache.add_sequence(0, 0)
    done = 0
    for m in STEPS:
        cache.grow(0, m)
        tables, lens = cache.batch_tensors([0])
        plan = plan_attention(cache.pool, tables, lens, cu_seqlens_q=torch.tensor([0, m], dtype=torch.int32))
        for layer in range(LAYERS):
            write.append_paged_kv(cache.pool, layer, k[layer, done : done + m], v[layer, done : done + m], plan=plan)
        cache.release_outside_windows(0, done + m)
        done += m
    save_kv(HERE / "q4w_state.kv", cache, seq_id=0, token_ids=list(range(300, 300 + TOKENS)),
            metadata={"fixture": "q4w"})  # fmt: skip
    state = cache.export_state(0)
    expected = {"k_input": k.numpy(), "v_input": v.numpy()}
    expected.update({name: a for name, a in state.arrays.items()})
    np.savez(HERE / "q4w_state_expected.npz", **expected)


if __name__ == "__main__":
    main()
