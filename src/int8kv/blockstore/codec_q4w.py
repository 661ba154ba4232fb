"""Page values of ``int4_kchan64_vtok_asym_sink4_win64_v1``: what the block store holds for the 4-bit format with
sinks and a window (spec: docs/kv_file_format.md, "In the block store (frozen)").

A query at position ``p`` of this format reads the pages before ``sealed_blocks(p + 1)`` sealed, the rest of its
window and the 4 sink rows in F16, so a run of ``j`` pages that a new sequence continues from (at ``64 j``) is the
stored form of ``64 j`` positions: pages ``0 .. j - 2`` sealed (page 0 with its sink rows) and page ``j - 1`` as
F16 rows. Two kinds of value, each a function of the token prefix alone:

- *sealed* (kind 1), under the page's prefix key: the page's sealed parts in every layer (``L`` layers, ``H`` KV
  heads, ``d`` head_dim, each C-contiguous, in this order): ``k_codes`` U8 ``[L, 64, H, d / 2]``, ``k_scale`` /
  ``k_min`` F16 ``[L, H, d]``, ``v_codes`` U8 ``[L, 64, H, d / 2]``, ``v_scale`` / ``v_min`` F16 ``[L, 64, H]``;
  page 0 then ``k_sink`` / ``v_sink`` F16 ``[L, 4, H, d]`` (positions 0-3);
- *end* (kind 2), under :func:`end_key` of the page's key: its F16 rows (the float16 inputs) ``k_rows`` /
  ``v_rows`` F16 ``[L, 64, H, d]``, pushed only for pages a later hit may end on, so that the wire holds about
  the 4-bit format's bytes, not F16's.

The framing is the block values' (docs/block_store.md "Block value format, version 2"): little-endian fixed fields,
the format name, the model fingerprint and the key, zero padding to a multiple of 8, the payload, an XXH3-128
digest of all of it and, with a secret, an HMAC-SHA256 tag; a magic of its own (``I8KVQ4W\\0``), so a block-value
reader refuses a page value by its magic and this one a block value. Every size comes from the reader's spec
and is compared with the header before anything is read; the values are checked as the KV file's reader checks
them (:func:`int8kv.quant4w.value_problem` per page, :func:`int8kv.quant4w.rows_problem` for page 0's sink rows
and for the assembled stored form).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..cache.state import KvLayout
from ..cache.state_q4w import Q4WState
from ..formats import INT4_SINK_WINDOW_V1, KvStorageFormat
from ..quant4w import SINKS, Q4WRows, rows_problem, value_problem
from .codec import MAX_KEY_BYTES, check_secret, value_digest, value_tag
from .errors import (
    BlockEncodeError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockValues,
    MisplacedBlock,
    NewerBlock,
    UnauthenticatedBlock,
    UnsupportedBlock,
)

__all__ = ["END", "MAGIC", "SEALED", "VERSION", "PageSpec", "assemble_run", "decode_page", "encode_page", "end_key"]

MAGIC = b"I8KVQ4W\x00"
VERSION = 1
SEALED, END = 1, 2
PAGE = INT4_SINK_WINDOW_V1.page
_FIXED = struct.Struct("<8sHHHBBBBBxIIIIIQ")  # 48 bytes before the strings
_DIGEST, _TAG, _ALIGN = 16, 32, 8
_AUTH_NONE, _AUTH_HMAC = 0, 1
Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
_END_DOMAIN = b"int8kv q4w end page\x00"


def end_key(key: bytes) -> bytes:
    """The key a page's end value is stored under: SHA-256 of a domain string and the page's prefix key (32 bytes,
    a chain of its own that never equals a prefix key)."""
    return hashlib.sha256(_END_DOMAIN + bytes(key)).digest()


@dataclass(frozen=True)
class PageSpec:
    """What a reader expects of a page value and a writer records: the cache's layout (of this format), the
    model fingerprint and the stored KV head range's start."""

    layout: KvLayout
    fingerprint: str
    head_start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KvLayout) or self.layout.format is not Q4W:
            raise BlockEncodeError(f"a page value's layout is of the {Q4W.value} format, got {self.layout!r}")
        if not isinstance(self.fingerprint, str) or not 0 < len(self.fingerprint.encode()) <= 255:
            raise BlockEncodeError("fingerprint must be a non-empty string of at most 255 UTF-8 bytes")
        if isinstance(self.head_start, bool) or not isinstance(self.head_start, int) or self.head_start < 0:
            raise BlockEncodeError(f"head_start must be a non-negative int, got {self.head_start!r}")
        for v in (*self.layout.dims, self.head_start + self.layout.num_kv_heads):
            if v >= 1 << 32:
                raise BlockEncodeError("the layout does not fit the page header")

    @property
    def block_size(self) -> int:
        return PAGE

    def arrays(self, kind: int, index: int) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
        """(name, dtype, shape) of each payload array of a value of ``kind`` for page ``index``, in wire order."""
        L, H, d = self.layout.dims
        u8, f16 = np.dtype(np.uint8), np.dtype(np.float16)
        if kind == END:
            return (("k_rows", f16, (L, PAGE, H, d)), ("v_rows", f16, (L, PAGE, H, d)))
        out = [
            ("k_codes", u8, (L, PAGE, H, d // 2)),
            ("k_scale", f16, (L, H, d)),
            ("k_min", f16, (L, H, d)),
            ("v_codes", u8, (L, PAGE, H, d // 2)),
            ("v_scale", f16, (L, PAGE, H)),
            ("v_min", f16, (L, PAGE, H)),
        ]
        if index == 0:
            out += [("k_sink", f16, (L, SINKS, H, d)), ("v_sink", f16, (L, SINKS, H, d))]
        return tuple(out)

    def payload_bytes(self, kind: int, index: int) -> int:
        return sum(dt.itemsize * int(np.prod(shape)) for _, dt, shape in self.arrays(kind, index))

    def header_len(self, key_bytes: int = 32) -> int:
        n = _FIXED.size + len(Q4W.value.encode()) + len(self.fingerprint.encode()) + key_bytes
        return n + (-n % _ALIGN)

    def value_bytes(self, kind: int, index: int, key_bytes: int = 32, authenticated: bool = False) -> int:
        """Size of a value of ``kind`` for page ``index`` under a key of ``key_bytes`` bytes."""
        return self.header_len(key_bytes) + self.payload_bytes(kind, index) + _DIGEST + (_TAG if authenticated else 0)


def _check_kind(kind: object, index: object) -> None:
    if kind not in (SEALED, END):
        raise BlockEncodeError(f"a page value's kind is {SEALED} (sealed) or {END} (end), got {kind!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 32:
        raise BlockEncodeError(f"a page index is an int in [0, 2**32), got {index!r}")


def encode_page(
    spec: PageSpec, key: bytes, kind: int, index: int, arrays: dict[str, np.ndarray], secret: bytes | None = None
) -> bytes:
    """The value of page ``index`` of ``kind`` (``arrays``: each name of :meth:`PageSpec.arrays`, its dtype and
    shape) under ``key``, with an HMAC tag when ``secret`` is given. BlockEncodeError for anything else, and for
    values a reader refuses (so a writer never stores a value its readers delete)."""
    secret = check_secret(secret)
    _check_kind(kind, index)
    if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise BlockEncodeError(f"a block key is 1..{MAX_KEY_BYTES} bytes, got {type(key).__name__}")
    if sys.byteorder != "little":
        raise BlockEncodeError("page values are little-endian; this platform is big-endian")
    layout = spec.arrays(kind, index)
    if not isinstance(arrays, dict) or set(arrays) != {name for name, _, _ in layout}:
        raise BlockEncodeError(f"a page value holds {[n for n, _, _ in layout]}, got {sorted(arrays)}")
    for name, dt, shape in layout:
        a = arrays[name]
        if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != shape:
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise BlockEncodeError(f"{name} must be {dt} {shape}, got {got}")
    problem = _values_problem(spec, kind, index, arrays)
    if problem is not None:
        raise BlockEncodeError(f"page {index}: {problem}")
    name, fp, key = Q4W.value.encode(), spec.fingerprint.encode(), bytes(key)
    header_len, payload_len = spec.header_len(len(key)), spec.payload_bytes(kind, index)
    buf = bytearray(header_len + payload_len + _DIGEST + (_TAG if secret else 0))
    L, H, d = spec.layout.dims
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, Q4W.version, header_len, len(name), len(fp), len(key), kind,
                     _AUTH_HMAC if secret else _AUTH_NONE, L, spec.head_start, spec.head_start + H, d, index,
                     payload_len)  # fmt: skip
    strings = name + fp + key
    buf[_FIXED.size : _FIXED.size + len(strings)] = strings
    at = header_len
    for name_, _, _ in layout:
        raw = np.ascontiguousarray(arrays[name_]).tobytes()
        buf[at : at + len(raw)] = raw
        at += len(raw)
    end = header_len + payload_len
    buf[end : end + _DIGEST] = value_digest(memoryview(buf)[:end])
    if secret:
        buf[end + _DIGEST :] = value_tag(secret, memoryview(buf)[: end + _DIGEST])
    return bytes(buf)


def decode_page(
    spec: PageSpec,
    value: bytes | bytearray | memoryview,
    key: bytes,
    kind: int,
    index: int,
    secret: bytes | None = None,
) -> dict[str, np.ndarray]:
    """The arrays of a value read under ``key``, expected to be page ``index`` of ``kind``, after every check
    (docs/kv_file_format.md, "In the block store (frozen)": framing, sizes from the spec before any read,
    digest, HMAC, key, format, fingerprint, layout, kind and page, values). Raises a BlockValueError subclass;
    the arrays are owned copies."""
    secret = check_secret(secret)
    _check_kind(kind, index)
    view = memoryview(value).cast("B")
    if len(view) < _FIXED.size + _DIGEST:
        raise CorruptBlock(f"a page value has at least {_FIXED.size + _DIGEST} bytes, got {len(view)}")
    if view[:8] != MAGIC:
        raise CorruptBlock("not an int8kv page value of the 4-bit format (bad magic)")
    version = int.from_bytes(view[8:10], "little")
    if version > VERSION:
        raise NewerBlock(f"page value version {version}; this reader knows {VERSION}")
    if version < VERSION:
        raise UnsupportedBlock(f"page value version {version}; this reader knows {VERSION}")
    (_, _, storage_version, header_len, n, m, k, got_kind, auth, layers, h0, h1, dim, got_index,
     payload_len) = _FIXED.unpack_from(view, 0)  # fmt: skip
    if auth not in (_AUTH_NONE, _AUTH_HMAC) or view[19]:
        raise CorruptBlock(f"unknown authentication kind {auth} or a non-zero reserved byte")
    if not 0 < k <= MAX_KEY_BYTES:
        raise CorruptBlock(f"key length {k} outside [1, {MAX_KEY_BYTES}]")
    strings = _FIXED.size + n + m + k
    if header_len != strings + (-strings % _ALIGN):
        raise CorruptBlock(f"header length {header_len} does not fit its strings ({n} + {m} + {k} bytes)")
    trailer = _DIGEST + (_TAG if auth == _AUTH_HMAC else 0)
    if header_len + payload_len + trailer != len(view):
        raise CorruptBlock(
            f"the header announces {header_len + payload_len + trailer} bytes, the value has {len(view)}"
        )
    end = header_len + payload_len
    if value_digest(view[:end]) != view[end : end + _DIGEST]:
        raise CorruptBlock("checksum mismatch: the page value was damaged")
    if secret is None and auth == _AUTH_HMAC:
        raise UnauthenticatedBlock("an authenticated page value, and this reader has no secret")
    if secret is not None:
        if auth != _AUTH_HMAC:
            raise UnauthenticatedBlock("a page value without an HMAC tag, and this reader needs one")
        if not hmac.compare_digest(value_tag(secret, view[: end + _DIGEST]), view[end + _DIGEST :]):
            raise UnauthenticatedBlock("HMAC mismatch: the value was not written with this secret")
    if any(view[strings:header_len]):
        raise CorruptBlock("non-zero header padding")
    at = _FIXED.size
    if not hmac.compare_digest(bytes(view[at + n + m : strings]), bytes(key)):
        raise MisplacedBlock(f"a page value stored under {bytes(key).hex()[:16]}... names another key")
    try:
        format_name = bytes(view[at : at + n]).decode("ascii")
        fingerprint = bytes(view[at + n : at + n + m]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptBlock(f"undecodable header string: {exc}") from exc
    if format_name != Q4W.value or storage_version != Q4W.version:
        raise UnsupportedBlock(f"a page value of {format_name!r} version {storage_version}; this reader holds "
                               f"{Q4W.value} version {Q4W.version}")  # fmt: skip
    if fingerprint != spec.fingerprint:
        raise IncompatibleBlock(f"page of model {fingerprint!r}, expected {spec.fingerprint!r}")
    L, H, d = spec.layout.dims
    got = (layers, h0, h1, dim, got_kind, got_index)
    want = (L, spec.head_start, spec.head_start + H, d, kind, index)
    if got != want:
        raise IncompatibleBlock(f"page (layers, head start, head end, head_dim, kind, index) = {got}, expected {want}")
    if payload_len != spec.payload_bytes(kind, index):
        raise CorruptBlock(f"payload of {payload_len} bytes, the layout needs {spec.payload_bytes(kind, index)}")
    out, at = {}, 0
    data = bytes(view[header_len:end])
    for name, dt, shape in spec.arrays(kind, index):
        count = int(np.prod(shape))
        out[name] = np.frombuffer(data, dtype=dt, count=count, offset=at).reshape(shape).copy()
        at += count * dt.itemsize
    problem = _values_problem(spec, kind, index, out)
    if problem is not None:
        raise InvalidBlockValues(f"page {index}: {problem}")
    return out


def _values_problem(spec: PageSpec, kind: int, index: int, a: dict[str, np.ndarray]) -> str | None:
    """Why the arrays of a value are not ones the format's encoder writes (docs/kv_file_format.md, "Value
    domain"), or None: F16 rows finite; scales finite with the sign bit clear, minimums finite; page 0's sink rows
    zero in its codes and value groups, its sink F16 rows finite (quant4w.rows_problem over the page)."""
    if kind == END:
        for name in ("k_rows", "v_rows"):
            if not np.isfinite(a[name]).all():
                return f"{name} must hold finite float16 rows"
        return None
    for what, s, m in (("key", a["k_scale"], a["k_min"]), ("value", a["v_scale"], a["v_min"])):
        if (problem := value_problem(s, m)) is not None:
            return f"{what} {problem}"
    if index == 0:
        empty = np.zeros((0, spec.layout.num_kv_heads, spec.layout.head_dim), np.float16)
        for layer in range(spec.layout.num_layers):
            rows = Q4WRows(k_codes=a["k_codes"][layer, None], k_scale=a["k_scale"][layer, None],
                           k_min=a["k_min"][layer, None], k_sink=a["k_sink"][layer], k_window=empty,
                           v_codes=a["v_codes"][layer, None], v_scale=a["v_scale"][layer, None],
                           v_min=a["v_min"][layer, None], v_sink=a["v_sink"][layer], v_window=empty)  # fmt: skip
            if (problem := rows_problem(rows)) is not None:
                return f"layer {layer}: {problem}"
    return None


def assemble_run(spec: PageSpec, sealed: Sequence[dict[str, np.ndarray]], end: dict[str, np.ndarray]) -> Q4WState:
    """The batch-1 stored form of ``64 j`` positions from the decoded sealed values of pages ``0 .. j - 2`` and
    the end value of page ``j - 1`` (``j = len(sealed) + 1``): what a sequence holds at ``64 j`` positions, checked
    whole by Q4WState (quant4w.rows_problem per layer)."""
    L = spec.layout.num_layers
    rows = []
    for layer in range(L):
        if sealed:
            parts = {name: np.stack([p[name][layer] for p in sealed]) for name in
                     ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")}  # fmt: skip
            k_sink, v_sink = sealed[0]["k_sink"][layer], sealed[0]["v_sink"][layer]
            k_win, v_win = end["k_rows"][layer], end["v_rows"][layer]
        else:
            H, d = spec.layout.num_kv_heads, spec.layout.head_dim
            parts = {name: np.zeros(shape, dt) for name, dt, shape in (
                ("k_codes", np.uint8, (0, PAGE, H, d // 2)), ("k_scale", np.float16, (0, H, d)),
                ("k_min", np.float16, (0, H, d)), ("v_codes", np.uint8, (0, PAGE, H, d // 2)),
                ("v_scale", np.float16, (0, PAGE, H)), ("v_min", np.float16, (0, PAGE, H)))}  # fmt: skip
            k_sink, v_sink = end["k_rows"][layer, :SINKS], end["v_rows"][layer, :SINKS]
            k_win, v_win = end["k_rows"][layer, SINKS:], end["v_rows"][layer, SINKS:]
        rows.append([Q4WRows(k_sink=k_sink, k_window=k_win, v_sink=v_sink, v_window=v_win, **parts)])
    return Q4WState.of(spec.layout, rows)
