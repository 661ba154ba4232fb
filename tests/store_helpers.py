"""Shared by the store tests: small filled caches, and an independent reader/writer of the documented file
layout (docs/kv_file_format.md) for forging files one defect at a time with every digest recomputed."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from int8kv import KvCacheError, KvStorageFormat, QuantizedKvCache
from int8kv.store import load_kv

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
FORMATS = [INT8, F16]
LAYERS, HEADS, DIM = 3, 2, 8


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def filled_cache(fmt: KvStorageFormat, tokens: int = 20, capacity: int = 32, seed: int = 0) -> QuantizedKvCache:
    gen = torch.Generator().manual_seed(seed)
    cache = QuantizedKvCache(LAYERS, capacity, HEADS, DIM, fmt)
    for _ in range(tokens // 5):
        k = [torch.randn(5, HEADS, DIM, generator=gen) * 3 for _ in range(LAYERS)]
        v = [torch.randn(5, HEADS, DIM, generator=gen) for _ in range(LAYERS)]
        cache.push_step(k, v)
    return cache


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so -0.0 != 0.0 and NaN payloads count (torch.equal on floats would hide both)."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def snapshot(cache: QuantizedKvCache) -> list:
    return [
        (
            layer.seq_len,
            *(None if t is None else t.clone() for t in (layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales)),
        )
        for layer in cache.layers
    ]


def assert_unchanged(cache: QuantizedKvCache, before: list) -> None:
    after = snapshot(cache)
    for a, b in zip(before, after, strict=True):
        assert a[0] == b[0]
        assert all(same_bits(x, y) for x, y in zip(a[1:], b[1:], strict=True))


def canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict, data: bytes, rehash: bool = True) -> None:
    if rehash:
        meta = header["__metadata__"]
        meta["data_sha256"] = hashlib.sha256(data).hexdigest()
        unsigned = {k: v for k, v in meta.items() if k != "header_sha256"}
        meta["header_sha256"] = hashlib.sha256(canon({**header, "__metadata__": unsigned})).hexdigest()
    body = canon(header)
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def forge(src: Path, dst: Path, header_fn=None, data_fn=None) -> Path:
    header, data = read_raw(src)
    if header_fn is not None:
        header_fn(header)
    if data_fn is not None:
        data = data_fn(header, bytearray(data))
    write_raw(dst, header, bytes(data))
    return dst


def tensor_slice(header: dict, name: str, data: bytearray) -> memoryview:
    begin, end = header[name]["data_offsets"]
    return memoryview(data)[begin:end]


def refuses(path: Path, target: QuantizedKvCache, error: type[Exception], **kwargs) -> Exception:
    """Loading must raise `error` and leave `target` exactly as it was."""
    before = snapshot(target)
    with pytest.raises(error) as info:
        load_kv(path, target, **kwargs)
    assert_unchanged(target, before)
    assert isinstance(info.value, KvCacheError)
    return info.value
