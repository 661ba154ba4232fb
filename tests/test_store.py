"""Save/load of KV state: bit-exact round trips, every refusal, atomic writes, fuzzing, generation equivalence.

Forged files are built with `write_raw`, an independent implementation of the documented layout
(docs/kv_file_format.md), so the refusal tests exercise one defect at a time with every digest recomputed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import (  # tests/ is on sys.path under pytest's default import mode
    DIM,
    F16,
    FORMATS,
    HEADS,
    INT8,
    LAYERS,
    assert_unchanged,
    canon,
    filled_cache,
    forge,
    read_raw,
    refuses,
    same_bits,
    snapshot,
    tensor_slice,
    write_raw,
)

from int8kv import KvCacheError, KvPoolExhausted, KvStorageFormat, QuantizedKvCache, StoreError, store
from int8kv.cache.paged import PagedKvCache
from int8kv.store import (
    ChecksumMismatch,
    CorruptKvFile,
    FingerprintError,
    HeaderShapeMismatch,
    IncompatibleCache,
    KvFileUnreadable,
    ModelFingerprint,
    ModelMismatch,
    SaveError,
    TruncatedKvFile,
    UnsupportedKvFile,
    format_inspect,
    inspect_kv,
    load_kv,
    model_fingerprint,
    save_kv,
)
from int8kv.store import save as save_module


@pytest.fixture
def int8_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.kv"
    save_kv(path, filled_cache(INT8), token_ids=list(range(100, 120)), metadata={"prompt": "hello"})
    return path


@pytest.fixture
def target() -> QuantizedKvCache:
    return filled_cache(INT8, tokens=10, seed=7)


# ---------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_contiguous_round_trip_is_bit_exact(tmp_path: Path, fmt: KvStorageFormat) -> None:
    cache = filled_cache(fmt)
    ids = torch.arange(20) * 7
    info = save_kv(tmp_path / "s.kv", cache, token_ids=ids, metadata={"prompt": "p", "n": [1, 2.5, None]})
    assert info["seq_len"] == 20 and info["storage_format"] == fmt.value
    assert info["file_bytes"] == os.path.getsize(tmp_path / "s.kv")

    # Into a cache that already holds other tokens: the file's state replaces them.
    into = filled_cache(fmt, tokens=30, capacity=40, seed=3)
    for loaded in (load_kv(tmp_path / "s.kv"), load_kv(tmp_path / "s.kv", into)):
        out = loaded.cache
        assert out.seq_len == 20 and loaded.seq_len == 20 and loaded.batch == 1 and loaded.format is fmt
        assert torch.equal(loaded.token_ids, ids.unsqueeze(0))
        assert loaded.metadata == {"prompt": "p", "n": [1, 2.5, None]}
        for a, b in zip(cache.layers, out.layers, strict=True):
            for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
                x, y = getattr(a, name), getattr(b, name)
                assert same_bits(None if x is None else x[:20], None if y is None else y[:20])
    assert into.capacity == 40  # loaded in place, not replaced


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_paged_round_trip_gathers_and_scatters(tmp_path: Path, fmt: KvStorageFormat) -> None:
    gen = torch.Generator().manual_seed(1)
    src = PagedKvCache(16, 4, LAYERS, HEADS, DIM, fmt)
    rows = {}

    def append(seq, n: int) -> None:
        slots = src.grow(seq, n) if seq in src.allocator else src.add_sequence(seq, n)
        for layer in range(LAYERS):
            k, v = torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n, HEADS, DIM, generator=gen)
            src.write_rows(layer, slots, fmt.spec.encode(k), fmt.spec.encode(v))

    # Interleaved sequences and a fork with copy-on-write: "a"'s blocks end up scattered over the pool.
    append("other", 3)
    append("a", 6)
    append("other", 5)
    src.fork("a", "b")
    append("a", 5)
    append("b", 2)
    assert src.block_table("a") != sorted(src.block_table("a")) or len(set(src.block_table("a"))) > 1
    for seq in ("a", "b"):
        rows[seq] = [src.read_rows(layer, src.slots(seq)) for layer in range(LAYERS)]
        save_kv(tmp_path / f"{seq}.kv", src, seq_id=seq)

    dst = PagedKvCache(12, 4, LAYERS, HEADS, DIM, fmt)
    dst.add_sequence("resident", 7)
    for seq, length in (("a", 11), ("b", 8)):
        loaded = load_kv(tmp_path / f"{seq}.kv", dst, seq_id=f"copy-{seq}")
        assert loaded.cache is dst and loaded.seq_id == f"copy-{seq}" and dst.context_len(f"copy-{seq}") == length
        assert not set(dst.block_table(f"copy-{seq}")) & set(dst.block_table("resident"))
        for layer in range(LAYERS):
            k, v = dst.read_rows(layer, dst.slots(f"copy-{seq}"))
            assert torch.equal(k, rows[seq][layer][0]) and torch.equal(v, rows[seq][layer][1])
        # Saved again from the new blocks, the tensor bytes are the same as from the original pool.
        save_kv(tmp_path / f"{seq}-again.kv", dst, seq_id=f"copy-{seq}")
        assert read_raw(tmp_path / f"{seq}-again.kv")[1] == read_raw(tmp_path / f"{seq}.kv")[1]


def test_every_cache_kind_stores_the_same_bytes(tmp_path: Path) -> None:
    cache = filled_cache(INT8)
    save_kv(tmp_path / "q.kv", cache)
    paged = PagedKvCache(8, 4, LAYERS, HEADS, DIM, INT8)
    load_kv(tmp_path / "q.kv", paged, seq_id=0)
    save_kv(tmp_path / "p.kv", paged, seq_id=0)
    (hq, dq), (hp, dp) = read_raw(tmp_path / "q.kv"), read_raw(tmp_path / "p.kv")
    assert dq == dp and hq["__metadata__"]["data_sha256"] == hp["__metadata__"]["data_sha256"]
    assert (hq["__metadata__"]["source"], hp["__metadata__"]["source"]) == ("QuantizedKvCache", "PagedKvCache")


def test_empty_state_round_trips(tmp_path: Path) -> None:
    save_kv(tmp_path / "e.kv", QuantizedKvCache(LAYERS, 4, HEADS, DIM), token_ids=[])
    loaded = load_kv(tmp_path / "e.kv")
    assert loaded.seq_len == 0 and loaded.cache.seq_len == 0 and loaded.token_ids.shape == (1, 0)


def test_file_is_plain_safetensors(int8_file: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(int8_file)
    assert tensors["k_codes"].shape == (LAYERS, 1, 20, HEADS, DIM) and tensors["k_codes"].dtype == torch.int8
    assert torch.equal(tensors["token_ids"][0], torch.arange(100, 120))
    assert torch.equal(tensors["k_codes"][1, 0], filled_cache(INT8).layers[1].k_codes[:20])


def test_inspect(int8_file: Path) -> None:
    info = inspect_kv(int8_file)
    assert info["format"] == "int8kv.kv_state" and info["format_version"] == 1
    assert (info["num_layers"], info["batch"], info["seq_len"], info["num_kv_heads"], info["head_dim"]) == (
        LAYERS,
        1,
        20,
        HEADS,
        DIM,
    )
    assert info["kv_bytes"] == 20 * INT8.bytes_per_token(LAYERS, HEADS, DIM)
    assert info["f16_kv_bytes"] == 20 * F16.bytes_per_token(LAYERS, HEADS, DIM)
    assert info["token_ids"] == [list(range(100, 120))] and info["metadata"] == {"prompt": "hello"}
    assert info["model"] is None and info["file_bytes"] == os.path.getsize(int8_file)
    text = format_inspect(info)
    for needle in ("int8kv.kv_state v1", "int8_per_token_head_f32_scale_v1", "20 tokens", "100 101", "hello"):
        assert needle in text
    json.dumps(info)  # what the CLI may print with --json


# ---------------------------------------------------------------------------------------------------------
# refusals: format, version, model
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("format", "llama.cpp.session", "not an int8kv"),
        ("format_version", "3", "version '3' is not supported"),
        ("storage_format", "int4_v9", "unknown KV storage format"),
    ],
)
def test_unknown_format_or_version_is_refused(int8_file, tmp_path, target, key, value, message) -> None:
    bad = forge(int8_file, tmp_path / "bad.kv", lambda h: h["__metadata__"].__setitem__(key, value))
    err = refuses(bad, target, UnsupportedKvFile)
    assert message in str(err)


def test_other_safetensors_file_is_refused(tmp_path, target) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(3)}, tmp_path / "model.safetensors")
    refuses(tmp_path / "model.safetensors", target, UnsupportedKvFile)


def tiny_llama(seed: int = 0, layers: int = LAYERS):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=DIM,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def test_fingerprint() -> None:
    a, a_again, b = tiny_llama(0), tiny_llama(0), tiny_llama(1)
    fa = model_fingerprint(a)
    assert fa == model_fingerprint(a_again) and fa.weights.startswith("sha256:")
    assert (fa.num_layers, fa.num_kv_heads, fa.head_dim, fa.vocab_size) == (LAYERS, HEADS, DIM, 97)
    assert fa.differences(model_fingerprint(b)) == [f"weights: {fa.weights!r} != {model_fingerprint(b).weights!r}"]
    assert model_fingerprint(a.config).weights is None
    assert model_fingerprint(a, weights_id="smol-v1").weights == "id:smol-v1"
    assert model_fingerprint(a.config, weights_id="x") == model_fingerprint(a, weights_id="x")
    assert ModelFingerprint.from_dict(fa.to_dict()) == fa
    # Switching the attention implementation (what Int8KvCache(config) does) is not a different model.
    a.config._attn_implementation = "eager"
    assert model_fingerprint(a) == fa
    other_rope = tiny_llama(0)
    other_rope.config.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    assert model_fingerprint(other_rope).config_sha256 != fa.config_sha256
    with pytest.raises(FingerprintError):
        model_fingerprint(object())
    with pytest.raises(FingerprintError):
        ModelFingerprint.from_dict({**fa.to_dict(), "num_layers": "3"})
    with torch.device("meta"):
        meta_model = type(a)(a.config)
    with pytest.raises(FingerprintError, match="meta"):
        model_fingerprint(meta_model)


def test_model_mismatch_is_refused(tmp_path, target) -> None:
    a, b = tiny_llama(0), tiny_llama(1)
    fa, fb = model_fingerprint(a), model_fingerprint(b)
    cache = filled_cache(INT8)
    save_kv(tmp_path / "a.kv", cache, model=fa, token_ids=list(range(20)))
    assert inspect_kv(tmp_path / "a.kv")["model"] == fa.to_dict()
    err = refuses(tmp_path / "a.kv", target, ModelMismatch, model=fb)
    assert "weights" in str(err)
    refuses(tmp_path / "a.kv", target, ModelMismatch, model=a.config)  # no weight hash on this side
    refuses(tmp_path / "a.kv", target, ModelMismatch, model=b)
    assert load_kv(tmp_path / "a.kv", target, model=a).cache.seq_len == 20
    assert load_kv(tmp_path / "a.kv", model=fa.to_dict()).seq_len == 20  # the dict from inspect_kv works too

    save_kv(tmp_path / "id.kv", cache, model=a.config, weights_id="run-1")
    load_kv(tmp_path / "id.kv", model=b.config, weights_id="run-1")  # the caller vouches for the weights
    refuses(tmp_path / "id.kv", target, ModelMismatch, model=a.config, weights_id="run-2")

    save_kv(tmp_path / "none.kv", cache)
    err = refuses(tmp_path / "none.kv", target, ModelMismatch, model=fa)
    assert "model=None" in str(err)

    with pytest.raises(ModelMismatch):  # a model with other shapes cannot have produced this cache
        save_kv(tmp_path / "x.kv", cache, model=tiny_llama(0, layers=2))
    with pytest.raises(SaveError):  # token ids beyond the model's vocabulary
        save_kv(tmp_path / "x.kv", cache, model=fa, token_ids=[200] * 20)


# ---------------------------------------------------------------------------------------------------------
# refusals: shapes, truncation, corruption, forged sizes
# ---------------------------------------------------------------------------------------------------------
def _reshape_codes(h: dict) -> None:
    h["k_codes"]["shape"] = [LAYERS, 1, 20, HEADS * 2, DIM // 2]  # same byte count, other shape


def _seq_len_19(h: dict) -> None:
    h["__metadata__"]["seq_len"] = "19"


def _heads_1(h: dict) -> None:
    h["__metadata__"]["num_kv_heads"] = "1"


def _drop_scales(h: dict) -> None:
    del h["v_scales"]


def _codes_as_f16(h: dict) -> None:
    h["k_codes"]["dtype"] = "F16"


def _fingerprint_layers(h: dict) -> None:
    fp = model_fingerprint(tiny_llama(0), weights_id="x").to_dict()
    h["__metadata__"]["model"] = canon({**fp, "num_layers": LAYERS + 1}).decode()


@pytest.mark.parametrize(
    "mutate", [_reshape_codes, _seq_len_19, _heads_1, _drop_scales, _codes_as_f16, _fingerprint_layers]
)
def test_shapes_that_do_not_match_the_header_are_refused(int8_file, tmp_path, target, mutate) -> None:
    refuses(forge(int8_file, tmp_path / "bad.kv", mutate), target, HeaderShapeMismatch)


def test_every_truncation_is_refused(int8_file, tmp_path, target) -> None:
    raw = int8_file.read_bytes()
    (n_header,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + n_header
    # Every length around the boundaries (length field, header, each tensor), a stride elsewhere; the
    # hypothesis test below draws the others.
    header, _ = read_raw(int8_file)
    edges = {0, 8, data_start, len(raw)} | {data_start + t["data_offsets"][0] for k, t in header.items() if k[0] != "_"}
    lengths = {n for e in edges for n in range(e - 3, e + 4)} | set(range(0, len(raw), 11))
    cut = tmp_path / "cut.kv"
    for n in sorted(x for x in lengths if 0 <= x < len(raw)):
        cut.write_bytes(raw[:n])
        refuses(cut, target, TruncatedKvFile)


def test_corrupted_bytes_are_refused(int8_file, tmp_path, target) -> None:
    raw = bytearray(int8_file.read_bytes())
    header, _ = read_raw(int8_file)
    data_start = len(raw) - header["v_codes"]["data_offsets"][1]
    bad = tmp_path / "bad.kv"
    for offset, error in ((data_start + 3, ChecksumMismatch), (len(raw) - 1, ChecksumMismatch)):
        flipped = bytearray(raw)
        flipped[offset] ^= 0x10
        bad.write_bytes(flipped)
        refuses(bad, target, error)
    # Inside the header: the metadata string "hello" -> "hellm" stays valid, canonical JSON.
    pos = raw.index(b"hello")
    flipped = bytearray(raw)
    flipped[pos + 4] ^= 0x02
    bad.write_bytes(flipped)
    refuses(bad, target, ChecksumMismatch)
    # Data changed and its digest recomputed, but not the header's digest over it.
    header, data = read_raw(int8_file)
    header["__metadata__"]["data_sha256"] = hashlib.sha256(data[:-1] + b"\x00").hexdigest()
    write_raw(bad, header, data[:-1] + b"\x00", rehash=False)
    refuses(bad, target, ChecksumMismatch)


def test_non_canonical_or_padded_differently_header_is_refused(int8_file, tmp_path, target) -> None:
    header, data = read_raw(int8_file)
    body = json.dumps(header, sort_keys=True, indent=1).encode()
    body += b" " * (-(8 + len(body)) % 8)
    bad = tmp_path / "bad.kv"
    bad.write_bytes(struct.pack("<Q", len(body)) + body + data)
    refuses(bad, target, CorruptKvFile)
    raw = int8_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    extra = b" " * 8  # padding must stay below 8 bytes
    bad.write_bytes(struct.pack("<Q", n + 8) + raw[8 : 8 + n] + extra + raw[8 + n :])
    refuses(bad, target, CorruptKvFile)


def test_trailing_bytes_are_refused(int8_file, tmp_path, target) -> None:
    (tmp_path / "bad.kv").write_bytes(int8_file.read_bytes() + b"\0")
    refuses(tmp_path / "bad.kv", target, CorruptKvFile)


def _huge(h: dict) -> None:
    # A consistent header (shapes, offsets, digests) for a billion tokens, over a file of a few KB.
    tokens = 10**9
    m = h["__metadata__"]
    m["seq_len"] = str(tokens)
    offset = 0
    for name in ("token_ids", "k_scales", "v_scales", "k_codes", "v_codes"):
        shape = h[name]["shape"]
        shape[-1 if name == "token_ids" else 2] = tokens
        size = {"token_ids": 8, "k_scales": 4, "v_scales": 4}.get(name, 1)
        for d in shape:
            size *= d
        h[name]["data_offsets"] = [offset, offset + size]
        offset += size


def test_sizes_larger_than_the_file_are_refused_before_allocating(int8_file, tmp_path, target) -> None:
    bad = forge(int8_file, tmp_path / "bad.kv", _huge)
    tracemalloc.start()
    try:
        err = refuses(bad, target, TruncatedKvFile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a forged header"
    assert "describes" in str(err)
    raw = int8_file.read_bytes()
    for claimed, error in (
        (2**63, CorruptKvFile),
        (len(raw), TruncatedKvFile),
        (store.MAX_HEADER_BYTES + 1, CorruptKvFile),
    ):
        bad.write_bytes(struct.pack("<Q", claimed) + raw[8:])
        refuses(bad, target, error)


def test_header_size_is_capped(tmp_path, target) -> None:
    with pytest.raises(SaveError, match="metadata too large"):
        save_kv(tmp_path / "x.kv", filled_cache(INT8), metadata={"blob": "x" * store.MAX_HEADER_BYTES})
    # The worst header for json.loads (a container every 3 bytes) at the cap: memory stays bounded.
    body = b"[" + b"[]," * (store.MAX_HEADER_BYTES // 3 - 2) + b"[]]"
    body += b" " * (-(8 + len(body)) % 8)
    (tmp_path / "bad.kv").write_bytes(struct.pack("<Q", len(body)) + body)
    tracemalloc.start()
    try:
        refuses(tmp_path / "bad.kv", target, UnsupportedKvFile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize(
    ("fmt", "name", "value"),
    [
        (INT8, "k_codes", struct.pack("<b", -128)),
        (INT8, "v_scales", struct.pack("<f", float("nan"))),
        (INT8, "k_scales", struct.pack("<f", 0.0)),
        (INT8, "token_ids", struct.pack("<q", -5)),
        (F16, "v_codes", struct.pack("<e", float("inf"))),
    ],
)
def test_values_no_writer_produces_are_refused(tmp_path, fmt, name, value) -> None:
    src = tmp_path / "src.kv"
    save_kv(src, filled_cache(fmt), token_ids=list(range(20)))

    def poke(header: dict, data: bytearray) -> bytearray:
        tensor_slice(header, name, data)[: len(value)] = value
        return data

    refuses(forge(src, tmp_path / "bad.kv", data_fn=poke), filled_cache(fmt, tokens=5, seed=2), CorruptKvFile)


def test_missing_file_or_directory(tmp_path, target) -> None:
    err = refuses(tmp_path / "nope.kv", target, KvFileUnreadable)
    assert isinstance(err, OSError) and isinstance(err, StoreError)
    refuses(tmp_path, target, KvFileUnreadable)


# ---------------------------------------------------------------------------------------------------------
# refusals: the target cache
# ---------------------------------------------------------------------------------------------------------
def test_incompatible_contiguous_target_is_refused(int8_file, target) -> None:
    refuses(int8_file, QuantizedKvCache(LAYERS, 32, HEADS, DIM, F16), IncompatibleCache)
    refuses(int8_file, QuantizedKvCache(LAYERS, 32, HEADS + 1, DIM), IncompatibleCache)
    refuses(int8_file, QuantizedKvCache(LAYERS + 1, 32, HEADS, DIM), IncompatibleCache)
    small = QuantizedKvCache(LAYERS, 19, HEADS, DIM)
    assert "capacity" in str(refuses(int8_file, small, IncompatibleCache))
    with pytest.raises(IncompatibleCache):
        load_kv(int8_file, target, seq_id="x")
    with pytest.raises(IncompatibleCache):
        load_kv(int8_file, object())


def test_incompatible_paged_target_is_refused(int8_file) -> None:
    pool = PagedKvCache(6, 4, LAYERS, HEADS, DIM, INT8)
    pool.add_sequence("s", 6)
    free = pool.num_free_blocks
    with pytest.raises(IncompatibleCache, match="already exists"):
        load_kv(int8_file, pool, seq_id="s")
    with pytest.raises(IncompatibleCache, match="seq_id"):
        load_kv(int8_file, pool)
    with pytest.raises(KvPoolExhausted):  # 20 tokens need 5 blocks, 4 are free
        load_kv(int8_file, pool, seq_id="t")
    with pytest.raises(IncompatibleCache):
        load_kv(int8_file, PagedKvCache(8, 4, LAYERS, HEADS, DIM, F16), seq_id="t")
    assert pool.num_free_blocks == free and "t" not in pool.allocator and pool.context_len("s") == 6


def test_save_refuses_bad_input(tmp_path) -> None:
    cache = filled_cache(INT8)
    for kwargs in (
        {"token_ids": list(range(19))},
        {"token_ids": [0.5] * 20},
        {"metadata": {"x": object()}},
        {"metadata": {"x": float("nan")}},
        {"seq_id": 1},
    ):
        with pytest.raises(SaveError):
            save_kv(tmp_path / "x.kv", cache, **kwargs)
    with pytest.raises(SaveError):
        save_kv(tmp_path / "x.kv", {"k": torch.zeros(1)})
    with pytest.raises(SaveError):
        save_kv(tmp_path / "x.kv", PagedKvCache(4, 4, LAYERS, HEADS, DIM))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------------------
def test_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch) -> None:
    path = tmp_path / "s.kv"
    save_kv(path, filled_cache(INT8), metadata={"v": 1})
    old = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk went away"):
        save_kv(path, filled_cache(F16), metadata={"v": 2})
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["s.kv"]
    monkeypatch.undo()

    # A crash in the middle of writing the tensors (after the header went out): save.raw_bytes feeds the
    # file writer one tensor at a time (the hashing before it goes through format's).
    calls = {"n": 0}
    real = save_module.raw_bytes

    def interrupted(t):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(save_module, "raw_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_kv(tmp_path / "new.kv", filled_cache(INT8))
    assert calls["n"] == 3 and [p.name for p in tmp_path.iterdir()] == ["s.kv"]
    assert load_kv(path).metadata == {"v": 1}


def test_save_fsyncs_file_then_renames_then_fsyncs_directory(tmp_path, monkeypatch) -> None:
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        return real_fsync(fd)

    def replace(a, b):
        events.append("replace")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_kv(tmp_path / "s.kv", filled_cache(INT8))
    if os.path.isdir("/proc/self/fd"):
        assert events == ["fsync-file", "replace", "fsync-dir"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "s.kv").stat().st_mode & 0o777 == 0o666 & ~umask


# ---------------------------------------------------------------------------------------------------------
# fuzzing: nothing but KvCacheError, the target untouched, no allocation beyond the file
# ---------------------------------------------------------------------------------------------------------
_FUZZ_DIR = Path(tempfile.mkdtemp(prefix="int8kv-store-fuzz-"))
atexit.register(shutil.rmtree, _FUZZ_DIR, ignore_errors=True)
_VALID = _FUZZ_DIR / "valid.kv"
save_kv(_VALID, filled_cache(INT8, tokens=10), token_ids=list(range(10)), metadata={"m": "x"})
_VALID_BYTES = _VALID.read_bytes()
_FUZZ_TARGET = filled_cache(INT8, tokens=5, seed=9)
_FUZZ_BEFORE = snapshot(_FUZZ_TARGET)


def _load(raw: bytes) -> KvCacheError | None:
    """Load `raw` into the shared target: only a KvCacheError may come out, and then the target is unchanged;
    nothing is allocated beyond a few times the file's size."""
    path = _FUZZ_DIR / "fuzz.kv"
    path.write_bytes(raw)
    tracemalloc.start()
    error = None
    try:
        load_kv(path, _FUZZ_TARGET)
    except KvCacheError as exc:
        error = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(raw) + (2 << 20), f"{peak} bytes allocated for a {len(raw)}-byte file"
    if error is None:  # a valid file after all: put the target back for the next example
        for layer, (n, *tensors) in zip(_FUZZ_TARGET.layers, _FUZZ_BEFORE, strict=True):
            for name, t in zip(("k_codes", "v_codes", "k_scales", "v_scales"), tensors, strict=True):
                getattr(layer, name).copy_(t)
            layer.seq_len = n
    assert_unchanged(_FUZZ_TARGET, _FUZZ_BEFORE)
    return error


def _load_must_refuse(raw: bytes) -> KvCacheError:
    error = _load(raw)
    assert error is not None, "a damaged file loaded"
    return error


@settings(max_examples=200)
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(raw: bytes) -> None:
    _load_must_refuse(raw)


@settings(max_examples=200)
@given(st.integers(0, (1 << 64) - 1), st.binary(max_size=512))
def test_fuzz_random_header_length(n: int, rest: bytes) -> None:
    _load_must_refuse(struct.pack("<Q", n) + rest)


@settings(max_examples=200)
@given(st.integers(0, len(_VALID_BYTES) - 1))
def test_fuzz_truncation(n: int) -> None:
    assert isinstance(_load_must_refuse(_VALID_BYTES[:n]), TruncatedKvFile)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, len(_VALID_BYTES) - 1), st.integers(0, 7)), min_size=1, max_size=4))
def test_fuzz_bit_flips(flips: list[tuple[int, int]]) -> None:
    raw = bytearray(_VALID_BYTES)
    for pos, bit in flips:
        raw[pos] ^= 1 << bit
    if raw != _VALID_BYTES:  # two flips of the same bit cancel out
        _load_must_refuse(bytes(raw))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_VALID_HEADER, _VALID_DATA = read_raw(_VALID)


@settings(max_examples=200)
@given(st.data(), _JSON, st.booleans())
def test_fuzz_header_values(data, value, rehash: bool) -> None:
    """Any JSON value in any header slot, digests recomputed or not, so the structure checks are reached."""
    header = json.loads(json.dumps(_VALID_HEADER))
    key = data.draw(st.sampled_from(sorted(header)))
    slot = data.draw(st.sampled_from([None, *sorted(header[key])]))
    if slot is None:
        header[key] = value
    elif key == "__metadata__" and data.draw(st.booleans()):
        header[key][slot] = json.dumps(value)  # metadata values are strings, some of them JSON (model, metadata)
    else:
        header[key][slot] = value
    path = _FUZZ_DIR / "forged.kv"
    try:
        write_raw(path, header, _VALID_DATA, rehash=rehash)
    except (ValueError, TypeError, AttributeError, KeyError):  # the test's own writer cannot build this header
        return
    error = _load(path.read_bytes())
    # Free-form fields (created_by, source, metadata) may legitimately change when the digests are redone;
    # everything else, and any change without new digests, must be refused.
    free_form = key == "__metadata__" and slot in ("created_by", "source", "metadata") and rehash
    assert error is not None or header == _VALID_HEADER or free_form


# ---------------------------------------------------------------------------------------------------------
# transformers drop-in: tiny random model (fast) and SmolLM2 (the real thing)
# ---------------------------------------------------------------------------------------------------------
def _hf():
    return pytest.importorskip("int8kv.hf")


def prefill(model, ids: torch.Tensor, fmt: KvStorageFormat):
    cache = _hf().Int8KvCache(model.config, fmt)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def hf_storage(cache) -> list[tuple]:
    """Per layer (k_codes, v_codes, k_scales, v_scales) of the stored tokens, through the public export."""
    state = cache.export_state()
    groups = (state.k_codes, state.v_codes, state.k_scales, state.v_scales)
    return [tuple(None if g is None else g[i] for g in groups) for i in range(state.layout.num_layers)]


def generate(model, ids: torch.Tensor, cache, new_tokens: int = 6) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)


def count_fed_tokens(model):
    fed: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].shape[-1]))
    return fed, handle


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_int8kvcache_round_trip_and_generation(tmp_path, fmt) -> None:
    model = tiny_llama(0)
    fp = model_fingerprint(model)
    gen = torch.Generator().manual_seed(5)
    prefix, suffix = torch.randint(0, 97, (1, 24), generator=gen), torch.randint(0, 97, (1, 5), generator=gen)
    original = prefill(model, prefix, fmt)
    save_kv(tmp_path / "p.kv", original, model=fp, token_ids=prefix)

    restored = _hf().Int8KvCache(model.config, fmt)
    loaded = load_kv(tmp_path / "p.kv", restored, model=fp)
    assert loaded.cache is restored and restored.get_seq_length() == 24
    assert torch.equal(loaded.token_ids, prefix)
    for a, b in zip(hf_storage(original), hf_storage(restored), strict=True):
        assert all(same_bits(x, y) for x, y in zip(a, b, strict=True))

    # A config-less cache creates its layers on load.
    lazy = load_kv(tmp_path / "p.kv", _hf().Int8KvCache(None, fmt), model=fp).cache
    assert len(lazy.layers) == LAYERS and lazy.get_seq_length() == 24

    ids = torch.cat([loaded.token_ids, suffix], dim=1)
    expected = generate(model, ids, original)
    fed, handle = count_fed_tokens(model)
    try:
        got = generate(model, ids, restored)
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert fed[0] == suffix.shape[1]  # the saved prefix was not prefilled again
    assert restored.attention_calls > 0  # and the int8kv kernels served the restored cache


def test_int8kvcache_refusals_leave_it_untouched(tmp_path) -> None:
    model = tiny_llama(0)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = prefill(model, ids, INT8)
    save_kv(tmp_path / "batch2.kv", cache, token_ids=ids)
    assert load_kv(tmp_path / "batch2.kv", _hf().Int8KvCache(model.config)).batch == 2
    with pytest.raises(IncompatibleCache, match="batch"):
        load_kv(tmp_path / "batch2.kv", QuantizedKvCache(LAYERS, 16, HEADS, DIM))

    victim = prefill(model, ids[:1, :4], INT8)
    before = hf_storage(victim)
    save_kv(tmp_path / "f16.kv", prefill(model, ids[:1], F16))
    for path, target_cache in (
        (tmp_path / "f16.kv", victim),
        (tmp_path / "batch2.kv", _hf().Int8KvCache(tiny_llama(0, layers=2).config)),
    ):
        with pytest.raises(IncompatibleCache):
            load_kv(path, target_cache)
    assert victim.get_seq_length() == 4
    for a, b in zip(before, hf_storage(victim), strict=True):
        assert all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(SaveError, match="holds nothing"):
        save_kv(tmp_path / "x.kv", _hf().Int8KvCache(model.config))


@pytest.mark.slow
def test_smollm2_generation_from_a_loaded_prefix_is_identical(tmp_path, smollm2) -> None:
    model, tokenizer = smollm2
    fp = model_fingerprint(model)
    prefix = tokenizer(
        "You are a terse assistant. Answer with one word when you can. The capital of France is Paris. "
        "The capital of Italy is Rome. The capital of Spain is",
        return_tensors="pt",
    ).input_ids
    question = tokenizer(" Madrid. The capital of Germany is", return_tensors="pt").input_ids
    original = prefill(model, prefix, INT8)
    info = save_kv(tmp_path / "smol.kv", original, model=fp, token_ids=prefix, metadata={"prompt": "capitals"})
    assert info["kv_bytes"] * 2 < info["f16_kv_bytes"] * 1.1  # INT8 rows: 64 + 4 bytes vs 128
    restored = load_kv(tmp_path / "smol.kv", _hf().Int8KvCache(model.config), model=fp)
    ids = torch.cat([restored.token_ids, question], dim=1)
    expected = generate(model, ids, original, new_tokens=4)
    fed, handle = count_fed_tokens(model)
    try:
        got = generate(model, ids, restored.cache, new_tokens=4)
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert fed[0] == question.shape[1]
    wrong = model_fingerprint(model, weights_id="another-checkpoint")
    with pytest.raises(ModelMismatch):
        load_kv(tmp_path / "smol.kv", _hf().Int8KvCache(model.config), model=wrong)
