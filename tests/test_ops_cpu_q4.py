"""The numba decode kernel over 4-bit codes (int8kv.ops.cpu_q4) against the float64 reference over the same
codes (int8kv.ops.reference_q4), on fresh random ragged batches, with windows, softcap and sinks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from int8kv import quant4
from int8kv.ops.cpu_q4 import decode_attention, layout_from_rows
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


@pytest.mark.parametrize("shape", [((1, 63, 64, 65, 200), 3, 3, 64), ((130, 7), 8, 4, 128), ((64,), 1, 1, 8)])
@pytest.mark.parametrize("variant", ["causal", "window", "softcap", "sinks", "kv_starts"])
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
