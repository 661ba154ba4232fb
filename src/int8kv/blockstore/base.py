"""The block store interface every backend implements, and the fault policy they all share.

A store maps opaque block keys (32-byte SHA-256 digests of a prefix chain, computed by the allocator) under a
user-chosen namespace to block values (see :mod:`int8kv.blockstore.codec`). The public methods never raise
for a store fault: a refused connection, a timeout, a missing or evicted key, or a value the codec refuses is
a miss. Each fault is counted in :class:`StoreStats` and logged (one line, rate-limited); callers recompute.

Backends implement four small hooks (``_exists``, ``_get``, ``_put_if_absent``, ``_delete``) that may raise
anything; the wrappers here turn failures into misses, so the policy is written once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..cache.state import GroupedKvState, KvState
from ..cache.state_q4w import Q4WState
from ..errors import KvCacheError
from .codec import MAX_KEY_BYTES, BlockSpec, assemble_blocks, check_secret, encode_block, verify_block
from .codec_q4w import END, SEALED, PageSpec, assemble_run, decode_page, encode_page, end_key
from .errors import BlockValueError, CorruptBlock, InvalidBlockKey, InvalidStoreUrl, NewerBlock, UnauthenticatedBlock

__all__ = [
    "MAX_VALUE_BYTES", "READ_DEADLINE_ENV", "BlockStore", "StoreStats", "StoreTimeout", "check_key", "check_namespace",
]

logger = logging.getLogger("int8kv.blockstore")

# A value larger than this is not an int8kv block (a 16-token block of a 70B model is ~10 MB): the raw
# ``get`` fetches at most this + 1 bytes of a value; ``get_prefix`` at most the expected size + 1.
MAX_VALUE_BYTES = 256 << 20
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")
READ_DEADLINE_ENV = "INT8KV_KV_STORE_READ_DEADLINE"


class StoreTimeout(TimeoutError):
    """A read that did not finish within its deadline (the call goes on in the store's reader thread)."""


@dataclass
class StoreStats:
    """Counters of one store (read with :meth:`BlockStore.stats`, a copy).

    hits / misses: keys asked of ``get`` that came back with a value / without one (absent, or the call
    failed). invalid: values returned but refused in ``get_prefix`` (damaged, oversized, of another
    version, model or key, of the wrong type, unauthenticated); unauthenticated: those of them whose HMAC
    tag was missing or wrong. errors: store calls that failed (connection, timeout, I/O, a refused command);
    timeouts: reads of them that missed their deadline. puts: values this store wrote; existing: puts
    skipped because the key was already set (first writer wins). dropped_writes: blocks not written (the
    background writer's queue was full, or the put failed).
    """

    hits: int = 0
    misses: int = 0
    invalid: int = 0
    unauthenticated: int = 0
    errors: int = 0
    timeouts: int = 0
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


READER_JOIN_S = 5.0  # the longest close() waits for a read still running on the reader thread


class _Reader:
    """One daemon thread that runs a store's reads, so that their caller waits at most a deadline.

    A read that misses its deadline goes on in the thread (a socket timeout or the disk ends it); callers
    meanwhile wait for the thread at most their own deadline, so a stuck store costs each caller one deadline
    (and, through the store's back-off, most callers nothing).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._busy = False
        self._job: list[Any] | None = None  # [function, done event, result, error]
        self._thread: threading.Thread | None = None
        self._closed = False

    def call(self, fn: Callable[[], Any], deadline: float) -> Any:
        end = time.monotonic() + deadline
        job: list[Any] = [fn, threading.Event(), None, None]
        with self._cv:
            if not self._cv.wait_for(lambda: not self._busy, deadline):
                raise StoreTimeout(f"the previous read is still running after {deadline:.3f} s")
            if self._closed:
                raise StoreTimeout("the store is closed")
            self._busy, self._job = True, job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        if not job[1].wait(max(0.0, end - time.monotonic())):
            raise StoreTimeout(f"no answer within {deadline:.3f} s")
        if job[3] is not None:
            raise job[3]
        return job[2]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` s for the thread to end (after :meth:`close`): a daemon thread still inside
        a read when the interpreter exits is cut inside C/C++ code, which can abort the process."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                job, self._job = self._job, None
            try:
                job[2] = job[0]()
            except BaseException as exc:  # handed to the caller (if it still waits)
                job[3] = exc
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                job[1].set()


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:
        raise InvalidStoreUrl(f"{name} must be a number of seconds in (0, 3600], got {text!r}")
    return value


def check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidBlockKey(f"a block key is 1..{MAX_KEY_BYTES} bytes, got {type(key).__name__} {key!r:.80}")
    return bytes(key)


class BlockStore(ABC):
    """Longest-prefix lookup, batched get and set-if-absent put of block values, faults counted as misses.

    Thread-safe: the background writer puts from its own thread while the engine looks up and gets. Reads
    (``lookup``, ``get``, ``get_prefix``) run on the store's reader thread and hold their caller at most a
    deadline (``read_deadline``, plus the time the expected bytes take at ``read_rate`` for a get).
    """

    #: URL scheme(s) of the backend, for messages.
    scheme: str = ""
    #: Seconds between two log lines about faults of one store (the count of the silenced ones is logged).
    log_interval: float = 10.0
    #: After a fault that says the store is unreachable (refused connection, timeout), seconds during which
    #: calls are misses without contacting it: a dead or stuck server then costs one deadline per interval.
    #: A command the server refused (out of memory, a key of the wrong type) does not start the interval.
    retry_after: float = 1.0
    #: Seconds a lookup may hold its caller; a get may take this plus its expected bytes at ``read_rate``.
    #: The default is well above a loopback lookup on a loaded machine (docs/block_store.md, "Faults"). Each store
    #: starts with ``INT8KV_KV_STORE_READ_DEADLINE`` if set (a remote store, a heavily loaded machine).
    read_deadline: float = 0.1
    #: Bytes per second a healthy get is allowed: 4x below the slowest measured here (`get_prefix` of 128
    #: SmolLM2 blocks, 25 MB, at 90 MB/s under a load average of ~11; 0.2-0.6 GB/s on a quieter machine), so a
    #: 2,048-token prefix may take 1.1 s before it is given up, which is still less than recomputing it.
    read_rate: float = 25e6

    def __init__(self, namespace: str = "int8kv", ttl: float | None = None, secret: str | bytes | None = None) -> None:
        self.namespace = check_namespace(namespace)
        self.ttl = _check_ttl(ttl)
        self._secret = check_secret(secret)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._last_log = float("-inf")
        self._silenced = 0
        self._closed = False
        self._down_until = float("-inf")
        self._reader = _Reader(f"int8kv-store-reader-{self.namespace}")
        self.read_deadline = _env_seconds(READ_DEADLINE_ENV, type(self).read_deadline)

    # ----------------------------------------------------------------------------------------------- public
    @property
    def authenticated(self) -> bool:
        """True if this store's values carry (and must carry) an HMAC tag of its shared secret."""
        return self._secret is not None

    def key_id(self, key: bytes) -> str:
        """The name of ``key`` in the store: its hex, or with a secret the hex of an HMAC of it (so stores
        with different secrets never share a name, and a name does not reveal which prefix it holds)."""
        key = check_key(key)
        if self._secret is None:
            return key.hex()
        return hmac.new(self._secret, b"int8kv block name\0" + key, hashlib.sha256).hexdigest()

    def encode(self, spec: BlockSpec, key: bytes, state: KvState | GroupedKvState) -> bytes:
        """The value of ``state`` (one block of ``spec``) to store under ``key``, with this store's HMAC tag."""
        return encode_block(spec, state, key, self._secret)

    def value_bytes(self, spec: BlockSpec, key: bytes) -> int:
        """The size of a full block of ``spec`` stored under ``key`` in this store."""
        return spec.value_bytes(key_bytes=len(key), authenticated=self.authenticated)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest run of ``keys`` (a prefix chain) present in the store, from the start.

        Network stores ask in one pipelined round trip; a fault counts and returns 0.
        """
        checked = [check_key(k) for k in keys]
        present = self._read("lookup", lambda: self._exists(checked), self.read_deadline) if checked else None
        n = 0
        while present is not None and n < len(present) and present[n]:
            n += 1
        return n

    def get(self, keys: Sequence[bytes], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        """The stored value of each key, None where absent, longer than ``max_bytes`` (of which at most
        ``max_bytes + 1`` bytes are fetched) or not a string value; a failed call returns all None."""
        checked = [check_key(k) for k in keys]
        if not checked:
            return []
        deadline = self.read_deadline + len(checked) * max_bytes / self.read_rate
        got = self._read("get", lambda: self._get(checked, max_bytes), deadline)
        values = [v if isinstance(v, bytes) and len(v) <= max_bytes else None for v in got or [None] * len(checked)]
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

    def get_prefix(self, keys: Sequence[bytes], spec: BlockSpec) -> KvState | GroupedKvState | None:
        """The batch-1 state of the longest run of ``keys`` whose values are present and pass every check
        (``n * spec.block_size`` tokens for n blocks), or None if the first block is already a miss.

        Each value is fetched up to its expected size + 1 bytes (an oversized value costs no more than a
        block) and every fetched value is verified: every refused one (damaged, oversized, of the wrong type,
        key, model, layout or an older version, unauthenticated) is deleted so a later writer can replace it,
        except a value of a newer format version (a newer reader may share the store). The run stops at the
        first miss: absent (e.g. evicted since :meth:`lookup`), failed, or refused.
        """
        checked = [check_key(k) for k in keys]
        if not checked:
            return None
        limit = max(self.value_bytes(spec, k) for k in checked)
        deadline = self.read_deadline + len(checked) * limit / self.read_rate
        return self._read("get", lambda: self._fetch_prefix(checked, spec, limit), deadline)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is in the store (not a run: every key answered; network stores in one
        round trip); a fault counts and answers all False."""
        checked = [check_key(k) for k in keys]
        if not checked:
            return []
        got = self._read("lookup", lambda: list(self._exists_each(checked)), self.read_deadline)
        return [bool(x) for x in got] if got is not None and len(got) == len(checked) else [False] * len(checked)

    # -- page values of the 4-bit format (codec_q4w) ------------------------------------------------------------
    def encode_page(self, spec: PageSpec, key: bytes, kind: int, index: int, arrays: dict) -> bytes:
        """The value of page ``index`` (``kind`` SEALED under its prefix key, END under ``end_key`` of it) with
        this store's HMAC tag."""
        return encode_page(spec, key, kind, index, arrays, self._secret)

    def get_page_run(self, spec: PageSpec, keys: Sequence[bytes]) -> Q4WState | None:
        """The stored form of ``64 j`` positions (``j = len(keys)``) from the sealed values of pages ``0 .. j - 2``
        under ``keys[:-1]`` and the end value of page ``j - 1`` under ``end_key(keys[-1])``, or None: every value
        fetched up to its expected size + 1 bytes and verified (codec_q4w.decode_page); a refused one is counted
        (``invalid``), logged and deleted (except a newer version's), and the whole run is a miss, as is one
        absent value (nothing allocated from a value's own sizes)."""
        checked = [check_key(k) for k in keys]
        if not checked:
            return None
        wanted = [(k, SEALED, i) for i, k in enumerate(checked[:-1])] + [(end_key(checked[-1]), END, len(checked) - 1)]
        limits = [spec.value_bytes(kind, i, len(k), self.authenticated) for k, kind, i in wanted]
        deadline = self.read_deadline + sum(limits) / self.read_rate
        return self._read("get", lambda: self._fetch_pages(spec, wanted, max(limits)), deadline)

    def _fetch_pages(self, spec: PageSpec, wanted: list[tuple[bytes, int, int]], limit: int) -> Q4WState | None:
        """get_page_run's work, on the reader thread."""
        values = self._get([k for k, _, _ in wanted], limit)
        hits = sum(v is not None for v in values)
        self._count(hits=hits, misses=len(values) - hits)
        pages, bad = [], []
        for (key, kind, index), value in zip(wanted, values, strict=True):
            if value is None:
                pages.append(None)
                continue
            try:
                if isinstance(value, Exception):
                    raise CorruptBlock(f"not a page value: {value}")
                if len(value) > limit:
                    raise CorruptBlock(f"a value of more than {limit} bytes, the most this reader expects")
                pages.append(decode_page(spec, value, key, kind, index, self._secret))
            except BlockValueError as exc:
                self._count(invalid=1, unauthenticated=int(isinstance(exc, UnauthenticatedBlock)))
                self._log(f"{self!r}: refused page {index} ({self.key_id(key)[:16]}): {exc}")
                if not isinstance(exc, NewerBlock):
                    bad.append(key)
                pages.append(None)
        if bad:
            try:
                self._delete(bad)
            except Exception as exc:
                self._fault("delete", exc)
        if any(p is None for p in pages):
            return None
        try:
            return assemble_run(spec, pages[:-1], pages[-1])
        except KvCacheError as exc:  # each page passed; the run as a whole did not (never seen: logged, a miss)
            self._count(invalid=1)
            self._log(f"{self!r}: refused a run of {len(pages)} pages: {exc}")
            return None

    def delete(self, key: bytes) -> None:
        """Remove ``key`` if present (a fault is counted and ignored)."""
        key = check_key(key)
        if not self._available():
            return
        try:
            self._delete([key])
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
        self._reader.close()
        try:
            self._close()
        except Exception as exc:
            self._fault("close", exc)
        self._reader.join(READER_JOIN_S)  # connections are closed: a read still running ends now

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
    def _get(self, keys: list[bytes], limit: int) -> Sequence[bytes | None | Exception]:
        """For each key its value (at most ``limit + 1`` bytes of it, so a longer one shows), None if absent,
        or an exception if the key holds something that is not a value (network stores: one round trip)."""

    @abstractmethod
    def _put_if_absent(self, key: bytes, value: bytes) -> bool:
        """Set ``key`` if absent (with ``self.ttl``); True if it was set by this call."""

    @abstractmethod
    def _delete(self, keys: list[bytes]) -> None:
        """Remove each of ``keys`` that is present (network stores: one round trip)."""

    def _exists_each(self, keys: list[bytes]) -> Sequence[bool]:
        """Presence of every key (``_exists`` may stop at the first miss); one ``_exists`` per key by default."""
        return [bool(self._exists([k])[0]) for k in keys]

    def _close(self) -> None:
        """Release resources (nothing by default)."""
        return None

    def _unreachable(self, exc: BaseException) -> bool:
        """True if ``exc`` says the store cannot be reached now (starts the back-off); backends refine it."""
        return True

    def _connect(self) -> None:
        """Get ready for a read, on the caller's thread (a cluster client learns its topology here, once):
        bounded by the backend's own timeouts, not by the read deadline. Nothing by default."""
        return None

    # ---------------------------------------------------------------------------------------- helpers
    def _read(self, operation: str, fn: Callable[[], Any], deadline: float) -> Any:
        """``fn()`` on the reader thread within ``deadline`` seconds; None (a counted fault) otherwise."""
        if not self._available():
            return None
        try:
            self._connect()
            return self._reader.call(fn, deadline)
        except Exception as exc:  # any backend fault is a miss
            if isinstance(exc, StoreTimeout):
                self._count(timeouts=1)
            self._fault(operation, exc)
            return None

    def _fetch_prefix(self, keys: list[bytes], spec: BlockSpec, limit: int) -> KvState | GroupedKvState | None:
        """get_prefix's work, on the reader thread."""
        values = self._get(keys, limit)
        hits = sum(v is not None for v in values)
        self._count(hits=hits, misses=len(values) - hits)
        good: list[bytes] = []
        header_len, bad, run = None, [], True
        for key, value in zip(keys, values, strict=True):
            if value is None:
                run = False
                continue
            try:
                if isinstance(value, Exception):
                    raise CorruptBlock(f"not a block value: {value}")
                if len(value) > limit:
                    raise CorruptBlock(f"a value of more than {limit} bytes, the most this reader expects")
                header = verify_block(spec, value, key, secret=self._secret)
            except BlockValueError as exc:
                self._count(invalid=1, unauthenticated=int(isinstance(exc, UnauthenticatedBlock)))
                self._log(f"{self!r}: refused block {self.key_id(key)[:16]}: {exc}")
                if not isinstance(exc, NewerBlock):
                    bad.append(key)
                run = False
                continue
            if run and header_len in (None, header.header_len):
                header_len = header.header_len
                good.append(value)
            else:
                run = False
        if bad:
            try:
                self._delete(bad)
            except Exception as exc:
                self._fault("delete", exc)
        return assemble_blocks(spec, good, header_len=header_len) if good else None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _available(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _fault(self, operation: str, exc: BaseException) -> None:
        self._count(errors=1)
        if isinstance(exc, StoreTimeout) or self._unreachable(exc):
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
