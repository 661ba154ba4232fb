"""Random KV states, block specs and key chains for the block-store tests (fixed seeds)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import torch
import xxhash

from int8kv.blockstore import BlockSpec, encode_block
from int8kv.cache.state import KvLayout, KvState
from int8kv.codec import quantize_int8_torch, round_to_f16
from int8kv.formats import KvStorageFormat

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16


def random_state(layout: KvLayout, tokens: int, seed: int) -> KvState:
    """A batch-1 state of ``tokens`` tokens encoded by the real codec from random float K/V."""
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "ks": [], "vs": []}
    for _ in range(layout.num_layers):
        for name in ("k", "v"):
            x = torch.randn(1, tokens, layout.num_kv_heads, layout.head_dim, generator=g, dtype=torch.float64)
            x = (x * 3).to(torch.float32)
            x[0, 0, 0] = 0.0  # an all-zero row (scale 1) in every state
            if layout.format.is_quantized:
                codes, scales = quantize_int8_torch(x)
                groups[name].append(codes)
                groups[name + "s"].append(scales)
            else:
                groups[name].append(round_to_f16(x))
    if layout.format.is_quantized:
        return KvState.build(layout, groups["k"], groups["v"], groups["ks"], groups["vs"])
    return KvState.build(layout, groups["k"], groups["v"])


def key_chain(n: int, seed: int = 0) -> list[bytes]:
    """``n`` chained 32-byte keys, as the allocator derives them (parent digest + block content)."""
    keys, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{seed}:{i}".encode()).digest()
        keys.append(parent)
    return keys


def small_spec(fmt: KvStorageFormat = INT8, block_size: int = 4, fingerprint: str = "test-model") -> BlockSpec:
    return BlockSpec(KvLayout(2, 2, 8, fmt), block_size, fingerprint)


def blocks(
    spec: BlockSpec, n: int, seed: int = 0, keys: list[bytes] | None = None, secret: bytes | None = None
) -> tuple[KvState, list[bytes]]:
    """A state of ``n`` full blocks and the encoded value of each block, bound to ``keys`` (by default
    ``key_chain(n, seed)``), with an HMAC tag of ``secret`` if given."""
    state = random_state(spec.layout, n * spec.block_size, seed)
    keys = key_chain(n, seed) if keys is None else keys
    bs = spec.block_size
    return state, [encode_block(spec, state.slice(i * bs, (i + 1) * bs), keys[i], secret) for i in range(n)]


# The fixed header as docs/block_store.md states it, written out here independently of the codec.
FIXED = struct.Struct("<8sHHHBBIIIIIIQBB6x")
FIELDS = [
    "magic", "version", "storage_version", "header_len", "name_len", "fp_len",
    "num_layers", "head_start", "head_end", "head_dim", "block_size", "tokens", "payload_len",
    "key_len", "auth",
]


def header_fields(value: bytes) -> dict:
    return dict(zip(FIELDS, FIXED.unpack_from(value, 0), strict=True))


def reframe(value: bytes, payload_patch=None, secret: bytes | None = None, **fields) -> bytes:
    """``value`` with header fields replaced and/or bytes after the header patched, and a recomputed valid
    digest; an authenticated value gets a recomputed HMAC tag with ``secret`` (a forger who has it), or keeps
    its old tag without (a forger who has not)."""
    original = header_fields(value)
    trailer = 16 + (32 if original["auth"] else 0)
    buf = bytearray(value[:-trailer])
    header = {**original, **fields}
    FIXED.pack_into(buf, 0, *(header[name] for name in FIELDS))
    if payload_patch is not None:
        payload_patch(buf, original["header_len"])
    out = bytes(buf) + xxhash.xxh3_128_digest(bytes(buf))
    if original["auth"]:
        out += hmac.new(secret, out, hashlib.sha256).digest() if secret else value[-32:]
    return out
