"""The float64 attention over 4-bit codes (int8kv.ops.reference_q4) against attention over the decoded rows,
written out here independently, on fresh random ragged shapes, with windows, chunks, softcap and sinks."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from int8kv import quant4
from int8kv.errors import ShapeMismatch
from int8kv.ops.plan import AttentionVariant
from int8kv.ops.reference_q4 import attend_q4


def seeded(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def kv(r: np.random.Generator, n: int, heads: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    # Keys with per-channel offsets and an outlier channel, as real keys have; values of mixed row scales.
    k = r.standard_normal((n, heads, d)) + r.normal(0, 4, (heads, d))
    k[..., r.integers(d)] *= 10
    v = r.standard_normal((n, heads, d)) * np.exp(r.uniform(-1, 1, (n, heads, 1)))
    return k.astype(np.float32), v.astype(np.float32)


def dense(q, k, v, start, scale, window=None, chunk=None, softcap=None, sinks=None) -> np.ndarray:
    """Plain float64 attention of the last len(q) positions over rows k, v [ctx, H, d]."""
    n, hq, _ = q.shape
    ctx, heads, _ = k.shape
    kk = np.repeat(k.astype(np.float64), hq // heads, axis=1)
    vv = np.repeat(v.astype(np.float64), hq // heads, axis=1)
    x = np.einsum("nhd,thd->nht", q, kk) * scale
    if softcap is not None:
        x = softcap * np.tanh(x / softcap)
    p_pos = np.arange(ctx - n, ctx)[:, None]
    s_pos = np.arange(ctx)[None, :]
    vis = (s_pos >= start) & (s_pos <= p_pos)
    if window is not None:
        vis &= s_pos > p_pos - window
    if chunk is not None:
        vis &= (s_pos - start) // chunk == (p_pos - start) // chunk
    x = np.where(vis[:, None, :], x, -np.inf)
    top = np.max(x, axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[None, :, None])
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(x - top)
    den = e.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[None, :, None] - top))
    p = np.where(vis.any(1)[:, None, None], e / np.where(den > 0, den, 1), 0.0)
    return np.einsum("nht,thd->nhd", p, vv)


def variant_options(r: np.random.Generator, ctx: int, query_heads: int, variant: str):
    """Random options of one kind (``dense``'s keywords, the sinks float32-rounded as the backends keep them)
    and the AttentionVariant naming them (None for plain causal attention)."""
    opts: dict = {}
    if variant == "window":
        opts["window"] = int(r.integers(1, ctx + 1))
    elif variant == "chunk":
        opts["chunk"] = int(r.integers(1, ctx + 1))
    elif variant == "softcap":
        opts["softcap"] = 3.0
    elif variant == "sinks":
        opts["sinks"] = r.normal(0, 2, query_heads)
    var = None if variant == "causal" else AttentionVariant(
        **{key: torch.from_numpy(val).float() if key == "sinks" else val for key, val in opts.items()}
    )
    if "sinks" in opts:
        opts["sinks"] = opts["sinks"].astype(np.float32).astype(np.float64)
    return opts, var


CASES = [  # ctx, queries, kv heads, group, head_dim, start
    (1, 1, 1, 1, 8, 0), (63, 5, 3, 3, 64, 0), (64, 1, 2, 2, 16, 3), (65, 65, 1, 4, 8, 0),
    (200, 7, 3, 3, 64, 10), (130, 1, 4, 1, 128, 0),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["causal", "window", "chunk", "softcap", "sinks"])
def test_attention_from_codes_equals_attention_over_decoded_rows(case, variant):
    check_attention_from_codes(seeded(case, variant), case, variant, quant4, attend_q4)


def check_attention_from_codes(r, case, variant, codec, attend) -> None:
    """``attend`` over ``codec``'s stored form of random keys and values equals ``dense`` over the rows the
    codec decodes (one case of CASES, one kind of variant)."""
    ctx, n, heads, group, d, start = case
    k, v = kv(r, ctx, heads, d)
    rows = codec.encode_sequence(k, v)
    q = torch.from_numpy(r.standard_normal((n, heads * group, d)))
    opts, var = variant_options(r, ctx, heads * group, variant)
    scale = 1 / math.sqrt(d)
    got = attend(q, rows, kv_start=start, variant=var)
    assert got.dtype == torch.float64 and got.shape == q.shape
    dk, dv = codec.decode_sequence(rows)
    want = dense(q.numpy(), dk, dv, start, scale, **opts)
    assert np.allclose(got.numpy(), want, rtol=1e-9, atol=1e-9)


def test_four_bit_attention_stays_close_to_unquantized():
    r = seeded("close")
    k, v = kv(r, 256, 2, 64)
    q = r.standard_normal((4, 4, 64))
    got = attend_q4(torch.from_numpy(q), quant4.encode_sequence(k, v)).numpy()
    exact = dense(q, k, v, 0, 1 / 8)
    # These keys (offsets up to ~12 and an outlier channel x10) give peaked softmaxes that amplify the 4-bit
    # error: 14 % of the output's norm here; codes read wrongly (the nibble order swapped) give 141 %.
    assert np.linalg.norm(got - exact) < 0.25 * np.linalg.norm(exact)
    swapped = quant4.encode_sequence(k, v)
    swapped = type(swapped)(**{**vars(swapped), "v_codes": (swapped.v_codes << 4) | (swapped.v_codes >> 4)})
    wrong = attend_q4(torch.from_numpy(q), swapped).numpy()
    assert np.linalg.norm(wrong - exact) > 0.5 * np.linalg.norm(exact)


def test_mismatched_query_refused():
    rows = quant4.encode_sequence(*kv(seeded("bad"), 10, 2, 8))
    with pytest.raises(ShapeMismatch):
        attend_q4(torch.zeros(1, 3, 8, dtype=torch.float64), rows)  # 3 query heads over 2 KV heads
    with pytest.raises(ShapeMismatch):
        attend_q4(torch.zeros(1, 2, 16, dtype=torch.float64), rows)
    with pytest.raises(ShapeMismatch):
        attend_q4(torch.zeros(11, 2, 8, dtype=torch.float64), rows)
