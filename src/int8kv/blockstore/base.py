"""The block store interface every backend implements, and the fault policy they all share.

A store maps opaque block keys (32-byte SHA-256 digests of a prefix chain, computed by the allocator) under a
user-chosen namespace to block values (see :mod:`int8kv.blockstore.codec`). The public methods never raise
for a store fault: a refused connection, a timeout, a missing or evicted key, or a value the codec refuses is
a miss. Each fault is counted in :class:`StoreStats` and logged (one line, rate-limited); callers recompute.

Backends implement four small hooks (``_exists``, ``_get``, ``_put_if_absent``, ``_delete``) that may raise
anything; the wrappers here turn failures into misses, so the policy is written once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..cache.state import KvState
from .codec import BlockSpec, assemble_blocks, verify_block
from .errors import BlockValueError, CorruptBlock, InvalidBlockKey

__all__ = ["BlockStore", "StoreStats", "check_key", "check_namespace"]

logger = logging.getLogger("int8kv.blockstore")

MAX_KEY_BYTES = 64
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class StoreStats:
    """Counters of one store (read with :meth:`BlockStore.stats`, a copy).

    hits / misses: keys asked of ``get`` that came back with a value / without one (absent, or the call
    failed). invalid: values returned but refused by the codec in ``get_prefix`` (damaged, other version or
    model). errors: store calls that failed (connection, timeout, I/O). puts: values this store wrote;
    existing: puts skipped because the key was already set (first writer wins). dropped_writes: blocks not
    written (the background writer's queue was full, or the put failed).
    """

    hits: int = 0
    misses: int = 0
    invalid: int = 0
    errors: int = 0
    puts: int = 0
    existing: int = 0
    dropped_writes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise InvalidBlockKey(f"namespace must be 1-64 characters of [A-Za-z0-9._-], got {namespace!r}")
    return namespace


def _check_ttl(ttl: float | None) -> int | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl < 2**31:
        raise InvalidBlockKey(f"ttl must be None or a number of seconds in [1, 2**31), got {ttl!r}")
    return int(ttl)


def check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidBlockKey(f"a block key is 1..{MAX_KEY_BYTES} bytes, got {type(key).__name__} {key!r:.80}")
    return bytes(key)


class BlockStore(ABC):
    """Longest-prefix lookup, batched get and set-if-absent put of block values, faults counted as misses.

    Thread-safe: the background writer puts from its own thread while the engine looks up and gets.
    """

    #: URL scheme(s) of the backend, for messages.
    scheme: str = ""
    #: Seconds between two log lines about faults of one store (the count of the silenced ones is logged).
    log_interval: float = 10.0
    #: After a fault, seconds during which calls are misses without contacting the store: a dead or
    #: blackholed server then costs one timeout per interval, not one per request.
    retry_after: float = 1.0

    def __init__(self, namespace: str = "int8kv", ttl: float | None = None) -> None:
        self.namespace = check_namespace(namespace)
        self.ttl = _check_ttl(ttl)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._last_log = float("-inf")
        self._silenced = 0
        self._closed = False
        self._down_until = float("-inf")

    # ----------------------------------------------------------------------------------------------- public
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest run of ``keys`` (a prefix chain) present in the store, from the start.

        Network stores ask in one pipelined round trip; a fault counts and returns 0.
        """
        checked = [check_key(k) for k in keys]
        if not checked or not self._available():
            return 0
        try:
            present = self._exists(checked)
        except Exception as exc:  # any backend fault is a miss
            self._fault("lookup", exc)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored value of each key, None where absent; a failed call returns all None."""
        checked = [check_key(k) for k in keys]
        if not checked:
            return []
        values: list[bytes | None]
        if not self._available():
            values = [None] * len(checked)
        else:
            try:
                values = list(self._get(checked))
            except Exception as exc:
                self._fault("get", exc)
                values = [None] * len(checked)
        hits = sum(v is not None for v in values)
        self._count(hits=hits, misses=len(values) - hits)
        return values

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key`` unless the key is set (first writer wins); True if this call wrote it."""
        key = check_key(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidBlockKey(f"a block value is bytes, got {type(value).__name__}")
        if not self._available():
            self._count(dropped_writes=1)
            return False
        try:
            written = self._put_if_absent(key, bytes(value))
        except Exception as exc:
            self._fault("put", exc)
            self._count(dropped_writes=1)
            return False
        self._count(puts=int(written), existing=int(not written))
        return written

    def get_prefix(self, keys: Sequence[bytes], spec: BlockSpec) -> KvState | None:
        """The batch-1 state of the longest run of ``keys`` whose values are present and pass every check
        (``n * spec.block_size`` tokens for n blocks), or None if the first block is already a miss.

        Stops at the first miss: absent (e.g. evicted since :meth:`lookup`), failed, or refused by the codec.
        A damaged value (framing, checksum, values) is deleted so a later writer can replace it; a valid value
        of another version or model is left alone (another reader may want it).
        """
        good: list[bytes] = []
        for key, value in zip(keys, self.get(keys), strict=True):
            if value is None:
                break
            try:
                verify_block(spec, value)
            except BlockValueError as exc:
                self._count(invalid=1)
                self._log(f"{self!r}: refused block {bytes(key).hex()[:16]}: {exc}")
                if isinstance(exc, CorruptBlock):
                    self.delete(key)
                break
            good.append(value)
        return assemble_blocks(spec, good) if good else None

    def delete(self, key: bytes) -> None:
        """Remove ``key`` if present (a fault is counted and ignored)."""
        key = check_key(key)
        if not self._available():
            return
        try:
            self._delete(key)
        except Exception as exc:
            self._fault("delete", exc)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._stats.as_dict())

    def count_dropped(self, n: int = 1) -> None:
        """Count ``n`` writes dropped before they reached the store (the background writer's full queue)."""
        self._count(dropped_writes=n)

    def close(self) -> None:
        """Release connections (and an embedded server); later calls are misses. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as exc:
            self._fault("close", exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheme}, namespace={self.namespace!r})"

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- backend hooks
    @abstractmethod
    def _exists(self, keys: list[bytes]) -> Sequence[bool]:
        """Presence of each key (network stores: one round trip; may stop early after the first False)."""

    @abstractmethod
    def _get(self, keys: list[bytes]) -> Sequence[bytes | None]:
        """Value of each key or None (network stores: one round trip)."""

    @abstractmethod
    def _put_if_absent(self, key: bytes, value: bytes) -> bool:
        """Set ``key`` if absent (with ``self.ttl``); True if it was set by this call."""

    @abstractmethod
    def _delete(self, key: bytes) -> None:
        """Remove ``key`` if present."""

    def _close(self) -> None:
        """Release resources (nothing by default)."""
        return None

    # ---------------------------------------------------------------------------------------- helpers
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _available(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _fault(self, operation: str, exc: BaseException) -> None:
        self._count(errors=1)
        self._down_until = time.monotonic() + self.retry_after
        self._log(f"{self!r}: {operation} failed, treated as a miss: {type(exc).__name__}: {exc}")

    def _log(self, message: str) -> None:
        """One warning line, at most one per ``log_interval`` seconds per store; the rest are counted."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < self.log_interval:
                self._silenced += 1
                return
            silenced, self._silenced, self._last_log = self._silenced, 0, now
        suffix = f" ({silenced} similar messages silenced)" if silenced else ""
        logger.warning("%.300s%s", message, suffix)
