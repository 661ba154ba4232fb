"""The frozen 4-bit format with F16 sinks and window (int8kv.quant4w): golden bytes, the group rule against float64
on fresh ragged inputs, what is F16 at each length, the value domain, bytes, the float64 attention over its
stored form, and the bench's quality harness (bench kv4) storing and reading exactly this format."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from test_ops_reference_q4 import check_attention_from_codes, dense, kv
from test_quant4 import ragged, reference_groups, rng

from int8kv import quant4w
from int8kv.bench import kv4
from int8kv.errors import NonFiniteError, ShapeMismatch
from int8kv.ops.reference_q4w import attend_q4w

GOLDEN = json.loads(pathlib.Path(__file__).with_name("golden").joinpath("q4w_codec.json").read_text())
FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_sink", "v_sink", "k_window", "v_window")
WINNER = next(s for s in kv4.SCHEMES if s.name == kv4.SINK_WINDOW)


def test_golden_names_this_format():
    assert GOLDEN["name"] == quant4w.NAME == "int4_kchan64_vtok_asym_sink4_win64_v1" and quant4w.VERSION == 1
    assert (quant4w.BLOCK, quant4w.SINKS, quant4w.WINDOW) == (64, 4, 64)


@pytest.mark.parametrize("case", GOLDEN["sequences"], ids=[c["name"] for c in GOLDEN["sequences"]])
def test_golden_sequences_lock_the_bytes(case):
    def arr(field: str, dtype: str) -> np.ndarray:
        return np.frombuffer(bytes.fromhex(case[field]), dtype=dtype)

    k, v = (arr(f, "<f4").reshape(case["shape"]) for f in ("k_f32", "v_f32"))
    rows = quant4w.encode_sequence(k, v)
    assert len(rows) == case["shape"][0]
    for field in FIELDS:
        assert getattr(rows, field).tobytes().hex() == case[field], field
    dk, dv = quant4w.decode_sequence(rows)
    assert dk.tobytes() == arr("decoded_k_f32", "<f4").tobytes()
    assert dv.tobytes() == arr("decoded_v_f32", "<f4").tobytes()
    assert quant4w.rows_problem(rows) is None


def test_golden_block_zero_leaves_the_sinks_out():
    case = next(c for c in GOLDEN["sequences"] if c["name"].startswith("sinks_left_out"))
    scale = np.frombuffer(bytes.fromhex(case["k_scale"]), "<f2")
    assert scale.tolist() == [1.0, 1.0]  # positions 4-63 span 0..15; the sinks' 1000 would make it ~66
    assert case["k_codes"][:8] == "00000000"  # the sink positions' code bytes


@pytest.mark.parametrize(("n", "heads", "d"), [(128, 1, 2), (129, 3, 64), (255, 2, 10), (320, 1, 128), (200, 4, 6)])
def test_sealed_blocks_against_float64(n, heads, d):
    r = rng("q4w", n, heads, d)
    k = ragged(r, (n, heads, d)) + r.normal(0, 30, (heads, d)).astype(np.float32)  # per-channel offsets
    v = ragged(r, (n, heads, d))
    rows = quant4w.encode_sequence(k, v)
    blocks = quant4w.sealed_blocks(n)
    assert rows.k_codes.shape == (blocks, 64, heads, d // 2) and rows.v_scale.shape == (blocks, 64, heads)
    for b in range(blocks):
        lo = 4 if b == 0 else 0
        kb = k[b * 64 + lo : (b + 1) * 64]
        rq, rs, rlo = reference_groups(np.moveaxis(kb, 0, -1))  # per (head, channel) over the positions
        assert np.array_equal(rows.k_scale[b].astype(np.float64), rs)
        assert np.array_equal(rows.k_min[b].astype(np.float64), rlo)
        q = np.moveaxis(quant4w.unpack_nibbles(rows.k_codes[b, lo:]), 0, -1)
        assert np.abs(q.astype(np.float64) - rq).max() <= 1 and np.mean(q == rq) > 0.999
        vq, vs, vlo = reference_groups(v[b * 64 + lo : (b + 1) * 64])  # per (position, head) over the channels
        assert np.array_equal(rows.v_scale[b, lo:].astype(np.float64), vs)
        assert np.array_equal(rows.v_min[b, lo:].astype(np.float64), vlo)
        got_v = quant4w.unpack_nibbles(rows.v_codes[b, lo:])
        assert np.abs(got_v.astype(np.float64) - vq).max() <= 1 and np.mean(got_v == vq) > 0.999
    dk, dv = quant4w.decode_sequence(rows)
    x16 = k.astype(np.float16).astype(np.float64)
    sealed = np.zeros(n, bool)
    sealed[4 : blocks * 64] = True
    step = np.repeat(rows.k_scale.astype(np.float64), 64, axis=0)[: blocks * 64][sealed[: blocks * 64]]
    err = np.abs(dk.astype(np.float64) - x16)
    assert np.all(err[sealed] <= step * 0.5 * (1 + 1e-5) + np.abs(x16[sealed]) * 2e-7 + 1e-30)
    # Sinks and window: the F16 rows exactly.
    assert np.array_equal(dk[~sealed], k[~sealed].astype(np.float16).astype(np.float32))
    assert np.array_equal(dv[~sealed], v[~sealed].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("n", [0, 1, 4, 5, 64, 127, 128, 129, 191, 192, 250])
def test_what_is_f16_at_each_length(n):
    sinks, window = quant4w.f16_positions(n)
    blocks = quant4w.sealed_blocks(n)
    assert blocks == max(0, (n - 64) // 64) and all(n >= 64 * b + 128 for b in range(blocks))
    assert list(sinks) == list(range(min(n, 4)))
    assert (window.start, window.stop) == (max(64 * blocks, min(n, 4)), n)
    assert n < 4 or 64 <= len(window) < 128 or blocks == 0  # the 64-127 most recent positions once one seals
    k, v = kv(rng("lengths", n), n, 2, 8)
    rows = quant4w.encode_sequence(k, v)
    assert len(rows) == n and rows.k_window.shape == (len(window), 2, 8) and rows.k_sink.shape == (len(sinks), 2, 8)


def test_stored_form_depends_on_the_prefix_only():
    # What a cache stores after n positions is encode_sequence of those n, so a longer sequence's sealed blocks
    # are the shorter one's plus the blocks sealed since (sealing encodes the F16 rows, which hold x16 exactly).
    k, v = kv(rng("prefix"), 300, 2, 16)
    full = quant4w.encode_sequence(k, v)
    for n in (128, 191, 192, 256):
        part = quant4w.encode_sequence(k[:n], v[:n])
        c = quant4w.sealed_blocks(n)
        for field in FIELDS[:6]:
            assert np.array_equal(getattr(part, field), getattr(full, field)[:c])
    again = quant4w.encode_sequence(k.astype(np.float16), v.astype(np.float16).astype(np.float64))
    assert all(np.array_equal(getattr(again, f), getattr(full, f)) for f in FIELDS)


def test_bad_inputs_refused_before_anything_is_encoded():
    k, v = kv(rng("bad"), 130, 2, 8)
    k[129, 1, 3] = np.nan
    with pytest.raises(NonFiniteError, match=r"\(129, 1, 3\)"):
        quant4w.encode_sequence(k, v)
    with pytest.raises(ShapeMismatch, match="even head_dim"):
        quant4w.encode_sequence(np.ones((5, 2, 3), np.float32), np.ones((5, 2, 3), np.float32))
    with pytest.raises(ShapeMismatch, match="one shape"):
        quant4w.encode_sequence(np.ones((5, 2, 4), np.float32), np.ones((6, 2, 4), np.float32))
    with pytest.raises(ShapeMismatch):
        quant4w.encode_sequence(np.ones((5, 4), np.float32), np.ones((5, 4), np.float32))
    with pytest.raises(ShapeMismatch, match="block"):
        quant4w.seal_block(np.ones((63, 1, 4), np.float32), np.ones((63, 1, 4), np.float32), False)


def test_value_domain_is_what_the_encoder_writes():
    rows = quant4w.encode_sequence(*kv(rng("domain"), 200, 2, 8))
    assert quant4w.rows_problem(rows) is None

    def with_(field: str, index: tuple, value) -> quant4w.Q4WRows:
        a = getattr(rows, field).copy()
        a[index] = value
        return quant4w.Q4WRows(**{**vars(rows), field: a})

    assert "key" in quant4w.rows_problem(with_("k_scale", (1, 0, 2), -1.0))
    assert "value" in quant4w.rows_problem(with_("v_scale", (0, 9, 1), np.float16(-0.0)))
    assert "key" in quant4w.rows_problem(with_("k_min", (0, 1, 1), np.inf))
    assert "v_window" in quant4w.rows_problem(with_("v_window", (3, 0, 0), np.nan))
    assert "k_sink" in quant4w.rows_problem(with_("k_sink", (0, 0, 0), np.inf))
    assert "sink position" in quant4w.rows_problem(with_("k_codes", (0, 2, 1, 0), 0x11))
    assert "sink position" in quant4w.rows_problem(with_("v_min", (0, 3, 0), 1.0))
    assert quant4w.rows_problem(with_("k_codes", (1, 2, 1, 0), 0xFF)) is None  # every byte is a code


def test_bytes_are_the_stored_forms_and_meet_the_targets():
    for n, d in [(3, 8), (127, 8), (128, 64), (1000, 128), (4096, 64)]:
        rows = quant4w.encode_sequence(*kv(rng("bytes", n, d), n, 1, d))
        assert quant4w.stored_bytes(n, d) == sum(getattr(rows, f).nbytes for f in FIELDS)
    assert quant4w.sealed_bytes_per_position(64) == 72 and quant4w.sealed_bytes_per_position(128) == 140
    # Long contexts: 0.281x at 64 (target 0.30x), 0.273x at 128 (target 0.28x); the F16 rows (4 sinks, 64-127
    # recent positions) add 0.012x at 4k positions, 0.0015x at 32k.
    assert quant4w.bytes_at(1 << 20, 64) < 0.2815 < 0.30 and quant4w.bytes_at(1 << 20, 128) < 0.2736 < 0.28
    assert quant4w.bytes_at(4096, 64) == pytest.approx(0.2935, abs=1e-4)
    assert quant4w.bytes_at(4096, 128) == pytest.approx(0.2858, abs=1e-4)
    assert quant4w.bytes_at(32768, 128) < 0.28
    # The bench's figure (block 0's sink rows not counted twice) within those 4 rows.
    for d in (64, 128):
        assert kv4.bytes_per_row(WINNER, d) == quant4w.sealed_bytes_per_position(d)
        got, bench = quant4w.bytes_at(4096, d), kv4.bytes_at(WINNER, d, 4096) / (4 * d)
        assert 0 <= got - bench <= 4 * quant4w.sealed_bytes_per_position(d) / (4096 * 4 * d) + 1e-12


CASES = [  # ctx, queries, kv heads, group, head_dim, start
    (3, 1, 1, 1, 8, 0), (127, 5, 3, 3, 64, 0), (128, 1, 2, 2, 16, 3), (129, 70, 1, 4, 8, 0),
    (300, 7, 3, 3, 64, 10), (200, 1, 4, 1, 128, 0),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["causal", "window", "chunk", "softcap", "sinks"])
def test_attention_from_codes_equals_attention_over_decoded_rows(case, variant):
    check_attention_from_codes(rng("q4w attention", case, variant), case, variant, quant4w, attend_q4w)


def test_attention_reads_the_sinks_from_their_f16_rows():
    k, v = kv(rng("sink rows"), 200, 2, 16)
    rows = quant4w.encode_sequence(k, v)
    q = torch.from_numpy(rng("sink q").standard_normal((1, 2, 16)))
    base = attend_q4w(q, rows)
    # Block 0's stored bytes at the sink positions are never read; the sink rows are.
    noisy = quant4w.Q4WRows(**{**vars(rows), "k_codes": rows.k_codes.copy(), "v_scale": rows.v_scale.copy()})
    noisy.k_codes[0, :4] = 0xFF
    noisy.v_scale[0, :4] = 100.0
    assert torch.equal(attend_q4w(q, noisy), base)
    moved = quant4w.Q4WRows(**{**vars(rows), "v_sink": rows.v_sink + np.float16(1.0)})
    assert not torch.allclose(attend_q4w(q, moved), base)
    # Close to attention over the unquantized rows (per-channel offsets, outlier channel: peaked softmaxes).
    exact = dense(q.numpy(), k, v, 0, 0.25)
    assert np.linalg.norm(base.numpy() - exact) < 0.25 * np.linalg.norm(exact)
    with pytest.raises(ShapeMismatch):
        attend_q4w(torch.zeros(1, 3, 16, dtype=torch.float64), rows)
    with pytest.raises(ShapeMismatch):
        attend_q4w(torch.zeros(201, 2, 16, dtype=torch.float64), rows)


# -- the bench's quality harness measures this format ----------------------------------------------------------
def _bench_chunks(k: torch.Tensor, v: torch.Tensor, bounds):
    """Feed ``k, v [1, H, n, d]`` to the bench's cache for the winner in chunks; per chunk end, the rows a query
    at each position of the chunk reads (keys and values ``[H, n, d]`` as selected by ``quantized_from``)."""
    cache = kv4.make_cache(WINNER, k.shape[-1])
    d = k.shape[-1]
    for lo, hi in bounds:
        got_k, got_v = cache.update(k[:, :, lo:hi], v[:, :, lo:hi], 0)
        yield lo, hi, got_k[0], got_v[0], d


@pytest.mark.parametrize("heads, d", [(2, 16), (1, 64)])
def test_bench_winner_reads_the_frozen_format_bit_for_bit(heads, d):
    gen = torch.Generator().manual_seed(11)
    n = 330
    k = torch.randn(1, heads, n, d, generator=gen) * 3 + torch.randn(1, heads, 1, d, generator=gen) * 5
    v = torch.randn(1, heads, n, d, generator=gen)
    bounds = [(0, 3), (3, 70), (70, 127), (127, 128), (128, 200), (200, 256), (256, 330)]
    for lo, hi, got_k, got_v, d in _bench_chunks(k, v, bounds):
        k16, kq, when = got_k[..., :d], got_k[..., d : 2 * d], got_k[0, :, 2 * d]
        v16, vq = got_v[..., :d], got_v[..., d:]
        for p in range(lo, hi):  # the query at position p reads the stored form of p + 1 positions
            rows = quant4w.encode_sequence(k[0, :, : p + 1].transpose(0, 1).numpy(),
                                           v[0, :, : p + 1].transpose(0, 1).numpy())
            want_k, want_v = quant4w.decode_sequence(rows)
            quantized = (when[: p + 1] <= p)[None, :, None]
            read_k = torch.where(quantized, kq[:, : p + 1], k16[:, : p + 1]).transpose(0, 1).numpy()
            read_v = torch.where(quantized, vq[:, : p + 1], v16[:, : p + 1]).transpose(0, 1).numpy()
            assert read_k.tobytes() == want_k.tobytes() and read_v.tobytes() == want_v.tobytes(), p


def test_bench_mixed_attention_equals_the_reference_over_each_querys_stored_form():
    gen = torch.Generator().manual_seed(12)
    heads, group, d, n = 2, 3, 16, 260
    k = torch.randn(1, heads, n, d, generator=gen) * 2 + torch.randn(1, heads, 1, d, generator=gen) * 4
    v = torch.randn(1, heads, n, d, generator=gen)
    for lo, hi, got_k, got_v, d in _bench_chunks(k, v, [(0, 100), (100, 190), (190, 260)]):
        q = torch.randn(1, heads * group, hi - lo, d, generator=gen)
        out, _ = kv4.mixed_attention(None, q, got_k[None], got_v[None], None)
        for i, p in enumerate(range(lo, hi)):
            rows = quant4w.encode_sequence(k[0, :, : p + 1].transpose(0, 1).numpy(),
                                           v[0, :, : p + 1].transpose(0, 1).numpy())
            want = attend_q4w(q[0, :, i][None], rows)[0]
            torch.testing.assert_close(out[0, i].double(), want, rtol=2e-5, atol=2e-5)


def test_bench_pool_path_gives_the_mixed_caches_logits():
    from test_bench_kv4 import _tiny_model

    # One layer (the rows are then the same bits both ways; see tests/test_bench_kv4.py), 200 positions in
    # chunks across the seals at 128 and 192.
    model = _tiny_model(layers=1)
    ids = torch.randint(0, 64, (2, 200), generator=torch.Generator().manual_seed(13))
    out = {}
    with torch.inference_mode():
        for kind in (WINNER, kv4.POOL):
            kv4.use_attention(model, kind)
            cache = kv4.make_cache(kind, 8)
            out[kind] = torch.cat([model(input_ids=ids[:, lo:hi], cache=cache).logits
                                   for lo, hi in [(0, 100), (100, 127), (127, 128), (128, 190), (190, 200)]], 1)
        kv4.use_attention(model, None)
        plain = model(input_ids=ids, cache=kv4.make_cache(None, 8)).logits
    torch.testing.assert_close(out[kv4.POOL], out[WINNER], rtol=1e-5, atol=1e-5)
    assert (out[WINNER] - plain).abs().max() > 1e-4  # the quantized rows were read
