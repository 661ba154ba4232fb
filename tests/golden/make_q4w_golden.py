"""Writes q4w_codec.json: the vectors that lock int4_kchan64_vtok_asym_sink4_win64_v1 (int8kv.quant4w,
docs/kv_file_format.md, "The 4-bit format with sinks and a window").

Run once, when the format was frozen; the JSON is committed and must never be regenerated to make a failing
test pass (a changed output means the format changed). Each case is one sequence ``[n, heads, head_dim]`` of
keys and values; every array is the hex of its little-endian bytes: inputs float32, the stored form's fields
(codes uint8, scales / minimums / F16 rows float16), and the rows its last decode step reads (float32).
"""

import json
import pathlib

import numpy as np

from int8kv import quant4w

FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_sink", "v_sink", "k_window", "v_window")


def le_hex(a: np.ndarray) -> str:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes().hex()


def cases(r: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    # Block 0's key groups leave the sinks out: sink keys of 1,000 next to positions 4-63 that run 0..15 (scale
    # exactly 1, halves as exact ties for round-half-to-even) in channel 0, and a float16 step first in 1.
    k = np.zeros((128, 1, 2), np.float32)
    k[:4] = 1000.0
    k[4:64, 0, 0] = np.resize(np.array([0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 14.5, 7.5]), 60)
    k[4:64, 0, 1] = np.resize(np.array([0.0, 15.0, 2.5004, 0.50024, 6.4995, 1.0]), 60)
    k[64:] = r.standard_normal((64, 1, 2))
    v = np.resize(np.array([0.0, 15.0, 0.5, 1.5, 2.5, 3.5]), (128, 1, 2)).astype(np.float32)
    v[:4] = -500.0
    out["sinks_left_out_ties_n128_d2"] = (k, v)
    # Per-channel offsets (what real keys carry), two heads, two sealed blocks and a window of 72.
    k = r.standard_normal((200, 2, 4)) + np.array([5.0, -5.0, 0.0, 40.0])
    v = r.standard_normal((200, 2, 4)) * np.exp(r.uniform(-3, 3, (200, 2, 1)))
    out["offsets_2heads_n200_d4"] = (k.astype(np.float32), v.astype(np.float32))
    # A constant channel and a zero channel (scale +0, codes 0), values constant and zero rows.
    k = np.zeros((192, 1, 4), np.float32)
    k[:, 0, 1] = -7.5
    k[:, 0, 2] = np.arange(192) % 17
    k[:, 0, 3] = r.standard_normal(192)
    v = np.zeros((192, 1, 4), np.float32)
    v[::2] = 3.25
    v[1::3, 0, 3] = np.linspace(-2, 2, 64)
    out["constant_and_zero_n192_d4"] = (k, v)
    # float16's extremes: 65519 rounds to 65504, spans of 2 x 65504.
    k = np.stack([np.linspace(-65504, 65504, 130), np.full(130, 65519.0)], 1)[:, None, :].astype(np.float32)
    v = np.stack([np.full(130, -65504.0), np.linspace(65504, -65504, 130)], 1)[:, None, :].astype(np.float32)
    out["extremes_n130_d2"] = (k, v)
    # Before any block is sealed: sinks only, sinks and window, the last length without a sealed block.
    for n in (3, 5, 127):
        out[f"unsealed_n{n}_d2"] = (r.standard_normal((n, 1, 2)).astype(np.float32),
                                    r.standard_normal((n, 1, 2)).astype(np.float32))
    return out


def main() -> None:
    r = np.random.default_rng(20261202)
    out: dict = {"name": quant4w.NAME, "sequences": []}
    for name, (k, v) in cases(r).items():
        rows = quant4w.encode_sequence(k, v)
        dk, dv = quant4w.decode_sequence(rows)
        out["sequences"].append({
            "name": name, "shape": list(k.shape), "k_f32": le_hex(k), "v_f32": le_hex(v),
            **{f: le_hex(getattr(rows, f)) for f in FIELDS},
            "decoded_k_f32": le_hex(dk), "decoded_v_f32": le_hex(dv),
        })
    path = pathlib.Path(__file__).with_name("q4w_codec.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
