"""``disk:PATH``: one file per block under ``PATH/namespace/``, content-addressed by the block key.

A block lives at ``PATH/namespace/ab/cdef...`` (the key's hex, fanned out by its first byte). Writes are
atomic and first-writer-wins: the value goes to a temporary file in the namespace directory, is fsynced, then
hard-linked to its final name (``link`` fails if the name exists, unlike ``rename``) and the directory is
fsynced; a crash leaves at most a stray ``.tmp-*`` file, never a partial block under a key. Stray temporary
files older than a minute are removed when the store opens.

Size bound: when the bytes written push the directory's total over ``max_bytes``, the directory is scanned
and the least recently used blocks are deleted until it holds 90 % of the bound. "Used" is the file's access
time, set explicitly on every read (``os.utime``; ``relatime`` mounts would not update it). With several
processes on one directory each keeps its own running total, corrected by each scan, so the bound holds to
within what the others wrote since. TTL: a block older than ``ttl`` seconds (by its write time) is a miss and
is deleted on read.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from .base import BlockStore
from .errors import InvalidStoreUrl, StoreUnavailable

__all__ = ["DiskBlockStore", "parse_size"]

DEFAULT_MAX_BYTES = 10 << 30
# A value larger than this is not an int8kv block (a 16-token block of a 70B model is ~10 MB): refused unread.
MAX_VALUE_BYTES = 256 << 20
_STALE_TMP_SECONDS = 60.0
_LOW_WATER = 0.9
_SIZE = re.compile(r"(\d+)\s*([kmgt]?)i?b?", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from ``1048576``, ``"512m"``, ``"10G"``, ``"4GiB"`` (powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _SIZE.fullmatch(str(text).strip())
    if not match or int(match.group(1)) <= 0:
        raise InvalidStoreUrl(f"a size is a positive number of bytes with an optional k/m/g/t suffix, got {text!r}")
    return int(match.group(1)) << (10 * "kmgt".find(match.group(2).lower()) + 10 if match.group(2) else 0)


class DiskBlockStore(BlockStore):
    """Blocks as files in a directory; see the module docstring for layout, atomicity and eviction."""

    scheme = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        namespace: str = "int8kv",
        ttl: float | None = None,
        max_bytes: int | str = DEFAULT_MAX_BYTES,
    ) -> None:
        super().__init__(namespace, ttl)
        self.root = Path(path) / self.namespace
        self.max_bytes = parse_size(max_bytes)
        self._evict_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._total = self._scan(remove_stale=True)[0]
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a block store: {exc}") from exc

    # --------------------------------------------------------------------------------------- layout
    def path_of(self, key: bytes) -> Path:
        name = bytes(key).hex()
        return self.root / name[:2] / name[2:]

    def total_bytes(self) -> int:
        """Bytes held by blocks in the directory now (a scan)."""
        return self._scan()[0]

    # --------------------------------------------------------------------------------------- hooks
    def _exists(self, keys: list[bytes]) -> Sequence[bool]:
        present: list[bool] = []
        for key in keys:  # local: stop at the first miss instead of a batched round trip
            present.append(self._fresh(self.path_of(key)))
            if not present[-1]:
                break
        return present

    def _get(self, keys: list[bytes]) -> Sequence[bytes | None]:
        return [self._read(self.path_of(key)) for key in keys]

    def _put_if_absent(self, key: bytes, value: bytes) -> bool:
        final = self.path_of(key)
        if self._fresh(final):
            return False
        final.parent.mkdir(exist_ok=True)
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _fsync_dir(final.parent)
        with self._evict_lock:
            self._total += len(value)
            over = self._total > self.max_bytes
        if over:
            self._evict()
        return True

    def _delete(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(key))

    # --------------------------------------------------------------------------------------- helpers
    def _fresh(self, path: Path) -> bool:
        """The block exists and has not outlived the TTL (an expired one is deleted)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if self.ttl is not None and time.time() - st.st_mtime > self.ttl:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return False
        return True

    def _read(self, path: Path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > MAX_VALUE_BYTES:
                    return None
                if self.ttl is not None and time.time() - st.st_mtime > self.ttl:
                    os.unlink(path)
                    return None
                data = f.read(MAX_VALUE_BYTES + 1)
        except FileNotFoundError:  # evicted or deleted since lookup
            return None
        # Mark as used for LRU: atime = now, mtime (the write time, for TTL) kept.
        with contextlib.suppress(OSError):
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
        return data

    def _scan(self, remove_stale: bool = False) -> tuple[int, list[tuple[float, int, str]]]:
        """Total block bytes and (atime, size, path) of every block; optionally removes stale temp files."""
        total, entries = 0, []
        now = time.time()
        with os.scandir(self.root) as top:
            for sub in top:
                if sub.name.startswith(".tmp-"):
                    if remove_stale:
                        with contextlib.suppress(OSError):
                            if now - sub.stat().st_mtime > _STALE_TMP_SECONDS:
                                os.unlink(sub.path)
                    continue
                if not sub.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(sub.path) as files:
                    for entry in files:
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat(follow_symlinks=False)
                            total += st.st_size
                            entries.append((st.st_atime, st.st_size, entry.path))
        return total, entries

    def _evict(self) -> None:
        with self._evict_lock:
            total, entries = self._scan()
            target = int(self.max_bytes * _LOW_WATER)
            entries.sort()
            for _, size, path in entries:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
            self._total = total

    def __repr__(self) -> str:
        return f"DiskBlockStore({str(self.root)!r}, namespace={self.namespace!r}, max_bytes={self.max_bytes})"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open directories have no directory fsync either
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
