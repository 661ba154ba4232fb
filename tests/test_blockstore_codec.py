"""The block value codec (docs/block_store.md): bit-exact round trips, and every refusal typed."""

from __future__ import annotations

import random
import struct

import pytest
import torch
import xxhash
from blockstore_helpers import F16, FIELDS, FIXED, INT8, blocks, key_chain, random_state, reframe, small_spec

from int8kv.blockstore import (
    BlockEncodeError,
    BlockSpec,
    BlockValueError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockValues,
    InvalidStoreSecret,
    MisplacedBlock,
    NewerBlock,
    UnauthenticatedBlock,
    UnsupportedBlock,
    assemble_blocks,
    decode_block,
    encode_block,
    read_header,
    verify_block,
)
from int8kv.cache.state import KvLayout
from int8kv.codec import quantize_int8_torch

KEY = bytes(range(32))  # the block key every single-block value here is stored under


def decode(spec, value, tokens=None, key=KEY, secret=None):
    return decode_block(spec, value, key, tokens, secret)


@pytest.mark.parametrize("fmt", [INT8, F16])
@pytest.mark.parametrize("seed", range(6))
def test_round_trip_is_bit_exact_on_ragged_shapes(fmt, seed):
    rng = random.Random(seed)
    layout = KvLayout(rng.randint(1, 4), rng.randint(1, 5), rng.choice([1, 3, 7, 16, 64]), fmt)
    spec = BlockSpec(layout, rng.randint(1, 9), f"model-{seed}", head_start=rng.randint(0, 6))
    whole = random_state(layout, 3 * spec.block_size + 1, seed)
    for start in range(0, whole.length, spec.block_size):
        part = whole.slice(start, min(start + spec.block_size, whole.length))  # views, last one partial
        value = encode_block(spec, part, KEY)
        assert len(value) == spec.value_bytes(part.length)
        back = decode(spec, value, tokens=part.length)
        assert back.equal(part)
        header = read_header(value)
        assert (header.head_start, header.head_end, header.tokens) == (spec.head_start, spec.head_end, part.length)
        assert header.fingerprint == f"model-{seed}" and header.format_name == fmt.value


def test_decoded_state_owns_its_memory():
    spec = small_spec()
    state, values = blocks(spec, 1, seed=3, keys=[KEY])
    a = decode(spec, values[0])
    a.k_codes[0].zero_()
    assert decode(spec, values[0]).equal(state)


def test_payload_bytes_per_token_int8_vs_f16():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; the payload is exactly bytes_per_token per token.
    dims = (30, 3, 64)
    int8 = BlockSpec(KvLayout(*dims, INT8), 16, "m")
    f16 = BlockSpec(KvLayout(*dims, F16), 16, "m")
    assert int8.payload_bytes(16) == 16 * 2 * 30 * 3 * (64 + 4)
    assert f16.payload_bytes(16) == 16 * 2 * 30 * 3 * 64 * 2
    ratio = int8.value_bytes() / f16.value_bytes()
    assert abs(ratio - 68 / 128) < 1e-3


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_any_flipped_byte_is_refused(fmt):
    spec = small_spec(fmt)
    _, (value,) = blocks(spec, 1, seed=1, keys=[KEY])
    rng = random.Random(0)
    header_len = read_header(value).header_len
    positions = list(range(header_len)) + rng.sample(range(header_len, len(value)), 40) + [len(value) - 1]
    for pos in positions:
        damaged = bytearray(value)
        damaged[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(BlockValueError):
            decode(spec, bytes(damaged))


def test_truncated_or_extended_values_are_corrupt():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=2, keys=[KEY])
    for cut in [0, 1, 8, 47, 63, len(value) // 2, len(value) - 16, len(value) - 1]:
        with pytest.raises(CorruptBlock):
            decode(spec, value[:cut])
    with pytest.raises(CorruptBlock):
        decode(spec, value + b"\0")


def test_bad_magic_wrong_version_and_unknown_format_with_valid_checksum():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=4, keys=[KEY])
    with pytest.raises(CorruptBlock, match="magic"):
        decode(spec, reframe(value, magic=b"I8KVBLK\x01"))
    with pytest.raises(NewerBlock, match="version 4"):
        decode(spec, reframe(value, version=4))
    # Version 3 (several K/V shapes) is known: a one-shape value relabelled so is refused by its framing.
    with pytest.raises(CorruptBlock, match="2..64 groups"):
        decode(spec, reframe(value, version=3))
    with pytest.raises(UnsupportedBlock, match="version 1") as older:
        decode(spec, reframe(value, version=1))
    assert not isinstance(older.value, NewerBlock)
    with pytest.raises(UnsupportedBlock, match="version 7"):
        decode(spec, reframe(value, storage_version=7))

    def rename(buf, _):
        buf[56:60] = b"f32_"  # the storage format name starts right after the fixed header

    with pytest.raises(UnsupportedBlock, match="unknown storage format"):
        decode(spec, reframe(value, rename))


def test_wrong_fingerprint_head_range_layout_or_block_size_is_incompatible():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=5, keys=[KEY])
    others = [
        small_spec(fingerprint="another-model"),
        BlockSpec(spec.layout, spec.block_size, spec.fingerprint, head_start=2),
        BlockSpec(KvLayout(3, 2, 8, INT8), spec.block_size, spec.fingerprint),
        BlockSpec(KvLayout(2, 2, 8, F16), spec.block_size, spec.fingerprint),
        small_spec(block_size=8),
    ]
    for other in others:
        with pytest.raises(IncompatibleBlock):
            decode(other, value)
    with pytest.raises(IncompatibleBlock, match="tokens"):
        decode(spec, value, tokens=3)


def test_forged_sizes_are_refused_before_any_allocation():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=6, keys=[KEY])
    header = read_header(value)
    # A header announcing more payload than the value holds, or a huge one, with a valid checksum.
    with pytest.raises(CorruptBlock, match="announces"):
        decode(spec, reframe(value, payload_len=header.payload_len + 8))
    with pytest.raises(CorruptBlock, match="announces"):
        decode(spec, reframe(value, payload_len=2**63))
    # Dimensions of a huge model: refused by comparison with the spec, nothing sized from them.
    with pytest.raises(IncompatibleBlock):
        decode(spec, reframe(value, num_layers=2**31, head_dim=2**31))
    with pytest.raises(CorruptBlock, match="token count"):
        decode(spec, reframe(value, tokens=spec.block_size + 1), tokens=spec.block_size + 1)
    with pytest.raises(CorruptBlock, match="header length"):
        decode(spec, reframe(value, header_len=header.header_len + 3))
    with pytest.raises(CorruptBlock, match="header length"):
        decode(spec, reframe(value, fp_len=255))


def _patch_at(offset: int, raw: bytes):
    def patch(buf, header_len):
        buf[header_len + offset : header_len + offset + len(raw)] = raw

    return patch


@pytest.mark.parametrize(
    "bad",
    [float("nan"), 0.0, -1.0, float("inf"), 65504 / 127 * 1.001, 1e30],
)
def test_int8_scales_outside_the_encoder_range_are_invalid(bad):
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=7, keys=[KEY])
    # v_scales start after k_scales ([L, T, H] float32): check both groups.
    n_scales = spec.layout.num_layers * spec.block_size * spec.layout.num_kv_heads
    for offset in (4 * 5, 4 * (n_scales + 3)):
        with pytest.raises(InvalidBlockValues, match="scale"):
            decode(spec, reframe(value, _patch_at(offset, struct.pack("<f", bad))))


def test_int8_code_minus_128_is_invalid_and_the_largest_scale_is_valid():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=8, keys=[KEY])
    scales_bytes = 2 * 4 * spec.layout.num_layers * spec.block_size * spec.layout.num_kv_heads
    codes_bytes = spec.layout.num_layers * spec.block_size * spec.layout.num_kv_heads * spec.layout.head_dim
    for offset in (scales_bytes + 11, scales_bytes + codes_bytes + 2):  # one K code, one V code
        with pytest.raises(InvalidBlockValues, match="-128"):
            decode(spec, reframe(value, _patch_at(offset, b"\x80")))
    # The largest scale the encoder produces (a row holding 65504) is accepted.
    x = torch.full((1, 1, 1, 8), 65504.0)
    _, top = quantize_int8_torch(x)
    ok = reframe(value, _patch_at(0, struct.pack("<f", float(top.reshape(-1)[0]))))
    assert float(decode(spec, ok).k_scales[0][0, 0, 0]) == float(top.reshape(-1)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_f16_non_finite_values_are_invalid(bad):
    spec = small_spec(F16)
    _, (value,) = blocks(spec, 1, seed=9, keys=[KEY])
    codes_bytes = 2 * spec.layout.num_layers * spec.block_size * spec.layout.num_kv_heads * spec.layout.head_dim
    for offset in (6, codes_bytes + 10):
        patch = _patch_at(offset, torch.tensor([bad], dtype=torch.float16).view(torch.uint8).numpy().tobytes())
        with pytest.raises(InvalidBlockValues, match="NaN or inf"):
            decode(spec, reframe(value, patch))


def test_encode_refuses_states_that_are_not_one_block_of_the_spec():
    spec = small_spec()
    state = random_state(spec.layout, 2 * spec.block_size, seed=10)
    with pytest.raises(BlockEncodeError, match="1..4 tokens"):
        encode_block(spec, state, KEY)
    with pytest.raises(BlockEncodeError, match="layout"):
        encode_block(small_spec(F16), state.slice(0, 4), KEY)
    batch2 = random_state(spec.layout, 4, seed=11)
    doubled = type(batch2).build(
        spec.layout,
        [torch.cat([t, t]) for t in batch2.k_codes],
        [torch.cat([t, t]) for t in batch2.v_codes],
        [torch.cat([t, t]) for t in batch2.k_scales],
        [torch.cat([t, t]) for t in batch2.v_scales],
    )
    with pytest.raises(BlockEncodeError, match="batch 2"):
        encode_block(spec, doubled, KEY)
    with pytest.raises(BlockEncodeError):
        encode_block(spec, "not a state", KEY)


@pytest.mark.parametrize(
    "kwargs",
    [{"block_size": 0}, {"block_size": True}, {"head_start": -1}, {"fingerprint": ""}, {"fingerprint": "x" * 256}],
)
def test_spec_refuses_bad_fields(kwargs):
    args = {"layout": KvLayout(2, 2, 8, INT8), "block_size": 4, "fingerprint": "m", **kwargs}
    with pytest.raises(BlockEncodeError):
        BlockSpec(**args)


def test_assemble_blocks_concatenates_verified_blocks_in_order():
    spec = small_spec()
    state, values = blocks(spec, 5, seed=12)
    for k, v in zip(key_chain(5, seed=12), values, strict=True):
        verify_block(spec, v, k)
    assert assemble_blocks(spec, values).equal(state)
    assert assemble_blocks(spec, values[1:3]).equal(state.slice(4, 12))
    with pytest.raises(BlockEncodeError):
        assemble_blocks(spec, [])


def test_header_with_extra_padding_is_refused():
    spec = small_spec()
    _, (value,) = blocks(spec, 1, seed=13, keys=[KEY])
    header_len = read_header(value).header_len
    padded = bytearray(value[:header_len]) + bytes(8) + value[header_len:-16]
    FIXED.pack_into(padded, 0, *[header_len + 8 if f == "header_len" else v
                                 for f, v in zip(FIELDS, FIXED.unpack_from(padded, 0), strict=True)])
    forged = bytes(padded) + xxhash.xxh3_128_digest(bytes(padded))
    with pytest.raises(CorruptBlock, match="header length"):
        decode(spec, forged)


def test_a_value_is_bound_to_its_key():
    spec = small_spec()
    state, values = blocks(spec, 2, seed=14)
    keys = key_chain(2, seed=14)
    assert decode(spec, values[1], key=keys[1]).equal(state.slice(4, 8))
    assert read_header(values[1]).key == keys[1]
    with pytest.raises(MisplacedBlock):
        decode(spec, values[1], key=keys[0])  # a well-formed block copied under another block's key
    with pytest.raises(MisplacedBlock):
        decode(spec, values[1], key=keys[1][:16])  # a key of another length

    def rekey(buf, header_len):  # a forger rewrites the key inside the header (digest recomputed): no secret
        start = 56 + buf[14] + buf[15]
        buf[start : start + 32] = keys[0]

    assert decode(spec, reframe(values[1], rekey), key=keys[0]).equal(state.slice(4, 8))


SECRET = b"sixteen-byte-key"
OTHER = b"another-16b-key!"


def test_authenticated_values_need_the_same_secret():
    spec = small_spec()
    state, (value,) = blocks(spec, 1, seed=15, keys=[KEY], secret=SECRET)
    _, (plain,) = blocks(spec, 1, seed=15, keys=[KEY])
    assert len(value) == len(plain) + 32 == spec.value_bytes(authenticated=True)
    assert read_header(value, SECRET).authenticated and not read_header(plain).authenticated
    assert decode(spec, value, secret=SECRET).equal(state)
    assert decode(spec, value, secret=SECRET.decode()).equal(state)  # a str secret is its UTF-8 bytes
    for reader_secret, stored in [(None, value), (OTHER, value), (SECRET, plain)]:
        with pytest.raises(UnauthenticatedBlock):
            decode(spec, stored, secret=reader_secret)

    def patch(buf, header_len):
        buf[header_len + 4 * 3 : header_len + 4 * 4] = struct.pack("<f", 1.0)  # an in-range scale

    forged = reframe(value, patch)  # valid digest, old tag: a forger without the secret
    with pytest.raises(UnauthenticatedBlock, match="HMAC"):
        decode(spec, forged, secret=SECRET)
    # Whoever holds the secret can write any well-formed block: the HMAC authenticates writers, no more.
    assert decode(spec, reframe(value, patch, secret=SECRET), secret=SECRET).k_scales[0][0, 1, 1] == 1.0


@pytest.mark.parametrize("secret", ["", b"short", "x" * 15, 12345, bytearray(3), bytes(16), b"\xff" * 32, "k" * 64])
def test_short_one_byte_or_non_bytes_secrets_are_refused_without_echoing_them(secret):
    spec = small_spec()
    state = random_state(spec.layout, 4, seed=16)
    with pytest.raises(InvalidStoreSecret) as refused:
        encode_block(spec, state, KEY, secret)
    assert not (isinstance(secret, str) and secret and secret in str(refused.value))
