"""Typed errors of the block store and its value codec.

Store *faults* (refused connection, timeout, missing key, a value that fails verification) never reach the
caller of a :class:`~int8kv.blockstore.base.BlockStore`: they are counted, logged and returned as misses. The
errors below are raised for caller mistakes (a malformed URL, key or namespace) and by the codec, whose
refusals the store layer turns into misses.
"""

from __future__ import annotations

from ..errors import KvCacheError, ShapeMismatch


class BlockStoreError(KvCacheError):
    """Base class of every block-store error."""


class InvalidStoreUrl(BlockStoreError, ValueError):
    """A store URL with an unknown scheme, a malformed host list, or an option this backend does not take."""


class InvalidBlockKey(BlockStoreError, ValueError):
    """A block key that is not non-empty bytes of at most 64 bytes, or a malformed namespace or TTL."""


class InvalidStoreSecret(BlockStoreError, ValueError):
    """A KV store secret that is not a str or bytes of at least 16 bytes."""


class StoreUnavailable(BlockStoreError, ConnectionError):
    """A store could not be opened at all (the embedded server did not start, a client package is missing)."""


class BlockValueError(BlockStoreError, ValueError):
    """A stored block value is refused by the codec (the store layer turns this into a miss)."""


class CorruptBlock(BlockValueError):
    """Wrong magic, a truncated or oversized value, sizes that disagree, or a checksum mismatch."""


class UnsupportedBlock(BlockValueError):
    """A block value format version or storage format this reader does not know."""


class NewerBlock(UnsupportedBlock):
    """A block of a newer value format version: left in the store for the newer readers sharing it."""


class UnauthenticatedBlock(BlockValueError):
    """A value whose HMAC tag is missing or wrong for this reader's secret (or that has a tag and the reader
    has no secret): forged, or written by an engine with another secret."""


class MisplacedBlock(BlockValueError):
    """A well-formed value stored under another block's key (copied, or moved by a forger)."""


class IncompatibleBlock(BlockValueError):
    """A valid block for another model, head range, layout or block size than the reader expects."""


class InvalidBlockValues(CorruptBlock):
    """Codes or scales no int8kv writer produces (code -128, non-finite or out-of-range scales or values)."""


class BlockEncodeError(BlockStoreError, ShapeMismatch):
    """A state that cannot be encoded as a block of this spec (batch, length or layout mismatch)."""
