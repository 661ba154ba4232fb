"""The block value format: one store value per KV block, every layer's K and V for ``block_size`` tokens.

The byte layout, the order of the checks and the versioning rules are specified once, in docs/block_store.md ("Block
value format, version 2", and "version 3" for several K/V shapes). In short: a 56-byte little-endian header (magic,
versions, header length, layer count, KV head range, head_dim, block size, token count, payload length, key length,
authentication kind), the storage format name, the model fingerprint and the block key the value is stored under,
zero padding to a multiple of 8, the payload (the storage format's tensors in its wire order, ``[L, T, Hk, ...]``
each: for INT8 V1 ``[L, T, Hk]`` float32 K then V scales, then ``[L, T, Hk, D]`` K then V codes), an XXH3-128 digest
of everything before it and, with a shared secret, an HMAC-SHA256 of everything before that. The key inside the
digested header binds a value to its key (a value copied under another key is refused); the HMAC binds it to the
secret (a value forged without it is refused). Version 3 is the same value for a model whose layers hold K/V of
several shapes (Gemma 4): a table of groups (layers, KV head range, head_dim) after the fixed fields and each tensor
of the payload once per group. A one-shape spec writes version 2, byte for byte as before.

XXH3-128 rather than CRC-32 or SHA-256 (measured over 128 SmolLM2 blocks on this shared 2-core machine):
zlib's CRC-32 ran at 1.1-4.9 GB/s and SHA-256 at 1.7 GB/s against a loopback Valkey GET at 0.2-0.6 GB/s, so
they added 20-90 % to a get; XXH3-128 runs at ~26 GB/s. The digest catches accidental damage, not forgery,
which is why values are range-checked too and can carry an HMAC (docs/block_store.md, "Threat model").
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

try:
    import xxhash
except ImportError:  # pragma: no cover - part of the store extra
    xxhash = None

from ..cache.state import GroupedKvState, KvLayout, KvState
from ..formats import KvStorageFormat
from .errors import (
    BlockEncodeError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockValues,
    InvalidStoreSecret,
    MisplacedBlock,
    NewerBlock,
    StoreUnavailable,
    UnauthenticatedBlock,
    UnsupportedBlock,
)

__all__ = [
    "MAGIC",
    "MAX_GROUPS",
    "ONE_SHAPE_VERSION",
    "VALUE_VERSION",
    "BlockHeader",
    "BlockSpec",
    "assemble_blocks",
    "check_secret",
    "decode_block",
    "encode_block",
    "read_header",
    "value_digest",
    "value_tag",
    "verify_block",
]

MAGIC = b"I8KVBLK\x00"
VALUE_VERSION = 3  # the newest this module reads and writes: 2 for one K/V shape, 3 for several (groups)
ONE_SHAPE_VERSION = 2
_FIXED = struct.Struct("<8sHHHBBIIIIIIQBB6x")  # the 56 bytes before the strings (version 3: before the groups)
_GROUP = struct.Struct("<IIII")  # version 3, per group: layers, KV head range start and end, head_dim
MAX_GROUPS = 64  # K/V shapes in one value (Gemma 4 has two); bounds the group table before it is read
_DIGEST = 16  # XXH3-128
_TAG = 32  # HMAC-SHA256, with a shared secret
_AUTH_NONE, _AUTH_HMAC = 0, 1
MAX_KEY_BYTES = 64
MIN_SECRET_BYTES = 16
_NUMPY = {torch.int8: np.int8, torch.uint8: np.uint8, torch.float16: np.float16, torch.float32: np.float32}
_ALIGN = 8


@dataclass(frozen=True)
class BlockSpec:
    """What a reader expects of a block and a writer records: the layout of the stored head range, the
    block size, the model fingerprint, and where the stored heads sit among the model's KV heads.

    ``layout.num_kv_heads`` is the length of the head range ``[head_start, head_start + num_kv_heads)``, so
    tensor-parallel ranks store their own ranges side by side under their own keys.

    ``layout`` may be a sequence of layouts, one per group of layers with the same K/V shape (a
    ``PagedKvCache.with_groups`` cache's ``layouts``): then values are version 3 and hold a
    :class:`~int8kv.cache.state.GroupedKvState`; one layout in a sequence is the plain spec. A head range of a
    grouped spec (``head_start > 0``) is not implemented.
    """

    layout: KvLayout | tuple[KvLayout, ...]
    block_size: int
    fingerprint: str
    head_start: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layout, (list, tuple)):
            layouts = tuple(self.layout)
            if not layouts or not all(isinstance(la, KvLayout) for la in layouts):
                raise BlockEncodeError(f"layout must be a KvLayout or a non-empty sequence of them, got {layouts!r}")
            if len({la.format for la in layouts}) != 1:
                raise BlockEncodeError(f"the groups of a spec share one format, got {layouts}")
            if len(layouts) > MAX_GROUPS:
                raise BlockEncodeError(f"{len(layouts)} groups; a block value holds at most {MAX_GROUPS}")
            object.__setattr__(self, "layout", layouts[0] if len(layouts) == 1 else layouts)
        elif not isinstance(self.layout, KvLayout):
            raise BlockEncodeError(f"layout must be a KvLayout or a non-empty sequence of them, got {self.layout!r}")
        self.format.spec.refuse_stateful("a block value")  # UnsupportedFormat: its pool exports no rows
        if self.grouped and self.head_start != 0:
            raise BlockEncodeError("a head range of a spec with several K/V shapes (head_start > 0) is not implemented")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise BlockEncodeError(f"block_size must be a positive int, got {self.block_size!r}")
        if isinstance(self.head_start, bool) or not isinstance(self.head_start, int) or self.head_start < 0:
            raise BlockEncodeError(f"head_start must be a non-negative int, got {self.head_start!r}")
        if not isinstance(self.fingerprint, str) or not 0 < len(self.fingerprint.encode()) <= 255:
            raise BlockEncodeError("fingerprint must be a non-empty string of at most 255 UTF-8 bytes")
        for la in self.layouts:
            for name in ("num_layers", "num_kv_heads", "head_dim"):
                if getattr(la, name) >= 1 << 32:
                    raise BlockEncodeError(f"{name} does not fit the block header")
            if self.head_start + la.num_kv_heads >= 1 << 32:
                raise BlockEncodeError("the head range does not fit the block header")
        if self.block_size >= 1 << 32:
            raise BlockEncodeError("block_size does not fit the block header")

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        """One layout per group (one for a plain spec)."""
        return self.layout if isinstance(self.layout, tuple) else (self.layout,)

    @property
    def grouped(self) -> bool:
        """Several K/V shapes: values of version 3."""
        return isinstance(self.layout, tuple)

    @property
    def version(self) -> int:
        return VALUE_VERSION if self.grouped else ONE_SHAPE_VERSION

    @property
    def head_end(self) -> int:
        return self.head_start + self.layouts[0].num_kv_heads

    @property
    def groups(self) -> tuple[tuple[int, int, int, int], ...]:
        """(layers, head range start, head range end, head_dim) of each group, as the header records them."""
        return tuple((la.num_layers, self.head_start, self.head_start + la.num_kv_heads, la.head_dim)
                     for la in self.layouts)  # fmt: skip

    @property
    def format(self) -> KvStorageFormat:
        return self.layouts[0].format

    def payload_bytes(self, tokens: int) -> int:
        return tokens * sum(la.bytes_per_token for la in self.layouts)

    def value_bytes(self, tokens: int | None = None, key_bytes: int = 32, authenticated: bool = False) -> int:
        """Size of an encoded block of ``tokens`` tokens (a full block by default) stored under a key of
        ``key_bytes`` bytes, with an HMAC tag if ``authenticated``."""
        tokens = self.block_size if tokens is None else tokens
        return self.header_len(key_bytes) + self.payload_bytes(tokens) + _DIGEST + (_TAG if authenticated else 0)

    def header_len(self, key_bytes: int = 32) -> int:
        """Bytes before the payload in a value of this spec (fixed fields, strings, key, padding)."""
        n = _FIXED.size + len(self.format.value.encode()) + len(self.fingerprint.encode()) + key_bytes
        n += _GROUP.size * len(self.layouts) if self.grouped else 0
        return n + (-n % _ALIGN)


@dataclass(frozen=True)
class BlockHeader:
    """The header fields of a block value, as read (before any comparison with a spec)."""

    version: int
    storage_version: int
    format_name: str
    fingerprint: str
    num_layers: int
    head_start: int
    head_end: int
    head_dim: int
    block_size: int
    tokens: int
    header_len: int
    payload_len: int
    key: bytes
    authenticated: bool
    # (layers, head start, head end, head_dim) per group: version 2's one group from the fields above, version
    # 3's table (whose fixed fields hold the group count in num_layers and zeros in head_start..head_dim).
    groups: tuple[tuple[int, int, int, int], ...] = ()


def check_secret(secret: str | bytes | None) -> bytes | None:
    """The shared secret as bytes (a str is UTF-8), or None; refuses secrets shorter than 16 bytes and secrets
    of one repeated byte (all zeros, say)."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise InvalidStoreSecret(
            f"a KV store secret is a str or bytes of at least {MIN_SECRET_BYTES} bytes, got "
            f"{type(secret).__name__} of {len(secret) if isinstance(secret, (bytes, bytearray)) else '?'} bytes"
        )  # never the secret itself
    if len(set(secret)) == 1:  # all zeros or one byte repeated: a placeholder, or a key buffer never filled
        raise InvalidStoreSecret(f"a KV store secret of {len(secret)} bytes that are all one value is no secret: "
                                 "use random bytes (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return bytes(secret)


def encode_block(
    spec: BlockSpec, state: KvState | GroupedKvState, key: bytes, secret: bytes | None = None
) -> bytes:
    """One block value for ``state`` stored under ``key``: batch 1, ``1 <= length <= block_size`` tokens of
    the spec's layout (a GroupedKvState of the spec's layouts for a grouped spec); with ``secret`` (see
    :func:`check_secret`) the value ends with an HMAC-SHA256 tag.

    ``state`` is typically ``full_state.slice(i * block_size, (i + 1) * block_size)`` of a batch-1 export.
    """
    secret = check_secret(secret)
    if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise BlockEncodeError(f"a block key is 1..{MAX_KEY_BYTES} bytes, got {type(key).__name__}")
    if sys.byteorder != "little":
        raise BlockEncodeError("block values are little-endian; this platform is big-endian")
    if not isinstance(state, (KvState, GroupedKvState)):
        raise BlockEncodeError(f"expected a KvState, got {type(state).__name__}")
    if state.layouts != spec.layouts:
        raise BlockEncodeError(f"the state's layout {list(state.layouts)} is not the spec's {list(spec.layouts)}")
    if state.batch != 1 or not 1 <= state.length <= spec.block_size:
        raise BlockEncodeError(
            f"a block holds one sequence of 1..{spec.block_size} tokens, got batch {state.batch} x {state.length}"
        )
    tokens = state.length
    name, fp, key = spec.format.value.encode(), spec.fingerprint.encode(), bytes(key)
    header_len = spec.header_len(len(key))
    payload_len = spec.payload_bytes(tokens)
    buf = bytearray(header_len + payload_len + _DIGEST + (_TAG if secret else 0))
    # Version 3's fixed fields: the group count where version 2 has the layers, zeros for the head range and
    # head_dim (each group's are in its table entry).
    fixed = (len(spec.layouts), 0, 0, 0) if spec.grouped else spec.groups[0]
    _FIXED.pack_into(
        buf, 0, MAGIC, spec.version, spec.format.version, header_len, len(name), len(fp),
        *fixed, spec.block_size, tokens, payload_len, len(key), _AUTH_HMAC if secret else _AUTH_NONE,
    )
    at = _FIXED.size
    if spec.grouped:
        for group in spec.groups:
            _GROUP.pack_into(buf, at, *group)
            at += _GROUP.size
    strings = name + fp + key
    buf[at : at + len(strings)] = strings
    for name, g, offset, dtype, shape in _payload_layout(spec, tokens):
        group = state.sections[g].groups[name]
        dst = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=header_len + offset).view(shape)
        for layer, src in enumerate(group):
            dst[layer].copy_(src[0])
    end = header_len + payload_len
    buf[end : end + _DIGEST] = _digest(memoryview(buf)[:end])
    if secret:
        buf[end + _DIGEST :] = _tag(secret, memoryview(buf)[: end + _DIGEST])
    return bytes(buf)


def read_header(value: bytes | bytearray | memoryview, secret: bytes | None = None) -> BlockHeader:
    """Parse and check the framing of a value: magic, version, sizes, checksum and, with ``secret``, its HMAC
    tag (a value without a tag, or with one, is refused when the reader has no secret, or has one)."""
    view = memoryview(value).cast("B")
    if len(view) < _FIXED.size + _DIGEST:
        raise CorruptBlock(f"a block value has at least {_FIXED.size + _DIGEST} bytes, got {len(view)}")
    version = int.from_bytes(view[8:10], "little")  # where every version keeps it, before the rest is read
    if view[:8] != MAGIC:
        raise CorruptBlock("not an int8kv block value (bad magic)")
    if version > VALUE_VERSION:  # kept in the store for newer readers
        raise NewerBlock(f"block value version {version}; this reader knows {VALUE_VERSION}")
    if version < ONE_SHAPE_VERSION:
        raise UnsupportedBlock(f"block value version {version} (not bound to its key); needs {ONE_SHAPE_VERSION}")
    _, _, storage_version, header_len, n, m, layers, h0, h1, dim, bs, tokens, payload_len, k, auth = (
        _FIXED.unpack_from(view, 0)
    )
    if auth not in (_AUTH_NONE, _AUTH_HMAC) or any(view[50:56]):
        raise CorruptBlock(f"unknown authentication kind {auth} or non-zero reserved bytes")
    if not 0 < k <= MAX_KEY_BYTES:
        raise CorruptBlock(f"key length {k} outside [1, {MAX_KEY_BYTES}]")
    table = 0
    if version == VALUE_VERSION:  # layers is the group count; the table's size is bounded before it is read
        if not 2 <= layers <= MAX_GROUPS or (h0, h1, dim) != (0, 0, 0):
            raise CorruptBlock(f"a version-{version} value has 2..{MAX_GROUPS} groups and zero head fields, got "
                               f"{layers} groups, head fields {(h0, h1, dim)}")  # fmt: skip
        table = layers * _GROUP.size
    strings = _FIXED.size + table + n + m + k
    if header_len != strings + (-strings % _ALIGN):
        raise CorruptBlock(
            f"header length {header_len} does not fit its group table and strings ({table} + {n} + {m} + {k} bytes)"
        )
    trailer = _DIGEST + (_TAG if auth == _AUTH_HMAC else 0)
    if header_len + payload_len + trailer != len(view):
        raise CorruptBlock(
            f"the header announces {header_len + payload_len + trailer} bytes, the value has {len(view)}"
        )
    end = header_len + payload_len
    if _digest(view[:end]) != view[end : end + _DIGEST]:
        raise CorruptBlock("checksum mismatch: the block value was damaged")
    if secret is None and auth == _AUTH_HMAC:
        raise UnauthenticatedBlock("an authenticated block value, and this reader has no secret")
    if secret is not None:
        if auth != _AUTH_HMAC:
            raise UnauthenticatedBlock("a block value without an HMAC tag, and this reader needs one")
        if not hmac.compare_digest(_tag(secret, view[: end + _DIGEST]), view[end + _DIGEST :]):
            raise UnauthenticatedBlock("HMAC mismatch: the value was not written with this secret")
    at = _FIXED.size + table
    try:
        format_name = bytes(view[at : at + n]).decode("ascii")
        fingerprint = bytes(view[at + n : at + n + m]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptBlock(f"undecodable header string: {exc}") from exc
    if any(view[strings:header_len]):
        raise CorruptBlock("non-zero header padding")
    key = bytes(view[at + n + m : strings])
    if table:
        groups = tuple(_GROUP.unpack_from(view, _FIXED.size + i * _GROUP.size) for i in range(layers))
        layers = sum(g[0] for g in groups)  # the header's layer count: every group's
    else:
        groups = ((layers, h0, h1, dim),)
    return BlockHeader(
        version, storage_version, format_name, fingerprint, layers, h0, h1, dim, bs, tokens, header_len,
        payload_len, key, auth == _AUTH_HMAC, groups,
    )


def verify_block(
    spec: BlockSpec,
    value: bytes | bytearray | memoryview,
    key: bytes,
    tokens: int | None = None,
    secret: bytes | None = None,
) -> BlockHeader:
    """Every check of ``value``, read under ``key``, against ``spec``, allocating nothing: framing, checksum,
    HMAC (with ``secret``), the key, version, format, fingerprint, layout and sizes, then the values (the
    format's ``value_problem``: for V1 no code -128 and scales in (0, 65504/127], for F16 finite values).

    ``tokens`` is the expected token count (default: a full block). Raises a
    :class:`~int8kv.blockstore.errors.BlockValueError` subclass.
    """
    header = read_header(value, check_secret(secret))
    if not hmac.compare_digest(header.key, bytes(key)):
        raise MisplacedBlock(f"a block of key {header.key.hex()[:16]}... stored under {bytes(key).hex()[:16]}...")
    try:
        fmt = KvStorageFormat.parse(header.format_name)
    except ValueError as exc:
        raise UnsupportedBlock(f"unknown storage format {header.format_name!r}") from exc
    if fmt.is_stateful:
        raise UnsupportedBlock(f"a block value of the {fmt.value} format, which block values do not hold")
    if header.storage_version != fmt.version:
        raise UnsupportedBlock(f"{fmt.value} version {header.storage_version}; this reader knows {fmt.version}")
    if header.fingerprint != spec.fingerprint:
        raise IncompatibleBlock(f"block of model {header.fingerprint!r}, expected {spec.fingerprint!r}")
    got = (fmt, header.groups, header.block_size)
    want = (spec.format, spec.groups, spec.block_size)
    if got != want:
        names = "(format, (layers, head start, head end, head_dim) per group, block_size)"
        raise IncompatibleBlock(f"block {names} = {_short(got)}, expected {_short(want)}")
    expected = spec.block_size if tokens is None else tokens
    if not 1 <= header.tokens <= header.block_size:
        raise CorruptBlock(f"token count {header.tokens} outside [1, {header.block_size}]")
    if header.tokens != expected:
        raise IncompatibleBlock(f"block holds {header.tokens} tokens, expected {expected}")
    if header.payload_len != spec.payload_bytes(header.tokens):
        raise CorruptBlock(f"payload of {header.payload_len} bytes, the layout needs {spec.payload_bytes(expected)}")
    _check_values(spec, _as_bytes(value), header)
    return header


def decode_block(
    spec: BlockSpec,
    value: bytes | bytearray | memoryview,
    key: bytes,
    tokens: int | None = None,
    secret: bytes | None = None,
) -> KvState | GroupedKvState:
    """The batch-1 state of one block value after :func:`verify_block` (the state owns its memory)."""
    header = verify_block(spec, value, key, tokens, secret)
    return assemble_blocks(spec, [value], header.tokens, header.header_len)


def assemble_blocks(
    spec: BlockSpec,
    values: Sequence[bytes | bytearray | memoryview],
    tokens: int | None = None,
    header_len: int | None = None,
) -> KvState | GroupedKvState:
    """One batch-1 state of ``len(values) * tokens`` tokens from block values that passed :func:`verify_block`
    (each of ``tokens`` tokens, a full block by default, under keys of equal length: ``header_len`` is their
    header's length, that of 32-byte keys by default), in order.

    Each tensor (K/V codes, K/V scales; of each group) is copied block by block into one ``[L, total, Hk, (D)]``
    array, so a prefix of n blocks costs 4n copies per group and one state, not one state of 4L tensors per block
    (separate states per block cost several times the raw GET of the block).
    A grouped spec gives a GroupedKvState (sections in the spec's group order, no layer map).
    """
    tokens = spec.block_size if tokens is None else tokens
    n = len(values)
    if n == 0:
        raise BlockEncodeError("assemble_blocks needs at least one block value")
    header_len = spec.header_len() if header_len is None else header_len
    sections: list[dict[str, list[torch.Tensor]]] = [{} for _ in spec.layouts]
    for name, g, offset, dtype, shape in _payload_layout(spec, tokens):
        # numpy allocates, torch wraps: torch.empty handed back fresh pages on every call here (a page fault per
        # page on the copy), while numpy's allocation reuses freed memory.
        out = np.empty((shape[0], n * tokens, *shape[2:]), dtype=_NUMPY[dtype])
        count = math.prod(shape)
        for i, value in enumerate(values):
            src = np.frombuffer(value, dtype=out.dtype, count=count, offset=header_len + offset)
            out[:, i * tokens : (i + 1) * tokens] = src.reshape(shape)
        dst = torch.from_numpy(out)
        sections[g][name] = [dst[layer].unsqueeze(0) for layer in range(shape[0])]
    states = [KvState.from_parts(la, parts) for la, parts in zip(spec.layouts, sections, strict=True)]
    return GroupedKvState.of(states) if spec.grouped else states[0]


def value_digest(data: memoryview) -> bytes:
    """The XXH3-128 digest a value ends with (canonical big-endian form), shared by the page values of
    :mod:`int8kv.blockstore.codec_q4w`."""
    return _digest(data)


def value_tag(secret: bytes, data: memoryview) -> bytes:
    """The HMAC-SHA256 tag of an authenticated value, shared by the page values of
    :mod:`int8kv.blockstore.codec_q4w`."""
    return _tag(secret, data)


def _digest(data: memoryview) -> bytes:
    if xxhash is None:
        raise StoreUnavailable("block values need the xxhash package: pip install 'int8kv[store]'")
    return xxhash.xxh3_128_digest(data)


def _tag(secret: bytes, data: memoryview) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


@functools.lru_cache(maxsize=64)
def _payload_layout(
    spec: BlockSpec, tokens: int
) -> tuple[tuple[str, int, int, torch.dtype, tuple[int, ...]], ...]:
    """(tensor name, group, offset in the payload, dtype, shape) of each of the format's tensors in wire order,
    ``[L, T, Hk, *part.shape(D)]`` (V1: K then V scales, then K then V codes), each once per group in group order
    (tensor-major, so every array stays aligned to its element size as in a one-group value)."""
    fmt = spec.format.spec
    out, offset = [], 0
    for name in fmt.tensor_names():
        part = fmt.part(name[2:])
        for g, lay in enumerate(spec.layouts):
            shape = (lay.num_layers, tokens, lay.num_kv_heads, *part.shape(lay.head_dim))
            out.append((name, g, offset, part.dtype, shape))
            offset += math.prod(shape) * part.dtype.itemsize
    return tuple(out)


def _as_bytes(value: bytes | bytearray | memoryview) -> bytes | bytearray:
    return value if isinstance(value, (bytes, bytearray)) else memoryview(value).cast("B").tobytes()


def _check_values(spec: BlockSpec, data: bytes | bytearray, header: BlockHeader) -> None:
    # numpy on the value itself, not torch ops: on a busy machine torch's threaded ``(codes == -128).any()``
    # pays thread start-up under contention, far more than the check itself on one block.
    fmt = spec.format.spec
    for name, _, offset, dtype, shape in _payload_layout(spec, header.tokens):
        values = np.frombuffer(data, dtype=_NUMPY[dtype], count=math.prod(shape), offset=header.header_len + offset)
        problem = fmt.value_problem(name, values)
        if problem is not None:
            raise InvalidBlockValues(problem)


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
