"""The KV file format, versions 1 (one K/V shape) and 2 (several: one group of tensors per shape): encoding a
state into header + data, and reading them back with every check.

The specification is docs/kv_file_format.md; this module is its only implementation. Nothing here knows a
cache: the writer takes a :class:`~int8kv.cache.state.KvState` (or the 4-bit format's
:class:`~int8kv.cache.state_q4w.Q4WState`), the reader gives back plain tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from ..cache.state import GroupedKvState, KvLayout, KvState, layer_map_problem
from ..cache.state_q4w import Q4WState, row_shapes
from ..formats import KvStorageFormat
from ._util import HEX64, MAX_DIM, canonical, is_int, raw_bytes, short
from .errors import (
    ChecksumMismatch,
    CorruptKvFile,
    HeaderShapeMismatch,
    SaveError,
    TruncatedKvFile,
    UnsupportedKvFile,
)
from .fingerprint import ModelFingerprint

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_GROUPS",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_DEPTH",
    "ONE_SHAPE_VERSION",
    "Header",
    "TensorEntry",
    "encode",
    "fingerprint_problem",
    "metadata_problem",
    "parse_header",
    "read_data",
    "read_header",
]

FORMAT_NAME = "int8kv.kv_state"
FORMAT_VERSION = 2  # the newest this module reads and writes: 1 for a state of one K/V shape, 2 for several
ONE_SHAPE_VERSION = 1
MAX_GROUPS = 64  # K/V shapes in one file (Gemma 4 has two), as in a block value
# The header holds dimensions, a fingerprint and the caller's metadata, never tensor data. json.loads can turn
# a forged header into ~20x its size in Python objects (millions of empty lists), so the cap is what bounds
# the reader's memory before the size checks: 1 MiB leaves ample room for metadata such as the prompt text.
MAX_HEADER_BYTES = 1 << 20
# Caller metadata nests at most this deep (a prompt template is 2-3 levels). The bound keeps both the writer's
# json.dumps and the reader's json.loads far from Python's recursion limit (~1000 frames).
MAX_METADATA_DEPTH = 32
# The data section is hashed and value-checked in chunks of this many bytes (a multiple of 8, so a chunk
# holds whole elements of every dtype). 1 MiB gave the value checks their best throughput, against 64 KiB and
# whole-buffer chunks, at nearly the hash's best.
CHUNK_BYTES = 1 << 20
ALIGN = 8

DTYPES = {"I64": torch.int64, "F32": torch.float32, "I8": torch.int8, "U8": torch.uint8, "F16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# The same dtypes as numpy reads them from the file's little-endian bytes (for the value checks).
_NUMPY = {
    torch.int64: np.dtype("<i8"),
    torch.float32: np.dtype("<f4"),
    torch.int8: np.dtype("i1"),
    torch.uint8: np.dtype("u1"),
    torch.float16: np.dtype("<f2"),
}
_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float16): torch.float16}
DIM_KEYS = ("num_layers", "batch", "seq_len", "num_kv_heads", "head_dim")
_META_KEYS = frozenset(
    {
        "format",
        "format_version",
        "storage_format",
        "source",
        "created_by",
        "model",
        "metadata",
        "data_sha256",
        "header_sha256",
        *DIM_KEYS,
    }
)
# Version 2: the per-shape dimensions move into ``groups`` (canonical JSON, one object per group).
_META_KEYS_V2 = (_META_KEYS - {"num_layers", "num_kv_heads", "head_dim"}) | {"groups"}
_GROUP_KEYS = frozenset({"num_layers", "num_kv_heads", "head_dim", "layers"})
_UINT = re.compile(r"0|[1-9][0-9]{0,15}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the data section: bytes ``[begin, end)`` counted from the start of the data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, fully checked header. ``num_layers`` counts every group's layers; ``num_kv_heads`` and
    ``head_dim`` are the first group's (the only one in a version-1 file)."""

    fmt: KvStorageFormat
    num_layers: int
    batch: int
    seq_len: int
    num_kv_heads: int
    head_dim: int
    source: str
    created_by: str
    model: ModelFingerprint | None
    metadata: dict[str, Any]
    data_sha256: str
    tensors: tuple[TensorEntry, ...]
    header_bytes: int  # N, padding included
    version: int = ONE_SHAPE_VERSION
    layouts: tuple[KvLayout, ...] = ()  # one per group (version 2: two or more)
    layers: tuple[tuple[int, ...], ...] | None = None  # version 2: each group's model layers, if recorded

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end

    @property
    def has_token_ids(self) -> bool:
        return self.tensors[0].name == "token_ids"

    @property
    def grouped(self) -> bool:
        return self.version != ONE_SHAPE_VERSION


# ---------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------
def metadata_problem(value: Any) -> str | None:
    """Why ``value`` is not caller metadata the format can hold, or None: a JSON tree (str-keyed dicts,
    lists, str, int, finite float, bool, None) at most MAX_METADATA_DEPTH deep and with fewer nodes than
    MAX_HEADER_BYTES (each node takes at least one header byte). Walked iteratively: no recursion, and a
    cyclic structure stops at the node bound."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_HEADER_BYTES:
            return f"more than {MAX_HEADER_BYTES} values (or a cycle): it cannot fit in the header"
        if depth > MAX_METADATA_DEPTH:
            return f"nested deeper than {MAX_METADATA_DEPTH} levels"
        if isinstance(item, Mapping):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"keys must be strings, got {short(key)}"
                stack.append((child, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return f"floats must be finite, got {item!r}"
        elif not (item is None or isinstance(item, (str, int))):
            return f"values must be JSON (dict, list, str, int, float, bool, None), got {type(item).__name__}"
    return None


def encode(
    state: KvState,
    token_ids: torch.Tensor | None,
    model: ModelFingerprint | None,
    metadata: Mapping[str, Any],
    source: str,
    created_by: str,
) -> tuple[bytes, list[torch.Tensor], int]:
    """The padded header and the tensors of the data section, in file order, and the data's byte count.

    ``state`` is a KvState (a version-1 file) or a GroupedKvState (version 2); ``token_ids`` is ``[batch, length]``
    int64 (checked by the caller); ``metadata`` passed metadata_problem. Raises SaveError when the header would
    exceed MAX_HEADER_BYTES.
    """
    B, T = state.batch, state.length
    fmt = state.format
    grouped = isinstance(state, GroupedKvState)
    parts: list[tuple[str, torch.dtype, list[int], tuple[torch.Tensor, ...]]] = []
    if token_ids is not None:
        parts.append(("token_ids", torch.int64, [B, T], (token_ids,)))
    if isinstance(state, Q4WState):  # its arrays, one tensor per layer
        parts += [(name, dtype, list(shape), state.layer_tensors(name))
                  for name, dtype, shape, _ in _tensors(fmt, state.layouts, B, T, False)]
    else:
        parts += [
            (name, dtype, list(shape), state.sections[g].groups[_part_name(name)])
            for name, dtype, shape, g in _tensors(fmt, state.layouts, B, T, grouped)
        ]

    chunks = [chunk for _, _, _, group in parts for chunk in group]
    data_digest = hashlib.sha256()
    for name, _, _, group in parts:
        for chunk in group:
            # The reader refuses values no writer produces; the writer refuses them too (a paged cache's
            # write_rows stores pre-encoded rows unchecked), so a file save_kv wrote always loads.
            problem = _value_problem(fmt, model, name, chunk.numpy())
            if problem is not None:
                raise SaveError(f"the cache holds values the format never stores: {problem}")
            data_digest.update(raw_bytes(chunk))
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION if grouped else ONE_SHAPE_VERSION),
        "storage_format": fmt.value,
        "source": source,
        "created_by": created_by,
        "model": canonical(None if model is None else model.to_dict()).decode(),
        "metadata": canonical(dict(metadata)).decode(),
        "data_sha256": data_digest.hexdigest(),
        "batch": str(B),
        "seq_len": str(T),
    }
    if grouped:
        meta["groups"] = _groups_text(state.layouts, state.layers)
    else:
        L, H, D = state.layout.dims
        meta.update(num_layers=str(L), num_kv_heads=str(H), head_dim=str(D))
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, _ in parts:
        nbytes = _numel(shape) * _itemsize(dtype)
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta["header_sha256"] = _header_digest(header)
    body = canonical(header)
    body += b" " * (-(8 + len(body)) % ALIGN)
    if len(body) > MAX_HEADER_BYTES:
        raise SaveError(f"the header would take {len(body)} bytes (limit {MAX_HEADER_BYTES}): metadata too large")
    return struct.pack("<Q", len(body)) + body, chunks, offset


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------
def read_header(f: BinaryIO, size: int) -> Header:
    """Read and check the header of the open file ``f`` of ``size`` bytes (its fstat size), including that
    the sizes it declares add up to exactly the file's size: nothing is allocated from a claimed size."""
    if size < 8:
        raise TruncatedKvFile(f"the file has {size} bytes; a KV file starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", _read_exact(f, 8))
    if n > MAX_HEADER_BYTES:
        raise CorruptKvFile(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit: not a KV file")
    if 8 + n > size:
        raise TruncatedKvFile(f"the header claims {n} bytes but the file holds only {size - 8} after the length")
    raw = _read_exact(f, n)
    body = raw.rstrip(b" ")
    if (8 + n) % ALIGN or n - len(body) >= ALIGN:
        raise CorruptKvFile("the header is not padded to align the data on 8 bytes as int8kv writes it")
    header = parse_header(body)
    data_end = 8 + n + header.data_bytes
    if data_end > size:
        raise TruncatedKvFile(
            f"the header describes {header.data_bytes} bytes of tensors but the file holds {size - 8 - n}"
        )
    if data_end < size:
        raise CorruptKvFile(f"{size - data_end} unexpected bytes after the tensors")
    return header


def parse_header(body: bytes) -> Header:
    """Parse and check the header JSON (without its padding)."""
    try:
        raw = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptKvFile(f"the header is not valid JSON: {exc}") from None
    meta = raw.get("__metadata__") if isinstance(raw, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise UnsupportedKvFile(f"not an int8kv KV-state file (format {short(found)}, expected {FORMAT_NAME!r})")
    # The version is checked before anything else so a newer file is reported as such, not as damaged.
    version = meta.get("format_version")
    if version not in (str(ONE_SHAPE_VERSION), str(FORMAT_VERSION)):
        raise UnsupportedKvFile(
            f"{FORMAT_NAME} version {short(version)} is not supported (this reader knows versions "
            f"{ONE_SHAPE_VERSION} and {FORMAT_VERSION}); upgrade int8kv to read it"
        )
    grouped = version == str(FORMAT_VERSION)
    try:
        text = canonical(raw)
    except (ValueError, RecursionError):  # NaN/Infinity literals, which json.loads accepts
        text = b""
    if text != body:
        raise CorruptKvFile("the header is not in the canonical form int8kv writes (edited or damaged)")
    keys = _META_KEYS_V2 if grouped else _META_KEYS
    if set(meta) != keys or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptKvFile(f"the header metadata must hold exactly the string fields {sorted(keys)}")
    if not HEX64.fullmatch(meta["header_sha256"]) or not HEX64.fullmatch(meta["data_sha256"]):
        raise CorruptKvFile("the header's digests are not 64 hex digits")
    if _header_digest(raw) != meta["header_sha256"]:
        raise ChecksumMismatch("the header does not match its sha256: the file is damaged")
    try:
        fmt = KvStorageFormat.parse(meta["storage_format"])
    except ValueError as exc:
        raise UnsupportedKvFile(str(exc)) from None
    if fmt.is_stateful and grouped:
        raise UnsupportedKvFile(f"a version-{FORMAT_VERSION} KV file (several K/V shapes) of the {fmt.value} format, "
                                "which int8kv does not implement")
    dims = {}
    for key in ("batch", "seq_len") if grouped else DIM_KEYS:
        if not _UINT.fullmatch(meta[key]) or int(meta[key]) >= MAX_DIM:
            raise CorruptKvFile(f"header field {key}={short(meta[key])} is not a valid size")
        dims[key] = int(meta[key])
    if grouped:
        layouts, layer_map = _parse_groups(meta["groups"], fmt)
        if dims["batch"] == 0:
            raise CorruptKvFile(f"batch must be > 0, got {dims}")
        dims.update(num_layers=sum(la.num_layers for la in layouts), num_kv_heads=layouts[0].num_kv_heads,
                    head_dim=layouts[0].head_dim)  # fmt: skip
    else:
        if min(dims["num_layers"], dims["batch"], dims["num_kv_heads"], dims["head_dim"]) == 0:
            raise CorruptKvFile(f"num_layers, batch, num_kv_heads and head_dim must be > 0, got {dims}")
        layouts = (KvLayout(dims["num_layers"], dims["num_kv_heads"], dims["head_dim"], fmt),)
        layer_map = None
    try:
        model_raw = json.loads(meta["model"])
        user = json.loads(meta["metadata"])
    except (ValueError, RecursionError) as exc:
        raise CorruptKvFile(f"the header's model or metadata field is not valid JSON: {exc}") from None
    if not isinstance(user, dict):
        raise CorruptKvFile("the header's metadata field is not a JSON object")
    problem = metadata_problem(user)
    if problem is not None:
        raise CorruptKvFile(f"the header's metadata is not what int8kv writes: {problem}")
    model = None if model_raw is None else ModelFingerprint.from_dict(model_raw, CorruptKvFile)
    if model is not None:
        problem = fingerprint_problem(model, layouts)
        if problem is not None:
            declared = layouts[0].dims if len(layouts) == 1 else [la.dims for la in layouts]
            raise HeaderShapeMismatch(f"{problem} the header declares {declared}")
    tensors = _check_tensors(raw, fmt, layouts, dims["batch"], dims["seq_len"], grouped)
    return Header(
        fmt,
        dims["num_layers"],
        dims["batch"],
        dims["seq_len"],
        dims["num_kv_heads"],
        dims["head_dim"],
        meta["source"],
        meta["created_by"],
        model,
        user,
        meta["data_sha256"],
        tensors,
        len(body) + (-(8 + len(body)) % ALIGN),
        int(version),
        layouts,
        layer_map,
    )


def fingerprint_problem(model: ModelFingerprint, layouts: tuple[KvLayout, ...]) -> str | None:
    """Why a state of ``layouts`` (one per group) was not computed by a model of this fingerprint, or None; the
    message ends where the caller names the other side ("... but the cache holds"). One group: the fingerprint's
    (layers, kv heads, head_dim) are the layout's. Several: its layers are every group's together and its
    (kv heads, head_dim) one group's (the config's global values: Gemma 4's sliding layers)."""
    got = (model.num_layers, model.num_kv_heads, model.head_dim)
    if len(layouts) == 1:
        return None if got == layouts[0].dims else f"the model has (layers, kv heads, head_dim) {got} but"
    shapes = [la.dims[1:] for la in layouts]
    if model.num_layers == sum(la.num_layers for la in layouts) and got[1:] in shapes:
        return None
    groups = [la.dims for la in layouts]
    return f"the model has (layers, kv heads, head_dim) {got}, not the layers and one shape of {groups} that"


def _groups_text(layouts: tuple[KvLayout, ...], layers: tuple[tuple[int, ...], ...] | None) -> str:
    groups = [
        {"num_layers": la.num_layers, "num_kv_heads": la.num_kv_heads, "head_dim": la.head_dim,
         "layers": None if layers is None else list(layers[g])}
        for g, la in enumerate(layouts)
    ]  # fmt: skip
    return canonical(groups).decode()


def _parse_groups(text: str, fmt: KvStorageFormat) -> tuple[tuple[KvLayout, ...], tuple[tuple[int, ...], ...] | None]:
    """A version-2 header's ``groups`` field, every size checked: 2..MAX_GROUPS groups, each
    ``{"head_dim", "layers", "num_kv_heads", "num_layers"}``, the layer maps all given or all null."""
    try:
        groups = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptKvFile(f"the header's groups field is not valid JSON: {exc}") from None
    if not isinstance(groups, list) or not 2 <= len(groups) <= MAX_GROUPS:
        raise CorruptKvFile(f"a version-{FORMAT_VERSION} file holds 2..{MAX_GROUPS} groups, got {short(groups)}")
    for g in groups:
        if not isinstance(g, dict) or set(g) != _GROUP_KEYS:
            raise CorruptKvFile(f"a group holds exactly the fields {sorted(_GROUP_KEYS)}, got {short(g)}")
        sizes = (g["num_layers"], g["num_kv_heads"], g["head_dim"])
        if not all(is_int(d) and 0 < d < MAX_DIM for d in sizes):
            raise CorruptKvFile(f"a group's num_layers, num_kv_heads and head_dim are sizes > 0, got {short(g)}")
    layouts = tuple(KvLayout(g["num_layers"], g["num_kv_heads"], g["head_dim"], fmt) for g in groups)
    maps = [g["layers"] for g in groups]
    if all(m is None for m in maps):
        layer_map = None
    elif not all(isinstance(m, list) and all(is_int(i) for i in m) for m in maps):
        raise CorruptKvFile(f"the groups' layers are all lists of ints or all null, got {short(maps)}")
    else:
        problem = layer_map_problem([la.num_layers for la in layouts], maps)
        if problem is not None:
            raise CorruptKvFile(f"the groups' layers are not a layer map ({problem}): {short(maps)}")
        layer_map = tuple(tuple(m) for m in maps)
    if _groups_text(layouts, layer_map) != text:
        raise CorruptKvFile("the header's groups field is not in the canonical form int8kv writes")
    return layouts, layer_map


def _check_tensors(
    raw: dict[str, Any], fmt: KvStorageFormat, layouts: tuple[KvLayout, ...], B: int, T: int, grouped: bool
) -> tuple[TensorEntry, ...]:
    expected: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    if "token_ids" in raw:
        expected.append(("token_ids", torch.int64, (B, T)))
    expected += [(name, dtype, shape) for name, dtype, shape, _ in _tensors(fmt, layouts, B, T, grouped)]
    names = set(raw) - {"__metadata__"}
    if names != {name for name, _, _ in expected}:
        raise HeaderShapeMismatch(
            f"a {fmt.value} file holds the tensors {sorted(n for n, _, _ in expected)}, this one {short(sorted(names))}"
        )
    out = []
    offset = 0
    for name, dtype, shape in expected:
        entry = raw[name]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CorruptKvFile(f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        if entry["dtype"] != _DTYPE_NAMES[dtype]:
            raise HeaderShapeMismatch(
                f"tensor {name!r} has dtype {short(entry['dtype'])}, {fmt.value} stores {_DTYPE_NAMES[dtype]!r}"
            )
        got_shape = entry["shape"]
        # Ints only: 2.0 == 2 and True == 1 in Python, but no int8kv writer emits them.
        if not (isinstance(got_shape, list) and all(is_int(d) for d in got_shape) and got_shape == list(shape)):
            raise HeaderShapeMismatch(
                f"tensor {name!r} has shape {short(got_shape)} but the header declares {list(shape)}"
            )
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
            raise CorruptKvFile(f"tensor {name!r} has invalid data_offsets {short(offsets)}")
        # Contiguous, in order, sized exactly: then the data section is fully accounted for by the header.
        nbytes = _numel(shape) * _itemsize(dtype)
        if offsets != [offset, offset + nbytes]:
            raise CorruptKvFile(
                f"tensor {name!r} has data_offsets {offsets} where [{offset}, {offset + nbytes}] was expected"
            )
        out.append(TensorEntry(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    return tuple(out)


def read_data(f: BinaryIO, header: Header, keep: Container[str]) -> dict[str, torch.Tensor]:
    """Stream the data section of ``f`` (positioned just after the header) in CHUNK_BYTES pieces: hash it,
    check every value, and return the tensors named in ``keep`` (views of one buffer).

    Memory: the kept tensors' bytes (bounded by the file's size, which read_header matched against the
    header) plus one chunk; a tensor not kept only passes through the chunk (inspect keeps the token ids).
    Refused: ChecksumMismatch when the bytes do not hash to the header's digest, else CorruptKvFile for a
    value no writer produces (checked after the digest, so damage is reported as damage).
    """
    kept = [t for t in header.tensors if t.name in keep]
    buf = bytearray(sum(t.nbytes for t in kept))
    scratch = bytearray(min(CHUNK_BYTES, max((t.nbytes for t in header.tensors if t.name not in keep), default=0)))
    digest = hashlib.sha256()
    problem: str | None = None
    offsets: dict[str, int] = {}
    pos = 0
    for t in header.tensors:
        if t.name in keep:
            offsets[t.name] = pos
        for start in range(0, t.nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, t.nbytes - start)
            view = memoryview(buf)[pos + start : pos + start + n] if t.name in keep else memoryview(scratch)[:n]
            _read_into(f, view)
            digest.update(view)
            if problem is None:
                problem = _value_problem(header.fmt, header.model, t.name, np.frombuffer(view, dtype=_NUMPY[t.dtype]))
        if t.name in keep:
            pos += t.nbytes
    if digest.hexdigest() != header.data_sha256:
        raise ChecksumMismatch("the tensor bytes do not match their sha256: the file is damaged")
    if problem is not None:
        raise CorruptKvFile(problem)
    out = {}
    for t in kept:
        count = _numel(t.shape)
        if count == 0:
            out[t.name] = torch.empty(t.shape, dtype=t.dtype)
        else:
            out[t.name] = torch.frombuffer(buf, dtype=t.dtype, count=count, offset=offsets[t.name]).reshape(t.shape)
    return out


def _value_problem(fmt: KvStorageFormat, model: ModelFingerprint | None, name: str, values: np.ndarray) -> str | None:
    """Why these values of tensor ``name`` (any shape) are not ones an int8kv writer produces, or None.

    The digests only prove the bytes are the ones hashed, and a file can be forged with valid digests, so
    values that would poison attention (inf keys, huge scales, out-of-range codes or token ids) are refused.
    numpy, not torch: on a busy machine torch's threaded reductions pay thread start-up under contention, far
    more than the reductions on one chunk (it made saves several times slower).
    """
    if values.size == 0:
        return None
    if name == "token_ids":
        vocab = model.vocab_size if model is not None else None
        if values.min() < 0 or (vocab is not None and values.max() >= vocab):
            return f"token ids outside [0, {vocab if vocab is not None else 'vocab'})"
        return None
    return fmt.spec.value_problem(_part_name(name), values)


def _part_name(name: str) -> str:
    """The format's tensor name of a file tensor (version 2 suffixes the group: ``k_codes.1``)."""
    return name.partition(".")[0]


def _tensors(
    fmt: KvStorageFormat, layouts: tuple[KvLayout, ...], B: int, T: int, grouped: bool
) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(file name, dtype, shape, group) of the format's tensors in file order: ``[L, B, T, H, *part.shape(D)]``
    each; version 2 (``grouped``) has each tensor once per group, ``<name>.<group>``, tensor-major (so every
    tensor stays aligned to its element size). The 4-bit format with sinks and a window: its stored form's
    ten arrays, ``[L, B, *shape]`` with the shapes a sequence of ``T`` positions stores (cache/state_q4w.py)."""
    if fmt.is_stateful:
        (la,) = layouts
        return [(name, _TORCH[dtype], (la.num_layers, B, *shape), 0)
                for name, (dtype, shape) in row_shapes(T, la.num_kv_heads, la.head_dim).items()]
    out = []
    for name in fmt.spec.tensor_names():
        part = fmt.spec.part(name[2:])
        for g, la in enumerate(layouts):
            file_name = f"{name}.{g}" if grouped else name
            out.append((file_name, part.dtype, (la.num_layers, B, T, la.num_kv_heads, *part.shape(la.head_dim)), g))
    return out


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _header_digest(header: Mapping[str, Any]) -> str:
    meta = {k: v for k, v in header["__metadata__"].items() if k != "header_sha256"}
    return hashlib.sha256(canonical({**header, "__metadata__": meta})).hexdigest()


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TruncatedKvFile(f"the file ended after {len(data)} of {n} expected bytes")
    return data


def _read_into(f: BinaryIO, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise TruncatedKvFile(f"the file ended {len(view) - got} bytes early (changed while read?)")
        got += n


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
