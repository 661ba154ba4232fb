"""Save and restore KV state (prompt caching) in one versioned, checksummed safetensors file.

    save_kv("prompt.kv", cache, model=model, token_ids=ids)        # QuantizedKvCache, Int8KvCache, PagedKvCache
    state = load_kv("prompt.kv", Int8KvCache(model.config), model=model)
    model.generate(torch.cat([state.token_ids, rest], 1), cache=state.cache)   # the prefix is not recomputed

The stored rows are the cache's own bytes (INT8 codes + float32 scales, or float16 values; for the 4-bit format
with sinks and a window its stored form: sealed 4-bit pages and the F16 sinks and window), taken and given
back through each cache's public ``export_state`` / ``import_state``, so a round trip is bit-exact and never
re-encodes. The file is a valid safetensors file, read here by hand with ``struct`` + ``json``: nothing in it
is trusted, executed or allocated for before it has been checked. The file format is specified in
docs/kv_file_format.md.

Modules: ``format`` (the bytes: header, data, every check), ``files`` (paths, opening, atomic writes),
``fingerprint`` (the model a state belongs to), ``save`` / ``load`` (caches <-> file), ``inspect`` (a file's
report), ``errors``.
"""

from __future__ import annotations

from .errors import (
    ChecksumMismatch,
    CorruptKvFile,
    FingerprintError,
    HeaderShapeMismatch,
    IncompatibleCache,
    KvFileUnreadable,
    KvFileUnwritable,
    KvPathError,
    ModelMismatch,
    SaveError,
    TruncatedKvFile,
    UnsupportedKvFile,
)
from .fingerprint import ModelFingerprint, model_fingerprint
from .format import FORMAT_NAME, FORMAT_VERSION, MAX_HEADER_BYTES, MAX_METADATA_DEPTH
from .inspect import format_inspect, inspect_kv
from .load import LoadedKv, load_kv
from .save import save_kv

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_DEPTH",
    "ChecksumMismatch",
    "CorruptKvFile",
    "FingerprintError",
    "HeaderShapeMismatch",
    "IncompatibleCache",
    "KvFileUnreadable",
    "KvFileUnwritable",
    "KvPathError",
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
