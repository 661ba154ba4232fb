"""Errors of int8kv.store: every refusal of a file, a path or a save is a StoreError (itself a KvCacheError)."""

from __future__ import annotations

from ..errors import ShapeMismatch, StoreError

__all__ = [
    "ChecksumMismatch",
    "CorruptKvFile",
    "FingerprintError",
    "HeaderShapeMismatch",
    "IncompatibleCache",
    "KvFileUnreadable",
    "KvFileUnwritable",
    "KvPathError",
    "ModelMismatch",
    "SaveError",
    "StoreError",
    "TruncatedKvFile",
    "UnsupportedKvFile",
]


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
    """The file cannot be opened or read (missing, a directory, a FIFO or device, no permission)."""


class KvFileUnwritable(StoreError, OSError):
    """The save target cannot be written: something other than a regular file is at the path (a directory,
    FIFO, device, socket or symlink: left as it is), its folder is missing or not a folder, or the write
    failed (no space, no permission). The target is untouched."""


class KvPathError(StoreError, TypeError):
    """The path argument is not a path: save/load/inspect take a str or os.PathLike (an int would be taken
    as a file descriptor by ``open``, and closed), never empty or holding a NUL byte."""
