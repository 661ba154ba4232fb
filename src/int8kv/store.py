"""Save and restore KV state (prompt caching) in one versioned, checksummed safetensors file.

    save_kv("prompt.kv", cache, model=model, token_ids=ids)        # QuantizedKvCache, Int8KvCache, PagedKvCache
    state = load_kv("prompt.kv", Int8KvCache(model.config), model=model)
    model.generate(torch.cat([state.token_ids, rest], 1), cache=state.cache)   # the prefix is not recomputed

The stored rows are the cache's own bytes (INT8 codes + float32 scales, or float16 values), so a round trip
is bit-exact and never re-encodes. The file is a valid safetensors file, but it is read here by hand with
``struct`` + ``json``: nothing in it is trusted, executed or allocated for before it has been checked.

File layout, version 1
----------------------
::

    u64 little-endian   N, the header length
    N bytes             the header: canonical JSON (sorted keys, no whitespace, ASCII), space-padded so the
                        data starts at a multiple of 8
    data                the tensors back to back, in this order (8-byte elements first, so each tensor is
                        aligned to its element size):
        token_ids  I64         [batch, seq_len]                                    (if token ids were given)
        k_scales   F32         [num_layers, batch, seq_len, num_kv_heads]           (INT8 only)
        v_scales   F32         [num_layers, batch, seq_len, num_kv_heads]           (INT8 only)
        k_codes    I8 | F16    [num_layers, batch, seq_len, num_kv_heads, head_dim]
        v_codes    I8 | F16    [num_layers, batch, seq_len, num_kv_heads, head_dim]

``__metadata__`` (strings only, as safetensors requires): ``format`` (``"int8kv.kv_state"``),
``format_version`` (``"1"``), ``storage_format`` (a :class:`KvStorageFormat` name), ``num_layers``, ``batch``,
``seq_len``, ``num_kv_heads``, ``head_dim`` (decimal), ``source`` (the cache class saved), ``created_by``,
``model`` (canonical JSON of the :class:`ModelFingerprint`, or ``null``), ``metadata`` (canonical JSON of the
caller's metadata), ``data_sha256`` (hex digest of the data section) and ``header_sha256`` (hex digest of the
canonical header without the ``header_sha256`` entry). With both digests, any changed byte is refused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .cache.contiguous import QuantizedKvCache
from .cache.paged import PagedKvCache
from .errors import KvPoolExhausted, ShapeMismatch, StoreError
from .formats import KvStorageFormat

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ChecksumMismatch",
    "CorruptKvFile",
    "FingerprintError",
    "HeaderShapeMismatch",
    "IncompatibleCache",
    "KvFileUnreadable",
    "LoadedKv",
    "ModelFingerprint",
    "ModelMismatch",
    "SaveError",
    "TruncatedKvFile",
    "UnsupportedKvFile",
    "format_inspect",
    "inspect_kv",
    "load_kv",
    "model_fingerprint",
    "save_kv",
]

FORMAT_NAME = "int8kv.kv_state"
FORMAT_VERSION = 1
# The header holds dimensions, a fingerprint and the caller's metadata, never tensor data. json.loads can turn
# a forged header into ~20x its size in Python objects (millions of empty lists), so the cap is what bounds
# the reader's memory before the size checks: 1 MiB leaves ample room for metadata such as the prompt text.
MAX_HEADER_BYTES = 1 << 20
# Any real dimension is far below this; it keeps forged integers away from float-precision and overflow edges.
_MAX_DIM = 1 << 40
_ALIGN = 8

_SCALES = ("k_scales", "v_scales")
_CODES = ("k_codes", "v_codes")
_DTYPES = {"I64": torch.int64, "F32": torch.float32, "I8": torch.int8, "F16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_DIM_KEYS = ("num_layers", "batch", "seq_len", "num_kv_heads", "head_dim")
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
        *_DIM_KEYS,
    }
)
_UINT = re.compile(r"0|[1-9][0-9]{0,15}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------------------
# errors (all StoreError, so `except StoreError` catches every refusal of a file)
# ---------------------------------------------------------------------------------------------------------
class UnsupportedKvFile(StoreError):
    """Not an int8kv KV-state file, or a format name, version or storage format this reader does not know."""


class CorruptKvFile(StoreError, ValueError):
    """The file is damaged: malformed or inconsistent header, values no int8kv writer produces."""


class TruncatedKvFile(CorruptKvFile):
    """The file is shorter than its header says (interrupted copy, partial write, or a forged size)."""


class ChecksumMismatch(CorruptKvFile):
    """The header or the tensor bytes do not hash to the digest recorded in the header."""


class HeaderShapeMismatch(CorruptKvFile):
    """A tensor's name, dtype or shape disagrees with the dimensions the header declares."""


class ModelMismatch(StoreError):
    """The state was computed by another model than the one it is saved or loaded for."""


class IncompatibleCache(StoreError, ShapeMismatch):
    """The file's storage format or shapes do not fit the cache it is loaded into."""


class SaveError(StoreError, ValueError):
    """The cache or arguments cannot be saved (unsupported or empty cache, bad token ids or metadata)."""


class FingerprintError(StoreError, ValueError):
    """A model fingerprint cannot be computed or parsed (no config, weights on the meta device, bad fields)."""


class KvFileUnreadable(StoreError, OSError):
    """The file cannot be opened or read (missing, a directory, no permission)."""


# ---------------------------------------------------------------------------------------------------------
# model fingerprint
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model a KV state was computed by. Compared field by field on load.

    ``weights`` is ``"sha256:<hex>"`` of the weights (name, dtype, shape and bytes of every state-dict entry),
    ``"id:<text>"`` for a caller-given id, or None when only a config was given. ``config_sha256`` hashes
    the config's fields that can change the K/V values (rope, norms, sizes...), not bookkeeping fields.
    """

    architecture: str | None
    model_type: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None
    vocab_size: int | None
    dtype: str | None
    config_sha256: str
    weights: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        """Short id of the whole fingerprint (16 hex digits), for display."""
        return hashlib.sha256(_canonical(self.to_dict())).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: object, error: type[StoreError] = FingerprintError) -> ModelFingerprint:
        """Strict parse: exactly the known fields, each of its declared type (``error`` is raised otherwise)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping) or set(data) != set(names):
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise error(f"a model fingerprint needs exactly the fields {names}, got {got}")
        ints = {"num_layers", "num_attention_heads", "num_kv_heads", "head_dim"}
        optional_ints = {"hidden_size", "vocab_size"}
        for name in names:
            value = data[name]
            if name in ints:
                ok = _is_int(value) and 0 < value < _MAX_DIM
            elif name in optional_ints:
                ok = value is None or (_is_int(value) and 0 < value < _MAX_DIM)
            elif name == "config_sha256":
                ok = isinstance(value, str) and bool(_HEX64.fullmatch(value))
            else:
                ok = value is None or isinstance(value, str)
            if not ok:
                raise error(f"model fingerprint field {name!r} has an invalid value {value!r}")
        return cls(**{name: data[name] for name in names})

    def differences(self, other: ModelFingerprint) -> list[str]:
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


# Config fields that cannot change K/V values: bookkeeping, generation defaults, special token ids. Left out of
# config_sha256 so the same model loaded twice (or with another attention implementation) matches itself.
_CONFIG_IGNORED = frozenset(
    {
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "initializer_range",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "torchscript",
        "tf_legacy_loss",
        "use_bfloat16",
        "pruned_heads",
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "quantization_config",
    }
)


def model_fingerprint(model_or_config: Any, weights_id: str | None = None) -> ModelFingerprint:
    """Fingerprint of a transformers model (its config, and a sha256 of its weights) or of a config alone.

    ``weights_id`` replaces the weight hash with a caller-given id (hashing reads every weight: ~1 s per
    500 MB). Compute the fingerprint once and pass it to :func:`save_kv` / :func:`load_kv` as ``model=``.
    """
    if isinstance(model_or_config, ModelFingerprint):
        return model_or_config
    module = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model_or_config, "config", model_or_config) if module is not None else model_or_config
    if config is None or not hasattr(config, "to_dict"):
        raise FingerprintError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = _config_int(text, "num_hidden_layers")
    heads = _config_int(text, "num_attention_heads")
    kv_heads = _config_int(text, "num_key_value_heads", heads)
    hidden = _config_int(text, "hidden_size", None)
    if getattr(text, "head_dim", None) is not None:
        head_dim = _config_int(text, "head_dim")
    elif hidden is not None:
        head_dim = hidden // heads
    else:
        raise FingerprintError("the config gives neither head_dim nor hidden_size")
    architectures = getattr(config, "architectures", None) or [None]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if weights_id is not None:
        weights: str | None = f"id:{weights_id}"
    elif module is not None:
        weights = "sha256:" + _weights_sha256(module)
    else:
        weights = None
    return ModelFingerprint(
        architecture=None if architectures[0] is None else str(architectures[0]),
        model_type=getattr(config, "model_type", None) or None,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=_config_int(text, "vocab_size", None),
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        config_sha256=_config_sha256(config),
        weights=weights,
    )


def _config_int(config: Any, name: str, default: Any = ...) -> Any:
    value = getattr(config, name, None)
    if value is None:
        if default is ...:
            raise FingerprintError(f"the config has no {name}")
        return default
    if not _is_int(value) or value <= 0:
        raise FingerprintError(f"config.{name} must be a positive int, got {value!r}")
    return int(value)


def _config_sha256(config: Any) -> str:
    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {str(k): strip(v) for k, v in d.items() if not str(k).startswith("_") and k not in _CONFIG_IGNORED}
        if isinstance(d, (list, tuple)):
            return [strip(v) for v in d]
        return d

    try:
        kept = strip(config.to_dict())
        # default=str: configs carry enums and dtypes; their str() is stable across runs.
        text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError) as exc:
        raise FingerprintError(f"cannot serialise the model config: {exc}") from exc
    return hashlib.sha256(text.encode()).hexdigest()


def _weights_sha256(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    first_name: dict[tuple[Any, ...], str] = {}
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach()
        if t.device.type == "meta":
            raise FingerprintError(f"weight {name!r} is on the meta device: load the weights or pass weights_id")
        # The name, dtype and shape frame the bytes, so two different state dicts can never hash alike.
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        # Tied weights (embedding = lm_head) are one tensor under two names: hash it once, then by reference.
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in first_name:
            digest.update(b"=" + first_name[key].encode())
            continue
        first_name[key] = name
        digest.update(_raw_bytes(t))
    return digest.hexdigest()


def _as_fingerprint(model: Any, weights_id: str | None) -> ModelFingerprint | None:
    if model is None:
        if weights_id is not None:
            raise FingerprintError("weights_id needs model= (the model or config it identifies)")
        return None
    if isinstance(model, ModelFingerprint):
        return model
    if isinstance(model, Mapping):
        return ModelFingerprint.from_dict(model)
    return model_fingerprint(model, weights_id)


# ---------------------------------------------------------------------------------------------------------
# the state in memory: per-layer code/scale tensors, whatever cache they came from or go to
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _State:
    fmt: KvStorageFormat
    num_layers: int
    batch: int
    seq_len: int
    num_kv_heads: int
    head_dim: int
    # per layer [batch, seq_len, num_kv_heads, head_dim] codes and [batch, seq_len, num_kv_heads] scales
    k_codes: list[torch.Tensor]
    v_codes: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None
    v_scales: list[torch.Tensor] | None
    source: str

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return self.num_layers, self.batch, self.seq_len, self.num_kv_heads, self.head_dim


@dataclass(frozen=True)
class LoadedKv:
    """What :func:`load_kv` restored."""

    cache: Any  # the cache now holding the state (the one passed in, or a new QuantizedKvCache)
    token_ids: torch.Tensor | None  # [batch, seq_len] int64, the tokens the state was computed from
    seq_len: int
    batch: int
    format: KvStorageFormat
    model: ModelFingerprint | None
    metadata: dict[str, Any]
    seq_id: Any = None  # the new sequence, for a PagedKvCache


def _hf_module() -> Any:
    # An Int8KvCache can only exist if int8kv.hf was imported; checking sys.modules keeps transformers an
    # optional dependency of this module.
    return sys.modules.get("int8kv.hf")


def _is_hf_cache(cache: Any) -> bool:
    hf = _hf_module()
    return hf is not None and isinstance(cache, hf.Int8KvCache)


def _export(cache: Any, seq_id: Any) -> _State:
    if seq_id is not None and not isinstance(cache, PagedKvCache):
        raise SaveError("seq_id is only meaningful for a PagedKvCache")
    if isinstance(cache, QuantizedKvCache):
        return _export_contiguous(cache)
    if isinstance(cache, PagedKvCache):
        return _export_paged(cache, seq_id)
    if _is_hf_cache(cache):
        return _export_hf(cache)
    raise SaveError(
        f"cannot save a {type(cache).__name__}: expected QuantizedKvCache, PagedKvCache (with seq_id) "
        "or int8kv.hf.Int8KvCache"
    )


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _export_contiguous(cache: QuantizedKvCache) -> _State:
    n = cache.seq_len
    layers = cache.layers
    quantized = cache.format.is_quantized

    def scales(which: str) -> list[torch.Tensor] | None:
        return [_cpu(getattr(layer, which)[:n]).unsqueeze(0) for layer in layers] if quantized else None

    return _State(
        cache.format,
        cache.num_layers,
        1,
        n,
        cache.num_kv_heads,
        cache.head_dim,
        [_cpu(layer.k_codes[:n]).unsqueeze(0) for layer in layers],
        [_cpu(layer.v_codes[:n]).unsqueeze(0) for layer in layers],
        scales("k_scales"),
        scales("v_scales"),
        "QuantizedKvCache",
    )


def _export_paged(cache: PagedKvCache, seq_id: Any) -> _State:
    if seq_id is None:
        raise SaveError("saving a PagedKvCache needs seq_id= (the sequence whose blocks to save)")
    # Gathering by slot follows the block table, so the file holds the rows in position order whatever
    # blocks (shared, copied-on-write, scattered) the sequence occupies.
    n = cache.context_len(seq_id)
    slots = cache.slots(seq_id, 0, n)
    rows = cache.num_blocks * cache.block_size
    code_rows = (rows, cache.num_kv_heads, cache.head_dim)

    def gather(tensors: list[Any], shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [_cpu(t.view(shape).index_select(0, slots)).unsqueeze(0) for t in tensors]

    quantized = cache.format.is_quantized
    return _State(
        cache.format,
        cache.num_layers,
        1,
        n,
        cache.num_kv_heads,
        cache.head_dim,
        gather(cache.k_codes, code_rows),
        gather(cache.v_codes, code_rows),
        gather(cache.k_scales, code_rows[:2]) if quantized else None,
        gather(cache.v_scales, code_rows[:2]) if quantized else None,
        "PagedKvCache",
    )


def _hf_layer_storage(layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``[batch, capacity, heads, dim]`` codes and ``[batch, capacity, heads]`` scales of an Int8KvLayer.

    The one place that knows where Int8KvLayer keeps its storage (its one-layer pool, see int8kv.hf)."""
    pool = layer.pool
    return pool.k_codes[0], pool.v_codes[0], pool.k_scales[0], pool.v_scales[0]


def _export_hf(cache: Any) -> _State:
    hf = _hf_module()
    layers = list(cache.layers)
    if not layers:
        raise SaveError("the Int8KvCache has no layers yet: run the prompt through the model first")
    storages = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, hf.Int8KvLayer):
            raise SaveError(f"layer {i} is a {type(layer).__name__}, not an Int8KvLayer")
        if not layer.is_initialized:
            raise SaveError(f"layer {i} holds nothing yet: run the prompt through the model first")
        storages.append(_hf_layer_storage(layer))
    lengths = {layer.get_seq_length() for layer in layers}
    shapes = {(k.shape[0], k.shape[2], k.shape[3]) for k, _, _, _ in storages}
    if len(lengths) != 1 or len(shapes) != 1:
        raise SaveError(f"the layers disagree (lengths {sorted(lengths)}, batch/heads/dim {sorted(shapes)})")
    (n,), ((batch, heads, dim),) = lengths, shapes
    quantized = cache.format.is_quantized
    return _State(
        cache.format,
        len(layers),
        batch,
        n,
        heads,
        dim,
        [_cpu(s[0][:, :n]) for s in storages],
        [_cpu(s[1][:, :n]) for s in storages],
        [_cpu(s[2][:, :n]) for s in storages] if quantized else None,
        [_cpu(s[3][:, :n]) for s in storages] if quantized else None,
        "Int8KvCache",
    )


# ---------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------
def save_kv(
    path: str | os.PathLike[str],
    cache: Any,
    *,
    model: Any = None,
    weights_id: str | None = None,
    token_ids: Any = None,
    seq_id: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the cache's KV state to ``path`` atomically; returns what :func:`inspect_kv` would report.

    Args:
        cache: a :class:`QuantizedKvCache`, an ``int8kv.hf.Int8KvCache``, or a :class:`PagedKvCache` with
            ``seq_id`` (that sequence's rows are gathered from its blocks, in position order).
        model: the model (or its config, or a :class:`ModelFingerprint`) the state was computed by; it is
            recorded so that loading for another model is refused. None records no model.
        weights_id: with a model/config, identifies the weights instead of hashing them.
        token_ids: the ``[seq_len]`` or ``[batch, seq_len]`` token ids the state was computed from.
        metadata: JSON-serialisable mapping stored as is (e.g. the prompt text, a template name).

    The file is written to a temporary file in the same directory, fsynced, renamed over ``path`` and the
    directory fsynced: a crash leaves either the old file or the complete new one, never a partial file at
    ``path``.
    """
    if sys.byteorder != "little":
        raise SaveError("KV files are little-endian; this platform is big-endian")
    state = _export(cache, seq_id)
    fingerprint = _as_fingerprint(model, weights_id)
    if fingerprint is not None:
        expected = (state.num_layers, state.num_kv_heads, state.head_dim)
        got = (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_dim)
        if got != expected:
            raise ModelMismatch(
                f"the model has (layers, kv heads, head_dim) {got} but the cache holds {expected}: "
                "this state was not computed by this model"
            )
    tokens = _check_token_ids(token_ids, state, fingerprint)
    try:
        user = json.loads(_canonical(dict(metadata or {})))
        if not all(isinstance(k, str) for k in (metadata or {})):
            raise TypeError("metadata keys must be strings")
    except (TypeError, ValueError) as exc:
        raise SaveError(f"metadata must be a JSON-serialisable mapping with string keys: {exc}") from exc

    parts: list[tuple[str, torch.dtype, list[int], list[torch.Tensor]]] = []
    L, B, T, H, D = state.dims
    if tokens is not None:
        parts.append(("token_ids", torch.int64, [B, T], [tokens]))
    if state.k_scales is not None and state.v_scales is not None:
        parts.append(("k_scales", torch.float32, [L, B, T, H], state.k_scales))
        parts.append(("v_scales", torch.float32, [L, B, T, H], state.v_scales))
    parts.append(("k_codes", state.fmt.code_dtype, [L, B, T, H, D], state.k_codes))
    parts.append(("v_codes", state.fmt.code_dtype, [L, B, T, H, D], state.v_codes))

    data_digest = hashlib.sha256()
    for _, _, _, chunks in parts:
        for chunk in chunks:
            data_digest.update(_raw_bytes(chunk))
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "storage_format": state.fmt.value,
        "source": state.source,
        "created_by": _created_by(),
        "model": _canonical(None if fingerprint is None else fingerprint.to_dict()).decode(),
        "metadata": _canonical(user).decode(),
        "data_sha256": data_digest.hexdigest(),
        **{key: str(value) for key, value in zip(_DIM_KEYS, state.dims, strict=True)},
    }
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, _ in parts:
        nbytes = _numel(shape) * _itemsize(dtype)
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta["header_sha256"] = _header_digest(header)
    body = _canonical(header)
    body += b" " * (-(8 + len(body)) % _ALIGN)
    if len(body) > MAX_HEADER_BYTES:
        raise SaveError(f"the header would take {len(body)} bytes (limit {MAX_HEADER_BYTES}): metadata too large")
    _write_atomic(Path(path), body, (chunk for _, _, _, chunks in parts for chunk in chunks))
    return _describe(_parse_header_json(body.rstrip(b" ")), Path(path), 8 + len(body) + offset, tokens)


def _check_token_ids(token_ids: Any, state: _State, fingerprint: ModelFingerprint | None) -> torch.Tensor | None:
    if token_ids is None:
        return None
    try:
        t = token_ids if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SaveError(f"token_ids must be a tensor or nested list of ints: {exc}") from exc
    if t.numel() == 0:
        t = t.to(torch.int64)  # torch.as_tensor([]) is float32: an empty list has no dtype to check
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise SaveError(f"token_ids must be integers, got {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if tuple(t.shape) != (state.batch, state.seq_len):
        raise SaveError(
            f"token_ids must be [{state.seq_len}] or [{state.batch}, {state.seq_len}] (batch, stored tokens), "
            f"got {tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else tuple(t.shape)}"
        )
    t = _cpu(t).to(torch.int64)
    vocab = fingerprint.vocab_size if fingerprint is not None else None
    if t.numel() and (int(t.min()) < 0 or (vocab is not None and int(t.max()) >= vocab)):
        raise SaveError(
            f"token ids must lie in [0, {vocab if vocab is not None else 'vocab'}), got "
            f"[{int(t.min())}, {int(t.max())}]"
        )
    return t


@functools.lru_cache(maxsize=1)
def _created_by() -> str:
    try:
        from importlib.metadata import version

        return f"int8kv {version('int8kv')}"
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "int8kv"


def _default_mode() -> int:
    # mkstemp creates files 0600; a saved cache should get the permissions any other new file would.
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_NEW_FILE_MODE = _default_mode()


def _write_atomic(path: Path, header: bytes, chunks: Iterable[torch.Tensor]) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    try:
        mode = path.stat().st_mode & 0o7777  # an overwritten file keeps its permissions
    except OSError:
        mode = _NEW_FILE_MODE
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for chunk in chunks:
                f.write(_raw_bytes(chunk))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is: without this a power loss after save_kv
    # returned could leave the old file (or none) at path.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open directories (Windows) have no directory fsync either
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# read and validate
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class _Header:
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
    tensors: tuple[_Tensor, ...]
    header_bytes: int  # N, padding included

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end

    @property
    def has_token_ids(self) -> bool:
        return self.tensors[0].name == "token_ids"


@contextlib.contextmanager
def _open(path: str | os.PathLike[str]) -> Any:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the context manager below
    except OSError as exc:
        raise KvFileUnreadable(exc.errno, f"cannot open KV file: {exc.strerror}", str(path)) from exc
    try:
        yield f
    except OSError as exc:
        raise KvFileUnreadable(exc.errno, f"cannot read KV file: {exc.strerror}", str(path)) from exc
    finally:
        f.close()


def _read_header(f: BinaryIO) -> _Header:
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise TruncatedKvFile(f"the file has {size} bytes; a KV file starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", _read_exact(f, 8))
    if n > MAX_HEADER_BYTES:
        raise CorruptKvFile(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit: not a KV file")
    if 8 + n > size:
        raise TruncatedKvFile(f"the header claims {n} bytes but the file holds only {size - 8} after the length")
    raw = _read_exact(f, n)
    body = raw.rstrip(b" ")
    if (8 + n) % _ALIGN or n - len(body) >= _ALIGN:
        raise CorruptKvFile("the header is not padded to align the data on 8 bytes as int8kv writes it")
    header = _parse_header_json(body)
    data_end = 8 + n + header.data_bytes
    if data_end > size:
        raise TruncatedKvFile(
            f"the header describes {header.data_bytes} bytes of tensors but the file holds {size - 8 - n}"
        )
    if data_end < size:
        raise CorruptKvFile(f"{size - data_end} unexpected bytes after the tensors")
    return header


def _parse_header_json(body: bytes) -> _Header:
    try:
        text = body.decode("ascii")
        raw = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptKvFile(f"the header is not valid JSON: {exc}") from None
    meta = raw.get("__metadata__") if isinstance(raw, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise UnsupportedKvFile(f"not an int8kv KV-state file (format {_short(found)}, expected {FORMAT_NAME!r})")
    # The version is checked before anything else so a newer file is reported as such, not as damaged.
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise UnsupportedKvFile(
            f"{FORMAT_NAME} version {_short(meta.get('format_version'))} is not supported (this reader knows "
            f"version {FORMAT_VERSION}); upgrade int8kv to read it"
        )
    try:
        canonical = _canonical(raw)
    except (ValueError, RecursionError):  # NaN/Infinity literals, which json.loads accepts
        canonical = b""
    if canonical != body:
        raise CorruptKvFile("the header is not in the canonical form int8kv writes (edited or damaged)")
    if set(meta) != _META_KEYS or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptKvFile(f"the header metadata must hold exactly the string fields {sorted(_META_KEYS)}")
    if not _HEX64.fullmatch(meta["header_sha256"]) or not _HEX64.fullmatch(meta["data_sha256"]):
        raise CorruptKvFile("the header's digests are not 64 hex digits")
    if _header_digest(raw) != meta["header_sha256"]:
        raise ChecksumMismatch("the header does not match its sha256: the file is damaged")
    try:
        fmt = KvStorageFormat.parse(meta["storage_format"])
    except ValueError as exc:
        raise UnsupportedKvFile(str(exc)) from None
    dims = {}
    for key in _DIM_KEYS:
        if not _UINT.fullmatch(meta[key]) or int(meta[key]) >= _MAX_DIM:
            raise CorruptKvFile(f"header field {key}={_short(meta[key])} is not a valid size")
        dims[key] = int(meta[key])
    if min(dims["num_layers"], dims["batch"], dims["num_kv_heads"], dims["head_dim"]) == 0:
        raise CorruptKvFile(f"num_layers, batch, num_kv_heads and head_dim must be > 0, got {dims}")
    try:
        model_raw = json.loads(meta["model"])
        user = json.loads(meta["metadata"])
    except (ValueError, RecursionError) as exc:
        raise CorruptKvFile(f"the header's model or metadata field is not valid JSON: {exc}") from None
    if not isinstance(user, dict):
        raise CorruptKvFile("the header's metadata field is not a JSON object")
    model = None if model_raw is None else ModelFingerprint.from_dict(model_raw, CorruptKvFile)
    if model is not None:
        declared = (dims["num_layers"], dims["num_kv_heads"], dims["head_dim"])
        if (model.num_layers, model.num_kv_heads, model.head_dim) != declared:
            raise HeaderShapeMismatch(
                f"the model fingerprint has (layers, kv heads, head_dim) "
                f"{(model.num_layers, model.num_kv_heads, model.head_dim)} but the header declares {declared}"
            )
    tensors = _check_tensors(raw, fmt, dims)
    return _Header(
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
        len(body) + (-(8 + len(body)) % _ALIGN),
    )


def _check_tensors(raw: dict[str, Any], fmt: KvStorageFormat, dims: dict[str, int]) -> tuple[_Tensor, ...]:
    L, B, T, H, D = (dims[k] for k in _DIM_KEYS)
    expected: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    if "token_ids" in raw:
        expected.append(("token_ids", torch.int64, (B, T)))
    if fmt.is_quantized:
        expected += [(name, torch.float32, (L, B, T, H)) for name in _SCALES]
    expected += [(name, fmt.code_dtype, (L, B, T, H, D)) for name in _CODES]
    names = set(raw) - {"__metadata__"}
    if names != {name for name, _, _ in expected}:
        raise HeaderShapeMismatch(
            f"a {fmt.value} file holds the tensors {sorted(n for n, _, _ in expected)}, this one "
            f"{_short(sorted(names))}"
        )
    out = []
    offset = 0
    for name, dtype, shape in expected:
        entry = raw[name]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CorruptKvFile(f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        if entry["dtype"] != _DTYPE_NAMES[dtype]:
            raise HeaderShapeMismatch(
                f"tensor {name!r} has dtype {_short(entry['dtype'])}, {fmt.value} stores {_DTYPE_NAMES[dtype]!r}"
            )
        got_shape = entry["shape"]
        # Ints only: 2.0 == 2 and True == 1 in Python, but no int8kv writer emits them.
        if not (isinstance(got_shape, list) and all(_is_int(d) for d in got_shape) and got_shape == list(shape)):
            raise HeaderShapeMismatch(
                f"tensor {name!r} has shape {_short(got_shape)} but the header declares {list(shape)}"
            )
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise CorruptKvFile(f"tensor {name!r} has invalid data_offsets {_short(offsets)}")
        # Contiguous, in order, sized exactly: then the data section is fully accounted for by the header.
        nbytes = _numel(shape) * _itemsize(dtype)
        if offsets != [offset, offset + nbytes]:
            raise CorruptKvFile(
                f"tensor {name!r} has data_offsets {offsets} where [{offset}, {offset + nbytes}] was expected"
            )
        out.append(_Tensor(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    return tuple(out)


def _read_data(f: BinaryIO, header: _Header) -> bytearray:
    # Only called after _read_header checked the declared sizes against the file's size, so this allocation
    # is bounded by the bytes actually on disk.
    buf = bytearray(header.data_bytes)
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            raise TruncatedKvFile(f"the file ended after {got} of {len(buf)} data bytes (changed while read?)")
        got += n
    if hashlib.sha256(buf).hexdigest() != header.data_sha256:
        raise ChecksumMismatch("the tensor bytes do not match their sha256: the file is damaged")
    return buf


def _tensors(header: _Header, buf: bytearray) -> dict[str, torch.Tensor]:
    out = {}
    for t in header.tensors:
        count = _numel(t.shape)
        if count == 0:
            out[t.name] = torch.empty(t.shape, dtype=t.dtype)
        else:
            out[t.name] = torch.frombuffer(buf, dtype=t.dtype, count=count, offset=t.begin).reshape(t.shape)
    _check_values(header, out)
    return out


def _check_values(header: _Header, tensors: dict[str, torch.Tensor]) -> None:
    """Values no int8kv writer produces. The digests only prove the bytes are the ones written, and a file
    can be forged with valid digests, so codes that would poison attention are refused here."""
    if header.fmt.is_quantized:
        for name in _CODES:
            if bool((tensors[name] == -128).any()):
                raise CorruptKvFile(f"{name} holds -128, outside the V1 code range [-127, 127]")
        for name in _SCALES:
            s = tensors[name]
            if not bool(((s > 0) & torch.isfinite(s)).all()):
                raise CorruptKvFile(f"{name} holds a scale that is not finite and positive")
    else:
        for name in _CODES:
            if not bool(torch.isfinite(tensors[name]).all()):
                raise CorruptKvFile(f"{name} holds NaN or inf, which the F16 format never stores")
    ids = tensors.get("token_ids")
    if ids is not None and ids.numel():
        vocab = header.model.vocab_size if header.model is not None else None
        if int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab):
            raise CorruptKvFile(f"token ids outside [0, {vocab if vocab is not None else 'vocab'})")


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TruncatedKvFile(f"the file ended after {len(data)} of {n} expected bytes")
    return data


# ---------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------
def load_kv(
    path: str | os.PathLike[str],
    cache: Any = None,
    *,
    model: Any = None,
    weights_id: str | None = None,
    seq_id: Any = None,
    device: torch.device | str | None = None,
) -> LoadedKv:
    """Restore a state written by :func:`save_kv` into ``cache``; on any error ``cache`` is left untouched.

    Args:
        cache: where to load. A :class:`QuantizedKvCache` or an ``int8kv.hf.Int8KvCache`` is overwritten
            with the file's state (its previous tokens are dropped). A :class:`PagedKvCache` gets a new
            sequence ``seq_id`` holding the state, in freshly allocated blocks. None: a new
            :class:`QuantizedKvCache` of exactly the file's length is created on ``device``.
        model: the model (or config, or :class:`ModelFingerprint`) the state is loaded for; the file's
            fingerprint must equal it field by field. None skips the check (the target's shapes are still
            checked). Pass a precomputed fingerprint to avoid re-hashing the weights on every load.
        weights_id: with a model/config, the id given to :func:`save_kv` instead of the weight hash.
        device: where new storage goes when the target has none yet (a new cache, an Int8KvCache before its
            first forward); default: the device of ``model`` if it is a torch module, else the CPU.

    Raises (all :class:`~int8kv.errors.StoreError`, except a full paged pool): UnsupportedKvFile,
    CorruptKvFile (TruncatedKvFile, ChecksumMismatch, HeaderShapeMismatch), ModelMismatch, IncompatibleCache,
    KvFileUnreadable; KvPoolExhausted when the paged pool lacks the blocks.
    """
    expected = _as_fingerprint(model, weights_id)
    if device is None:
        param = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
        device = param.device if param is not None else "cpu"
    with _open(path) as f:
        header = _read_header(f)
        if expected is not None:
            _check_model(header, expected)
        # Everything that can refuse is checked before the data is read and before the target changes.
        commit = _plan(header, cache, seq_id, device)
        buf = _read_data(f, header)
    tensors = _tensors(header, buf)
    state = _to_state(header, tensors)
    target = commit(state)
    token_ids = tensors["token_ids"].clone() if header.has_token_ids else None
    return LoadedKv(target, token_ids, header.seq_len, header.batch, header.fmt, header.model, header.metadata, seq_id)


def _check_model(header: _Header, expected: ModelFingerprint) -> None:
    if header.model is None:
        raise ModelMismatch("the file records no model fingerprint; load it with model=None to skip the check")
    diffs = header.model.differences(expected)
    if diffs:
        raise ModelMismatch("the KV state was computed by another model (file != model): " + "; ".join(diffs))


def _to_state(header: _Header, t: dict[str, torch.Tensor]) -> _State:
    scales = header.fmt.is_quantized
    return _State(
        header.fmt,
        header.num_layers,
        header.batch,
        header.seq_len,
        header.num_kv_heads,
        header.head_dim,
        list(t["k_codes"].unbind(0)),
        list(t["v_codes"].unbind(0)),
        list(t["k_scales"].unbind(0)) if scales else None,
        list(t["v_scales"].unbind(0)) if scales else None,
        header.source,
    )


def _check_fits(header: _Header, what: str, fmt: KvStorageFormat, layers: int, heads: int, dim: int) -> None:
    if fmt != header.fmt:
        raise IncompatibleCache(f"the file stores {header.fmt.value} but the {what} holds {fmt.value}")
    if (layers, heads, dim) != (header.num_layers, header.num_kv_heads, header.head_dim):
        raise IncompatibleCache(
            f"the file holds (layers, kv heads, head_dim) {(header.num_layers, header.num_kv_heads, header.head_dim)}"
            f" but the {what} has {(layers, heads, dim)}"
        )


def _plan(header: _Header, cache: Any, seq_id: Any, device: torch.device | str) -> Any:
    """Check that the state fits ``cache`` and return the function that writes it there (which cannot
    fail for a reason the checks could have caught)."""
    if seq_id is not None and not isinstance(cache, PagedKvCache):
        raise IncompatibleCache("seq_id is only meaningful when loading into a PagedKvCache")
    if cache is None or isinstance(cache, QuantizedKvCache):
        if header.batch != 1:
            raise IncompatibleCache(f"the file holds a batch of {header.batch}; load it into an Int8KvCache")
        if cache is None:
            return lambda state: _commit_contiguous(
                QuantizedKvCache(
                    state.num_layers, state.seq_len, state.num_kv_heads, state.head_dim, state.fmt, device
                ),
                state,
            )
        _check_fits(header, "cache", cache.format, cache.num_layers, cache.num_kv_heads, cache.head_dim)
        if header.seq_len > cache.capacity:
            raise IncompatibleCache(
                f"the file holds {header.seq_len} tokens but the cache's capacity is {cache.capacity}"
            )
        return lambda state: _commit_contiguous(cache, state)
    if isinstance(cache, PagedKvCache):
        if header.batch != 1:
            raise IncompatibleCache(f"the file holds a batch of {header.batch}; a paged sequence holds one")
        if seq_id is None:
            raise IncompatibleCache("loading into a PagedKvCache needs seq_id= (the new sequence to create)")
        _check_fits(header, "paged cache", cache.format, cache.num_layers, cache.num_kv_heads, cache.head_dim)
        if seq_id in cache.allocator:
            raise IncompatibleCache(f"sequence {seq_id!r} already exists in the paged cache")
        need = cache.allocator.blocks_for_tokens(header.seq_len)
        if need > cache.num_free_blocks:
            raise KvPoolExhausted(f"the state needs {need} block(s), only {cache.num_free_blocks} are free")
        return lambda state: _commit_paged(cache, state, seq_id)
    if _is_hf_cache(cache):
        return _plan_hf(header, cache, device)
    raise IncompatibleCache(
        f"cannot load into a {type(cache).__name__}: expected QuantizedKvCache, PagedKvCache, Int8KvCache or None"
    )


def _commit_contiguous(cache: QuantizedKvCache, state: _State) -> QuantizedKvCache:
    n = state.seq_len
    device = cache.layers[0].k_codes.device
    # Moved to the device first so an out-of-memory there happens before the first layer changes.
    moved = [
        [
            None if group is None else group[i].to(device)[0]
            for group in (state.k_codes, state.v_codes, state.k_scales, state.v_scales)
        ]
        for i in range(state.num_layers)
    ]
    for layer, (k, v, ks, vs) in zip(cache.layers, moved, strict=True):
        layer.k_codes[:n] = k
        layer.v_codes[:n] = v
        if ks is not None and vs is not None:
            layer.k_scales[:n] = ks
            layer.v_scales[:n] = vs
        layer.seq_len = n
    return cache


def _commit_paged(cache: PagedKvCache, state: _State, seq_id: Any) -> PagedKvCache:
    k = [t[0].to(cache.device) for t in state.k_codes]
    v = [t[0].to(cache.device) for t in state.v_codes]
    ks = [t[0].to(cache.device) for t in state.k_scales] if state.k_scales is not None else None
    vs = [t[0].to(cache.device) for t in state.v_scales] if state.v_scales is not None else None
    slots = cache.add_sequence(seq_id, state.seq_len)
    try:
        for layer in range(state.num_layers):
            cache.write_rows(
                layer,
                slots,
                (k[layer], None if ks is None else ks[layer]),
                (v[layer], None if vs is None else vs[layer]),
            )
    except BaseException:
        cache.free(seq_id)  # the rows written so far sit in blocks that go back to the pool
        raise
    return cache


def _plan_hf(header: _Header, cache: Any, device: torch.device | str) -> Any:
    hf = _hf_module()
    if cache.format != header.fmt:
        raise IncompatibleCache(f"the file stores {header.fmt.value} but the Int8KvCache holds {cache.format.value}")
    layers = list(cache.layers)
    if not layers and getattr(cache, "layer_class_to_replicate", None) is None:
        raise IncompatibleCache("the Int8KvCache has no layers and cannot create any")
    if layers and len(layers) != header.num_layers:
        raise IncompatibleCache(f"the file holds {header.num_layers} layers but the cache has {len(layers)}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, hf.Int8KvLayer) or layer.format != header.fmt:
            raise IncompatibleCache(f"layer {i} of the cache is not an Int8KvLayer of format {header.fmt.value}")
        if layer.is_initialized:
            k = _hf_layer_storage(layer)[0]
            if (k.shape[2], k.shape[3]) != (header.num_kv_heads, header.head_dim):
                raise IncompatibleCache(
                    f"the file holds {header.num_kv_heads} kv heads of {header.head_dim} but layer {i} of the "
                    f"cache holds {k.shape[2]} of {k.shape[3]}"
                )
    return lambda state: _commit_hf(cache, state, device)


def _commit_hf(cache: Any, state: _State, device: torch.device | str) -> Any:
    created = not cache.layers
    layers = [cache.layer_class_to_replicate() for _ in range(state.num_layers)] if created else list(cache.layers)
    # Each layer is re-initialised through its own lazy_initialization (the transformers hook that sizes a
    # layer from its first keys); its attributes are saved first so a failure part-way restores every layer.
    saved = [dict(vars(layer)) for layer in layers]
    try:
        for layer, k, v, ks, vs in zip(
            layers,
            state.k_codes,
            state.v_codes,
            state.k_scales or [None] * state.num_layers,
            state.v_scales or [None] * state.num_layers,
            strict=True,
        ):
            dev = layer.device if layer.is_initialized else torch.device(device)
            dtype = getattr(layer, "dtype", None) if layer.is_initialized else None
            empty = torch.empty(
                (state.batch, state.num_kv_heads, 0, state.head_dim), dtype=dtype or torch.float32, device=dev
            )
            layer.lazy_initialization(empty, empty)
            layer._ensure_capacity(state.seq_len)
            k_dst, v_dst, ks_dst, vs_dst = _hf_layer_storage(layer)
            n = state.seq_len
            k_dst[:, :n] = k.to(dev)
            v_dst[:, :n] = v.to(dev)
            if ks is not None and vs is not None and ks_dst is not None and vs_dst is not None:
                ks_dst[:, :n] = ks.to(dev)
                vs_dst[:, :n] = vs.to(dev)
            layer.seq_len = n
    except BaseException:
        for layer, attrs in zip(layers, saved, strict=True):
            vars(layer).clear()
            vars(layer).update(attrs)
        raise
    if created:
        cache.layers.extend(layers)
    return cache


# ---------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------
def inspect_kv(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a KV file holds (format, model, tokens, bytes), after the same checks as :func:`load_kv`
    (digests included): a file that inspects cleanly loads for its model."""
    with _open(path) as f:
        header = _read_header(f)
        size = os.fstat(f.fileno()).st_size
        buf = _read_data(f, header)
    tensors = _tensors(header, buf)
    return _describe(header, Path(path), size, tensors.get("token_ids"))


def _describe(header: _Header, path: Path, file_bytes: int, token_ids: torch.Tensor | None) -> dict[str, Any]:
    rows = 2 * header.num_layers * header.batch * header.seq_len * header.num_kv_heads
    return {
        "path": str(path),
        "file_bytes": file_bytes,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "storage_format": header.fmt.value,
        "source": header.source,
        "created_by": header.created_by,
        "num_layers": header.num_layers,
        "batch": header.batch,
        "seq_len": header.seq_len,
        "num_kv_heads": header.num_kv_heads,
        "head_dim": header.head_dim,
        "kv_bytes": rows * header.fmt.bytes_per_row(header.head_dim),
        "f16_kv_bytes": rows * KvStorageFormat.F16.bytes_per_row(header.head_dim),
        "model": None if header.model is None else header.model.to_dict(),
        "model_digest": None if header.model is None else header.model.digest,
        "token_ids": None if token_ids is None else token_ids.tolist(),
        "metadata": header.metadata,
        "data_sha256": header.data_sha256,
    }


def format_inspect(info: Mapping[str, Any], max_tokens: int = 16) -> str:
    """Human-readable report of an :func:`inspect_kv` dict (what ``int8kv cache inspect PATH`` prints)."""
    lines = [
        f"file      {info['path']} ({_human(info['file_bytes'])})",
        f"format    {info['format']} v{info['format_version']}, storage {info['storage_format']}, "
        f"from {info['source']} ({info['created_by']})",
        f"shape     {info['num_layers']} layers x batch {info['batch']} x {info['seq_len']} tokens x "
        f"{info['num_kv_heads']} kv heads x {info['head_dim']}",
        f"kv bytes  {_human(info['kv_bytes'])} (F16 would take {_human(info['f16_kv_bytes'])}, "
        f"{info['kv_bytes'] / max(info['f16_kv_bytes'], 1):.2f}x)",
    ]
    model = info.get("model")
    if model is None:
        lines.append("model     not recorded")
    else:
        name = model.get("architecture") or model.get("model_type") or "?"
        lines.append(
            f"model     {name} [{info['model_digest']}]: {model['num_layers']} layers, {model['num_attention_heads']} "
            f"heads / {model['num_kv_heads']} kv, head_dim {model['head_dim']}, dtype {model['dtype']}, "
            f"weights {model['weights'] or 'not recorded'}"
        )
    ids = info.get("token_ids")
    if ids is None:
        lines.append("tokens    not recorded")
    else:
        for b, row in enumerate(ids):
            shown = " ".join(str(t) for t in row[:max_tokens]) + (" ..." if len(row) > max_tokens else "")
            lines.append(f"tokens    [{b}] {len(row)}: {shown}")
    if info.get("metadata"):
        lines.append(f"metadata  {json.dumps(info['metadata'], sort_keys=True)}")
    lines.append(f"sha256    {info['data_sha256']} (verified)")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _header_digest(header: Mapping[str, Any]) -> str:
    meta = {k: v for k, v in header["__metadata__"].items() if k != "header_sha256"}
    return hashlib.sha256(_canonical({**header, "__metadata__": meta})).hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _short(value: object, limit: int = 80) -> str:
    """repr() cut to ``limit`` characters: forged headers must not produce megabyte-long error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
