"""Writes the block-store page values of the 4-bit format with sinks and a window (``q4w_page_*.block``).

Run once, with the code of the day the fixtures were committed; the files are committed and must never be
regenerated to make a failing test pass (a changed output means a format changed). 2 layers x 2 KV heads x head_dim
8, the stored form of 192 positions (quant4w.encode_sequence of the inputs below): the sealed values of pages 0
(with its sink rows) and 1, and the end value of page 2 (its F16 rows), each under its own key; page 1's value with
an HMAC tag of ``SECRET``. ``q4w_pages_expected.npz`` holds the inputs (npz of plain arrays: no pickle).
"""

import pathlib

import numpy as np
import torch

from int8kv.blockstore.codec_q4w import END, SEALED, PageSpec, encode_page, end_key
from int8kv.cache.state import KvLayout
from int8kv.formats import KvStorageFormat
from int8kv.quant4w import encode_sequence

HERE = pathlib.Path(__file__).parent
LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 192
FINGERPRINT, SECRET = "golden-tiny-model", b"golden-q4w-page-secret"
KEYS = [bytes([i + 1]) * 32 for i in range(3)]  # stand-ins for a prefix chain's keys


def inputs() -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(20261203)
    mags = torch.tensor([1e-3, 0.1, 1.0, 7.0, 300.0])[torch.arange(TOKENS) % 5][:, None, None]
    k = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags + torch.randn(HEADS, DIM, generator=gen) * 4
    v = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=gen) * mags
    k[1, 100] = 0.0  # an all-zero position
    v[0, 150, 1] = torch.tensor([6e-8, -3e-8, 1e-7, 0.0, 2e-6, -1e-7, 3e-8, 5e-8])  # float16 subnormals
    return k.numpy(), v.numpy()


def page_arrays(k: np.ndarray, v: np.ndarray) -> tuple[dict, dict, dict]:
    """(sealed page 0, sealed page 1, end page 2) arrays of the stored form of the inputs."""
    rows = [encode_sequence(k[layer], v[layer]) for layer in range(LAYERS)]
    names = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
    pages = [{n: np.stack([getattr(r, n)[p] for r in rows]) for n in names} for p in (0, 1)]
    pages[0]["k_sink"] = np.stack([r.k_sink for r in rows])
    pages[0]["v_sink"] = np.stack([r.v_sink for r in rows])
    end = {"k_rows": np.stack([r.k_window for r in rows]), "v_rows": np.stack([r.v_window for r in rows])}
    return pages[0], pages[1], end


def main() -> None:
    k, v = inputs()
    spec = PageSpec(KvLayout(LAYERS, HEADS, DIM, KvStorageFormat.INT4_SINK_WINDOW_V1), FINGERPRINT)
    p0, p1, end = page_arrays(k, v)
    (HERE / "q4w_page0.block").write_bytes(encode_page(spec, KEYS[0], SEALED, 0, p0))
    (HERE / "q4w_page1_hmac.block").write_bytes(encode_page(spec, KEYS[1], SEALED, 1, p1, SECRET))
    (HERE / "q4w_page2_end.block").write_bytes(encode_page(spec, end_key(KEYS[2]), END, 2, end))
    np.savez(HERE / "q4w_pages_expected.npz", k_input=k, v_input=v)


if __name__ == "__main__":
    main()
