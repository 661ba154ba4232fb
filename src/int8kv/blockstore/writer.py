"""A bounded background writer: block puts leave the engine's critical path.

``submit`` never blocks: it queues ``(key, value)`` or, when ``max_pending`` puts are already waiting, drops it
and counts (in its own ``dropped`` and in the store's ``dropped_writes``). One daemon thread drains the queue
through :meth:`BlockStore.put`, which never raises for a store fault. ``flush`` waits for the queue to drain
(tests, shutdown); ``close`` flushes, then drops what is left and stops the thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from .base import BlockStore, check_key
from .errors import InvalidBlockKey

__all__ = ["BackgroundWriter"]

logger = logging.getLogger("int8kv.blockstore")

DEFAULT_MAX_PENDING = 256


class BackgroundWriter:
    """Puts block values into ``store`` from a background thread, at most ``max_pending`` queued."""

    def __init__(self, store: BlockStore, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending <= 0:
            raise InvalidBlockKey(f"max_pending must be a positive int, got {max_pending!r}")
        self.store = store
        self.max_pending = max_pending
        self.submitted = 0
        self.dropped = 0
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="int8kv-block-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, value: bytes) -> bool:
        """Queue one put; False (and counted) if the queue is full or the writer is closed. Never blocks."""
        key = check_key(key)
        if not isinstance(value, (bytes, bytearray)):
            raise InvalidBlockKey(f"a block value is bytes, got {type(value).__name__}")
        with self._cv:
            if self._closed or len(self._queue) >= self.max_pending:
                self.dropped += 1
                full = True
            else:
                self._queue.append((key, bytes(value)))
                self.submitted += 1
                self._cv.notify_all()
                full = False
        if full:
            self.store.count_dropped(1)
        return not full

    def pending(self) -> int:
        """Puts queued or in progress."""
        with self._cv:
            return len(self._queue) + int(self._busy)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put is done; False if ``timeout`` seconds passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, drop (and count) what is left, stop the thread."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            left = len(self._queue)
            self._queue.clear()
            self.dropped += left
            self._cv.notify_all()
        if left:
            self.store.count_dropped(left)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                key, value = self._queue.popleft()
                self._busy = True
            try:
                self.store.put(key, value)
            except Exception:  # put() only raises for caller bugs, which submit() already checked
                logger.exception("int8kv block writer: unexpected error in put")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
