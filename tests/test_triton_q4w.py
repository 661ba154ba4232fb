"""The Triton backend's kernel over int4_kchan64_vtok_asym_sink4_win64_v1 (int8kv.ops.triton_q4w), under the
Triton interpreter on CPU tensors (compiled on a GPU), against the float64 reference over the same pool
(int8kv.ops.reference_q4w): ragged batches written step by step through the write path with the triton backend,
prefill chunks and decode rows across several seals (past 192 positions), chunks whose rows read one page in
both forms, GQA, head_dim 16, 24 and 32, every key tile width, KV splits, windows, chunks, softcap, sinks, kv_starts;
and its refusals. The interpreter runs each program in Python: the shapes are small and each case proves one
thing (the module takes ~15 s on the 2-core VM)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

pytest.importorskip("triton")

from q4w_helpers import PoolBatch, rel_err, seeded  # noqa: E402

from int8kv import ops  # noqa: E402
from int8kv.errors import ShapeMismatch, UnsupportedFormat  # noqa: E402
from int8kv.ops import triton as tk  # noqa: E402
from int8kv.ops.plan import check_variant  # noqa: E402
from int8kv.quant4w import encode_sequence  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # the INT8 kernel's: max |error| / max |reference|


class Batch(PoolBatch):
    """Sequences written step by step into a pool on DEVICE through the write path with the triton backend; each
    step attended by the triton and reference backends."""

    def __init__(self, heads, group, dim, capacity, gen, layers=1, starts=None, **variant):
        super().__init__(heads, group, dim, capacity, gen, layers, starts, DEVICE, **variant)
        self.rows = [[] for _ in capacity]  # the (k, v) written, per sequence

    def write_layer(self, plan, layer, new):
        k, v = self.write(plan, layer, backend="triton")
        if layer == 0:
            at = np.concatenate([[0], np.cumsum(new)])
            for b in range(len(new)):
                self.rows[b].append((k[at[b] : at[b + 1]], v[at[b] : at[b + 1]]))

    def step(self, new, tol=TOL, **options):
        """Write ``new`` positions per sequence on every layer, then attend each layer with both backends
        (``options``: the triton launcher's, through ``ops.triton.attention``)."""
        plan = self.plan(new)
        for layer in range(self.layers):
            self.write_layer(plan, layer, new)
        for layer in range(self.layers):
            q = self.query(plan)
            if options:
                variant = check_variant(self.pool, q.shape[1], **self.variant) if self.variant else None
                got = tk.attention(self.pool, layer, q, plan, variant=variant, **options)
            else:
                got = ops.attention(self.pool, layer, q, plan, backend="triton", **self.variant)
            want = ops.attention(self.pool, layer, q, plan, backend="reference", **self.variant)
            assert rel_err(got, want) < tol, (new, self.lens, layer)
            assert torch.equal(got.cpu() == 0, want.cpu() == 0)  # rows that see no key: zeros in both
        return plan

    def check_stored(self, b):
        """The pool's stored form of sequence ``b`` (written through the triton backend) is the format's."""
        k = torch.cat([r[0] for r in self.rows[b]])
        v = torch.cat([r[1] for r in self.rows[b]])
        got, want = self.pool.stored_form(0, self.tables[b], self.lens[b]), encode_sequence(k.numpy(), v.numpy())
        for name in ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_window", "v_window"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_steps_across_seals_match_the_float64_reference():
    # GQA (2 KV heads x 2), head_dim 32, two layers (each checked and read on its own). Lengths after each step:
    # 3 / 130 (a prefill each; page 0 of the second sealed by its last rows), 4 / 131 (decode), 68 / 192 (a chunk
    # whose rows read page 1 in F16 before position 191 and sealed from it), 193 / 193 (a 125-row chunk sealing
    # pages 0 and 1 beside a decode row, 64-key tiles), 194 / 194.
    batch = Batch(2, 2, 32, [260, 200], seeded("steps"), layers=2)
    batch.step([3, 130], block_m=64)
    batch.step([1, 1])
    batch.step([64, 61], block_m=64)
    batch.step([125, 1], block_m=64, block_n=64)
    batch.step([1, 1], block_n=16)
    batch.check_stored(0)
    batch.check_stored(1)


def test_long_decode_split_into_key_ranges_with_sinks():
    # Three KV splits of a 330-key decode row, merged with the sink logits; head_dim 16, MQA (1 KV head x 4).
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    batch = Batch(1, 4, 16, [340, 70], seeded("split"), sinks=sinks)
    batch.step([329, 69], block_m=64, block_n=64)
    for splits in (3, 2):
        batch.step([1, 1], num_splits=splits, kv_bound=512)


@pytest.mark.parametrize(
    ("dim", "variant"),
    [
        (16, {"starts": [3, 90], "window": 50, "softcap": 5.0}),  # left padding: rows below 90 see nothing
        (24, {"starts": [0, 7], "chunk": 70, "sinks": torch.tensor([1.0, -0.5])}),  # a head_dim of masked lanes
    ],
    ids=str,
)
def test_variants_and_kv_starts(dim, variant):
    variant = dict(variant)
    starts = variant.pop("starts")
    batch = Batch(1, 2, dim, [210, 200], seeded("variant", dim, str(variant)), starts=starts, **variant)
    batch.step([140, 130], block_m=64, block_n=64)
    batch.step([1, 62])  # the dispatcher's launch: 16-row query blocks, 32-key tiles
    batch.step([1, 1])


def test_refusals_and_reads_checked_per_generation():
    batch = Batch(1, 2, 16, [200], seeded("refuse"), layers=2)
    plan = batch.plan([130])
    batch.write_layer(plan, 0, [130])
    q = torch.zeros(130, 2, 16, device=DEVICE)
    ops.attention(batch.pool, 0, q, plan, backend="triton")  # layer 0 is written and sealed
    with pytest.raises(UnsupportedFormat, match="layer 1 has not sealed"):  # layer 1 is not written yet
        ops.attention(batch.pool, 1, q, plan, backend="triton")
    with pytest.raises(ShapeMismatch, match="block_n must be at most 64"):
        tk.attention(batch.pool, 0, q, plan, block_n=128)
    with pytest.raises(UnsupportedFormat, match="magic"):
        tk.attention(batch.pool, 0, q, plan, magic=True)
    batch.pool.release(batch.tables[0])  # the sequence ends: its window pages and sink slot go back
    with pytest.raises(UnsupportedFormat, match="given back"):  # the same plan's reads are checked again
        ops.attention(batch.pool, 0, q, plan, backend="triton")
