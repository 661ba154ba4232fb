"""The numba decode kernel over 4-bit codes (int8kv.ops.cpu_q4) against the float64 reference over the same
codes (int8kv.ops.reference_q4), on fresh random ragged batches, with windows, softcap and sinks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from int8kv import quant4
from int8kv.ops.cpu_q4 import MIN_SPLIT_KEYS, decode_attention, decode_items, layout_from_rows
from int8kv.ops.plan import AttentionVariant
from int8kv.ops.reference_q4 import attend_q4


def seeded(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def batch_rows(r, lens, heads, d):
    out = []
    for n in lens:
        k = r.standard_normal((n, heads, d)) + r.normal(0, 3, (heads, d))
        v = r.standard_normal((n, heads, d)) * np.exp(r.uniform(-1, 1, (n, heads, 1)))
        out.append(quant4.encode_sequence(k.astype(np.float32), v.astype(np.float32)))
    return out


SHAPES = [
    ((1, 63, 64, 65, 200), 3, 3, 64),
    ((130, 7), 8, 4, 128),
    ((64,), 1, 1, 8),  # a head_dim the vector kernels do not take: the plain loops
    ((1100,), 3, 3, 64),  # one long sequence: split into key ranges, merged
    ((700, 33), 2, 4, 80),  # head_dim an odd multiple of 16
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", ["causal", "window", "chunk", "softcap", "sinks", "kv_starts"])
def test_decode_matches_float64_reference_over_the_codes(shape, variant):
    lens, heads, group, d = shape
    r = seeded(shape, variant)
    seqs = batch_rows(r, lens, heads, d)
    q = r.standard_normal((len(lens), heads * group, d)).astype(np.float32)
    layout = layout_from_rows(seqs, order=r.permutation(sum(s.k_codes.shape[0] for s in seqs)))
    opts: dict = {}
    starts = np.zeros(len(lens), np.int32)
    if variant == "window":
        opts["window"] = int(r.integers(1, 100))
    elif variant == "chunk":
        opts["chunk"] = int(r.integers(5, 300))
    elif variant == "softcap":
        opts["softcap"] = 2.5
    elif variant == "sinks":
        opts["sinks"] = r.normal(0, 2, heads * group).astype(np.float32)
    elif variant == "kv_starts":
        starts = np.array([int(r.integers(0, n)) for n in lens], np.int32)
    var = AttentionVariant(**{k: torch.from_numpy(v) if k == "sinks" else v for k, v in opts.items()})
    got = decode_attention(q, **layout, kv_starts=starts, variant=var if opts else None)
    for b, rows in enumerate(seqs):
        want = attend_q4(torch.from_numpy(q[b : b + 1]).double(), rows, kv_start=int(starts[b]), variant=var)
        want = want[0].numpy()
        assert np.allclose(got[b], want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(want).max())), (b, lens[b])


def test_a_query_that_sees_nothing_gets_zeros():
    r = seeded("empty")
    seqs = batch_rows(r, (70,), 2, 8)
    q = r.standard_normal((1, 2, 8)).astype(np.float32)
    got = decode_attention(q, **layout_from_rows(seqs), kv_starts=np.array([70], np.int32))
    assert not got.any()


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_items_cover_each_visible_range_once_cut_at_blocks(threads):
    r = seeded("items", threads)
    lens = r.integers(0, 3000, 7)
    lows = np.minimum(r.integers(0, 400, 7), lens)
    items, firsts = decode_items(lows, lens, threads)
    for b in range(7):
        mine = items[firsts[b] : firsts[b + 1]]
        assert (mine[:, 0] == b).all()
        if lows[b] == lens[b]:
            assert len(mine) == 0
            continue
        assert mine[0, 1] == lows[b] and mine[-1, 2] == lens[b] and (mine[1:, 1] == mine[:-1, 2]).all()
        assert (mine[1:, 1] % quant4.BLOCK == 0).all() and (mine[:, 2] > mine[:, 1]).all()
        assert len(mine) == 1 or (mine[:-1, 2] - mine[:-1, 1] >= MIN_SPLIT_KEYS - quant4.BLOCK).all()


def test_keys_below_the_window_are_never_read():
    """Blocks wholly below the first visible key hold NaN codes' scales and their table entries point at a NaN
    block: the output is bit for bit the same."""
    r = seeded("nan-below")
    seqs = batch_rows(r, (900, 400), 2, 64)
    q = r.standard_normal((2, 4, 64)).astype(np.float32)
    var = AttentionVariant(window=300)
    layout = layout_from_rows(seqs)
    clean = decode_attention(q, **layout, variant=var)
    low = (np.array([900, 400]) - 300) // quant4.BLOCK  # blocks before the one holding the first visible key
    spoiled = {k: v.copy() for k, v in layout.items()}
    for name in ("k_scale", "k_min", "v_scale", "v_min"):
        spoiled[name] = np.concatenate([spoiled[name], np.full((1,) + spoiled[name].shape[1:], np.nan, np.float16)])
    for name in ("k_codes", "v_codes"):
        spoiled[name] = np.concatenate([spoiled[name], np.full((1,) + spoiled[name].shape[1:], 255, np.uint8)])
    nan_block = spoiled["k_scale"].shape[0] - 1
    for b in range(2):
        for name in ("k_scale", "k_min", "v_scale", "v_min"):
            spoiled[name][layout["block_tables"][b, : low[b]]] = np.nan
        spoiled["block_tables"][b, : low[b]] = nan_block
    assert np.array_equal(decode_attention(q, **spoiled, variant=var), clean)
