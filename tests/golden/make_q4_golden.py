"""Writes q4_codec.json: the vectors that lock the 4-bit format (int8kv.quant4, docs/kv_file_format.md).

Run once, when the format was frozen; the JSON is committed and must never be regenerated to make a failing
test pass (a changed output means the format changed). Inputs are float32 bit patterns, scales and minimums
float16 bit patterns, codes the packed bytes, decoded values float32 bit patterns (all hex).
"""

import json
import pathlib

import numpy as np

from int8kv import quant4

VALUE_ROWS = {
    # min 0, max 15: scale exactly 1, so the .5 values are exact ties: RNE picks the even code.
    "ties_at_scale_1": [0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 14.5, 7.5],
    # 2.5004 becomes 2.5 in float16 first; only then is the tie at 2.5 resolved to 2.
    "float16_step_first": [0.0, 15.0, 2.5004, 0.50024, 6.4995, 1.0, 9.0, 12.0],
    "all_zero": [0.0] * 8,
    "constant": [-3.25] * 8,
    "negative_only": [-3.0, -1.0, -0.5, -2.9, -0.01, -1.25, -1.5, -2.0],
    "float16_subnormals": [6e-8, -3e-8, 1e-7, 5.96e-08, 0.0, 2e-6, -6.1e-5, 6.2e-5],
    "float16_extremes": [65504.0, -65504.0, 65519.0, 1.0, 0.25, 258.0, -257.0, -65519.0],
    "scale_rounds_down": [0.0, 1.0001, 0.3, 0.7, 0.999, 0.5, 0.0667, 0.9334],
}


def hexes(a: np.ndarray, dtype) -> list[str]:
    width = np.dtype(dtype).itemsize * 2
    return [f"{int(b):0{width}x}" for b in np.ascontiguousarray(a).view(dtype).reshape(-1)]


def main() -> None:
    r = np.random.default_rng(20261201)
    values = {k: np.array(v, dtype=np.float32) for k, v in VALUE_ROWS.items()}
    for i, mag in enumerate([1e-3, 0.1, 1.0, 7.0, 300.0]):
        values[f"random_{i}"] = (r.standard_normal(64) * mag).astype(np.float32)
    out: dict[str, list] = {"name": quant4.NAME, "values": [], "key_blocks": []}
    for name, x in values.items():
        packed, scale, mn = quant4.encode_values(x)
        out["values"].append({
            "name": name, "x_f32": hexes(x, np.uint32), "codes": packed.tobytes().hex(),
            "scale_f16": hexes(scale.reshape(1), np.uint16)[0], "min_f16": hexes(mn.reshape(1), np.uint16)[0],
            "decoded_f32": hexes(quant4.decode_values(packed, scale, mn), np.uint32),
        })
    blocks = {
        "random_d8": r.standard_normal((quant4.BLOCK, 8)) * np.array([0.01, 0.1, 1, 3, 10, 30, 100, 1000]),
        "channel_offsets_2heads_d4": r.standard_normal((quant4.BLOCK, 2, 4)) + np.array([5.0, -5.0, 0.0, 40.0]),
        "constant_and_zero_channels_d4": np.tile(np.array([0.0, 2.0, -7.5, 1.0]), (quant4.BLOCK, 1))
        * np.array([1.0, 1.0, 1.0, 0.0])[None, :] + np.array([0.0, 0.0, 0.0, 1.0]) * np.arange(quant4.BLOCK)[:, None],
        "extremes_d2": np.stack([np.linspace(-65504, 65504, quant4.BLOCK), np.full(quant4.BLOCK, 65519.0)], 1),
    }
    for name, k in blocks.items():
        k = k.astype(np.float32)
        packed, scale, mn = quant4.encode_keys_block(k)
        out["key_blocks"].append({
            "name": name, "shape": list(k.shape), "x_f32": hexes(k, np.uint32), "codes": packed.tobytes().hex(),
            "scale_f16": hexes(scale, np.uint16), "min_f16": hexes(mn, np.uint16),
            "decoded_f32": hexes(quant4.decode_keys_block(packed, scale, mn), np.uint32),
        })
    path = pathlib.Path(__file__).with_name("q4_codec.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
