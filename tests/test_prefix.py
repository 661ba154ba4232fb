"""Prefix-cache block keys: a SHA-256 chain, equal across processes, changed by every extra key."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import int8kv
from int8kv.cache.prefix import KEY_BYTES, PrefixHasher
from int8kv.cache.state import KvLayout
from int8kv.errors import HeadOutOfRange, KvCacheError, PrefixKeyError, ShapeMismatch
from int8kv.formats import KvStorageFormat

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
LAYOUT = KvLayout(30, 3, 64, INT8)


def reference_keys(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The chain written out from its definition, one token at a time (int.to_bytes, not struct)."""
    keys, parent = [], root
    for b in range(len(tokens) // block_size):
        h = hashlib.sha256(parent)
        for t in tokens[b * block_size : (b + 1) * block_size]:
            h.update(t.to_bytes(8, "little"))
        parent = h.digest()
        keys.append(parent)
    return keys


def reference_root(fields: list) -> bytes:
    data = b"int8kv.prefix.v1"
    for f in fields:
        raw = f.encode() if isinstance(f, str) else str(f).encode()
        data += len(raw).to_bytes(4, "little") + raw
    return hashlib.sha256(data).digest()


def test_keys_follow_the_definition():
    rng = random.Random(1)
    for block_size in (1, 4, 16):
        h = PrefixHasher(LAYOUT, "smollm2-135m@abc", block_size, head_range=(1, 3))
        root = reference_root([INT8.value, 1, "smollm2-135m@abc", 30, 3, 64, block_size, 1, 3])
        assert h.root == root
        for n in (0, block_size - 1, block_size, 5 * block_size + 3):
            tokens = [rng.randrange(0, 2**64) for _ in range(n)]
            keys = h.block_keys(tokens)
            assert keys == reference_keys(root, tokens, block_size)
            assert len(keys) == n // block_size and all(len(k) == KEY_BYTES for k in keys)


def test_a_key_covers_the_whole_prefix():
    h = PrefixHasher(LAYOUT, "m", 4)
    rng = random.Random(2)
    tokens = [rng.randrange(50_000) for _ in range(24)]
    keys = h.block_keys(tokens)
    assert len(set(keys)) == len(keys)
    for pos in (0, 5, 11, 23):
        changed = list(tokens)
        changed[pos] += 1
        other = h.block_keys(changed)
        first = pos // 4
        assert other[:first] == keys[:first]  # blocks before the change keep their keys
        assert all(a != b for a, b in zip(other[first:], keys[first:], strict=True))  # every later one moves
    # The same block of tokens after a different prefix gets a different key.
    assert h.block_keys([1, 2, 3, 4, 9, 9, 9, 9])[1] != h.block_keys([1, 2, 3, 5, 9, 9, 9, 9])[1]


def test_incremental_keys_equal_a_full_rehash():
    h = PrefixHasher(LAYOUT, "m", 4)
    rng = random.Random(3)
    tokens: list[int] = []
    keys: list[bytes] = []
    for _ in range(30):
        tokens += [rng.randrange(1000) for _ in range(rng.randrange(0, 7))]
        keys = h.block_keys(tokens, keys)
        assert keys == h.block_keys(tokens)
    # Known keys are reused as given (not rehashed): a made-up known key changes every key after it.
    fake = [b"\x00" * KEY_BYTES]
    assert h.block_keys(tokens, fake)[0] == fake[0]
    assert h.block_keys(tokens, fake)[1] != h.block_keys(tokens)[1]


def test_every_extra_key_changes_the_keys():
    tokens = list(range(32))
    base = PrefixHasher(LAYOUT, "m", 8).block_keys(tokens)
    variants = [
        PrefixHasher(LAYOUT.with_format(KvStorageFormat.F16), "m", 8),
        PrefixHasher(LAYOUT, "m2", 8),
        PrefixHasher(LAYOUT, "m", 8, head_range=(0, 1)),
        PrefixHasher(LAYOUT, "m", 8, head_range=(1, 3)),
        PrefixHasher(KvLayout(29, 3, 64, INT8), "m", 8),
        PrefixHasher(KvLayout(30, 6, 64, INT8), "m", 8, head_range=(0, 3)),
        PrefixHasher(KvLayout(30, 3, 128, INT8), "m", 8),
    ]
    seen = {tuple(base)}
    for h in variants:
        keys = tuple(h.block_keys(tokens))
        assert keys not in seen, h
        seen.add(keys)
    # Field boundaries are encoded: moving characters between fields does not collide.
    assert PrefixHasher(LAYOUT, "m1", 8).root != PrefixHasher(LAYOUT, "m", 18).root
    # Equal arguments, separately built: equal keys (no per-instance salt).
    assert PrefixHasher(LAYOUT, "m", 8, head_range=(0, 3)).block_keys(tokens) == base


def test_keys_are_equal_in_another_process():
    tokens = [random.Random(4).randrange(100_000) for _ in range(100)]
    here = [k.hex() for k in PrefixHasher(LAYOUT, "model-x", 16, (0, 2)).block_keys(tokens)]
    code = (
        "import json, sys\n"
        "from int8kv.cache.prefix import PrefixHasher\n"
        "from int8kv.cache.state import KvLayout\n"
        "tokens = json.loads(sys.stdin.read())\n"
        "h = PrefixHasher(KvLayout(30, 3, 64, 'int8'), 'model-x', 16, (0, 2))\n"
        "print(json.dumps([k.hex() for k in h.block_keys(tokens)]))\n"
    )
    # A different hash seed would change every Python hash(); the keys must not depend on it.
    # The child imports the same int8kv as this process, whatever the install.
    src = str(Path(int8kv.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(tokens), capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(out.stdout) == here and len(here) == 6


def test_bad_input_is_refused_with_typed_errors():
    with pytest.raises(ShapeMismatch):
        PrefixHasher((30, 3, 64), "m", 4)  # type: ignore[arg-type]
    for bad_id in ("", None, 3):
        with pytest.raises(PrefixKeyError):
            PrefixHasher(LAYOUT, bad_id, 4)  # type: ignore[arg-type]
    for bad_size in (0, -4, True, 4.0):
        with pytest.raises(ShapeMismatch):
            PrefixHasher(LAYOUT, "m", bad_size)  # type: ignore[arg-type]
    for bad_range in ((0, 0), (2, 1), (-1, 2), (0, 4), (0,), (0, 1.0), "01"):
        with pytest.raises(HeadOutOfRange):
            PrefixHasher(LAYOUT, "m", 4, head_range=bad_range)  # type: ignore[arg-type]
    h = PrefixHasher(LAYOUT, "m", 4)
    for bad_tokens in ([1, 2, 3, -1], [1, 2, 3, 2**64], [1.0, 2, 3, 4], ["a", 2, 3, 4]):
        with pytest.raises(PrefixKeyError):
            h.block_keys(bad_tokens)  # type: ignore[arg-type]
    assert h.block_keys([1, 2, 3, -1][:3]) == []  # a partial block is never hashed, so never checked
    with pytest.raises(PrefixKeyError):
        h.block_keys([1, 2, 3, 4], [h.root, h.root])  # more known keys than full blocks
    with pytest.raises(PrefixKeyError):
        h.block_keys([1, 2, 3, 4], [b"short"])
    with pytest.raises(PrefixKeyError):
        h.block_key(h.root, [1, 2, 3])
    assert issubclass(PrefixKeyError, KvCacheError) and issubclass(PrefixKeyError, ValueError)
