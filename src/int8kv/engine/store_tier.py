"""The engine's shared tier: full prefix blocks loaded from, and pushed to, a KV block store.

    tier = StoreTier.open("embedded" | "disk:/path" | "redis://host:6379/0" | store, spec, cache)
    state = tier.fetch(keys)               # the longest verified run of `keys` the store holds, or None
    tier.push(seq_id, keys, first, last)   # blocks [first, last) of a sequence, queued for the store

The scheduler asks `fetch` for the full blocks of a prompt that the local pool does not hold (one pipelined
lookup, then one get of those values, verified by the codec before anything is allocated; each bounded by the
store's read deadline, so a stuck store costs an admission at most ~0.1 s plus the expected transfer time) and
writes the result into the sequence's newly reserved blocks; `push` exports a sequence's newly computed full blocks
through the cache's public `export_state`, encodes them and hands them to the bounded background writer, so
the network write is off the step's path. A store fault of any kind (refused connection, timeout, eviction
between lookup and get, damaged or foreign value, even an unexpected exception) is a miss: `fetch` returns
what it could verify (or None), the rest is recomputed, the fault is counted, and a request never sees it.

`PageStoreTier` is the tier of the 4-bit format with sinks and a window (blockstore/codec_q4w.py): sealed values
pushed as pages seal (`push_step`), end values (a page's F16 rows) for the pages a hit can end on (`push_step`,
`push_end`), and `fetch` of the longest usable run (sealed pages 0 .. j - 2, the end value of page j - 1) as a
Q4WState that replaces a shorter pool hit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..blockstore import BackgroundWriter, BlockSpec, BlockStore, open_block_store
from ..blockstore.codec_q4w import END, SEALED, PageSpec, end_key
from ..cache.paged import PagedKvCache
from ..cache.state import GroupedKvState, KvState
from ..cache.state_q4w import Q4WState
from ..quant4w import sealed_blocks

logger = logging.getLogger("int8kv.engine")

#: Seconds between two engine log lines about store faults (the store logs its own, rate-limited too).
LOG_INTERVAL = 10.0


class StoreTier:
    """A block store seen by one engine: `fetch` for admission, `push` for filled blocks, `close` at the end."""

    #: Values are pages of the 4-bit format (PageStoreTier): a fetched run replaces the pool's hit.
    pages = False

    def __init__(self, store: BlockStore, spec: BlockSpec, cache: PagedKvCache, owned: bool = True) -> None:
        self.store = store
        self.spec = spec
        self.cache = cache
        self.owned = owned  # opened from a URL by the engine, so closed with it
        self.writer = BackgroundWriter(store)
        self.faults = 0  # fetches that delivered fewer blocks than the lookup promised, or raised
        self.pushed_blocks = 0
        # What the store cost admissions: fetch calls, their total and their longest wait (seconds).
        self.fetches = 0
        self.fetch_seconds = 0.0
        self.slowest_fetch_s = 0.0
        self._last_log = float("-inf")

    @classmethod
    def open(
        cls, store: str | BlockStore, spec: BlockSpec, cache: PagedKvCache, namespace: str,
        secret: str | bytes | None = None,
    ) -> StoreTier:
        """A tier over a store URL (opened here with ``secret``, closed with the tier) or an open store (left
        open; its own secret applies)."""
        if isinstance(store, BlockStore):
            return cls(store, spec, cache, owned=False)
        opened = open_block_store(store, namespace=namespace, secret=secret)  # InvalidStoreUrl / StoreUnavailable
        try:
            return cls(opened, spec, cache)
        except BaseException:
            opened.close()
            raise

    def fetch(self, keys: Sequence[bytes]) -> KvState | GroupedKvState | None:
        """The batch-1 state of the longest run of ``keys`` (a chain continuing the local hit) that the store
        holds and that passes every check, ``n * block_size`` tokens, or None. Never raises."""
        if not keys:
            return None

        def get() -> tuple[int, KvState | GroupedKvState | None]:
            found = self.store.lookup(keys)
            return found, self.store.get_prefix(keys[:found], self.spec) if found else None

        answer = self._timed(get)
        if answer is None:
            return None
        found, state = answer
        got = 0 if state is None else state.length // self.spec.block_size
        if got < found:  # evicted since the lookup, damaged, another version or model, or the call failed
            self._fault(f"the store listed {found} block(s) and delivered {got}; recomputing the rest")
        return state

    def push(self, seq_id: object, keys: Sequence[bytes], first: int, last: int) -> None:
        """Queue blocks ``[first, last)`` of a sequence (full and written) for the store. Never raises."""
        if last <= first:
            return
        bs = self.spec.block_size
        try:
            state = self.cache.export_state(seq_id, first * bs, last * bs)
            for i in range(last - first):
                key = keys[first + i]
                self.writer.submit(key, self.store.encode(self.spec, key, state.slice(i * bs, (i + 1) * bs)))
            self.pushed_blocks += last - first
        except Exception as exc:  # noqa: BLE001
            self._fault(f"push raised {type(exc).__name__}: {exc}")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued pushes are written; False if ``timeout`` seconds passed first."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Flush the writer (at most 5 s) and close the store if the engine opened it. Idempotent."""
        self.writer.close()
        if self.owned:
            self.store.close()

    def _timed(self, get: Callable[[], tuple]) -> tuple | None:
        """``get()`` (the store's lookup and fetch), timed and counted as a fetch; None, a fault counted and
        logged, if it raised."""
        start = time.perf_counter()
        try:
            return get()
        except Exception as exc:  # noqa: BLE001 - a store must never fail a request
            self._fault(f"fetch raised {type(exc).__name__}: {exc}")
            return None
        finally:
            waited = time.perf_counter() - start
            self.fetches += 1
            self.fetch_seconds += waited
            self.slowest_fetch_s = max(self.slowest_fetch_s, waited)

    def _fault(self, message: str) -> None:
        self.faults += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL:
            self._last_log = now
            logger.warning("int8kv engine: KV store miss (%s): %.300s", self.store, message)


class PageStoreTier(StoreTier):
    """The tier of the 4-bit format with sinks and a window (docs/design.md, "The block store over the 4-bit
    format"): a run of ``j`` pages is usable when the store holds the sealed values of pages ``0 .. j - 2`` and
    the end value (F16 rows) of page ``j - 1``; sealed values are pushed as pages seal in every layer, end values
    only for the pages a later prompt may end a hit on (the prompt's last full page before its last token, and
    the last full page of a finished sequence, the one the pool keeps), so the wire carries about the format's
    own bytes plus one or two F16 pages per request."""

    pages = True

    def __init__(self, store: BlockStore, spec: PageSpec, cache: PagedKvCache, owned: bool = True) -> None:
        super().__init__(store, spec, cache, owned)  # type: ignore[arg-type]
        self.pushed_ends = 0

    def fetch(self, keys: Sequence[bytes], hit_pages: int = 0) -> Q4WState | None:  # type: ignore[override]
        """The stored form of the longest usable run of ``keys`` (the prompt's pages a hit may cover) longer than
        ``hit_pages`` (the pool's own hit), from page 0, or None. Never raises."""
        if len(keys) <= hit_pages:
            return None

        def get() -> tuple[int, Q4WState | None]:
            sealed = self.store.lookup(keys[: len(keys) - 1])  # pages 0 .. sealed - 1 have a sealed value
            ends = range(hit_pages, min(sealed, len(keys) - 1) + 1)  # a run of p + 1 pages ends on page p
            present = self.store.present([end_key(keys[p]) for p in ends])
            found = max((p + 1 for p, here in zip(ends, present, strict=True) if here), default=0)
            return found, self.store.get_page_run(self.spec, keys[:found]) if found else None

        answer = self._timed(get)
        if answer is None:
            return None
        found, state = answer
        if found and state is None:
            self._fault(f"the store listed a run of {found} page(s) and delivered none; recomputing")
        return state

    def push(self, seq_id: object, keys: Sequence[bytes], first: int, last: int) -> None:
        """Pages do not go out as they fill (see :meth:`push_step`)."""
        return None

    def push_step(self, seq_id: object, keys: Sequence[bytes], before: int, after: int, prompt_len: int) -> None:
        """A step took a sequence from ``before`` to ``after`` positions: queue the sealed values of the pages it
        sealed and, if it filled the prompt's last page before the token it leaves to compute
        (``(prompt_len - 1) // 64 - 1``), that page's end value. Never raises."""
        for index in range(sealed_blocks(before), sealed_blocks(after)):
            self._push_page(seq_id, keys, SEALED, index)
        end = (prompt_len - 1) // self.spec.block_size - 1
        if end >= 0 and before < (end + 1) * self.spec.block_size <= after:
            self._push_page(seq_id, keys, END, end)

    def push_end(self, seq_id: object, keys: Sequence[bytes], length: int, prompt_len: int) -> None:
        """A sequence of ``length`` positions finished: queue the end value of its last full page (the page the
        pool keeps for the next turn of a chat) unless :meth:`push_step` sent it. Never raises."""
        end = length // self.spec.block_size - 1
        if end >= 0 and end != (prompt_len - 1) // self.spec.block_size - 1:
            self._push_page(seq_id, keys, END, end)

    def _push_page(self, seq_id: object, keys: Sequence[bytes], kind: int, index: int) -> None:
        try:
            if kind == SEALED:
                key, arrays = keys[index], self.cache.sealed_page(seq_id, index)
            else:
                key, arrays = end_key(keys[index]), self.cache.page_rows(seq_id, index)
            self.writer.submit(key, self.store.encode_page(self.spec, key, kind, index, arrays))
            self.pushed_blocks += kind == SEALED
            self.pushed_ends += kind == END
        except Exception as exc:  # noqa: BLE001
            self._fault(f"push raised {type(exc).__name__}: {exc}")
