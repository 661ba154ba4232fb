"""Writes v1_codec.json: the vectors that lock the V1 codec.

Run once, when V1 was defined; the JSON is committed and must never be regenerated
to make a failing test pass (a changed output means the format changed).
Inputs and scales are stored as float32 bit patterns (hex) so nothing is lost in JSON.
"""

import json
import pathlib

import torch

from int8kv.codec import quantize_int8

HAND = {
    # amax 127 gives scale exactly 1, so the .5 values are exact ties: RNE picks the even code.
    "ties_at_scale_1": [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.0, 0.0],
    # 2.5004 and 127.02 become 2.5 and 127.0 in float16; only then is the tie at 2.5 resolved to 2.
    "float16_step_first": [127.02, 2.5004, -2.5004, 0.50024, 1.5, 0.0, 0.0, 0.0],
    "all_zero": [0.0] * 8,
    "negative_max": [-3.0, 1.0, 0.5, 2.9, -0.01, 0.0, 1.5, -1.5],
    "float16_subnormals": [6e-8, -3e-8, 1e-7, 5.96e-08, 0.0, 2e-6, -6.1e-5, 6.2e-5],
    "float16_max": [65504.0, 65519.0, -32768.0, 1.0, 0.25, 258.0, 257.0, -65504.0],
}


def bits(t: torch.Tensor) -> list[str]:
    return [f"{int(b) & 0xFFFFFFFF:08x}" for b in t.contiguous().view(torch.int32).reshape(-1)]


def main() -> None:
    rows = {name: torch.tensor(v, dtype=torch.float32) for name, v in HAND.items()}
    gen = torch.Generator().manual_seed(20261130)
    for i, mag in enumerate([1e-3, 0.1, 1.0, 7.0, 300.0]):
        rows[f"random_{i}"] = torch.randn(64, generator=gen) * mag
    out = []
    for name, x in rows.items():
        q, s = quantize_int8(x)
        out.append({"name": name, "x_f32_bits": bits(x), "codes": q.tolist(), "scale_f32_bits": bits(s.reshape(1))[0]})
    path = pathlib.Path(__file__).with_name("v1_codec.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
