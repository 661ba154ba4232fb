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

Hostile entries: a block is read through ``open(O_NONBLOCK | O_NOFOLLOW)`` relative to its fan-out directory
(itself opened with ``O_NOFOLLOW``), the opened descriptor is checked to be a regular file, and at most the
expected size + 1 bytes are read. A FIFO, device node, socket, directory or symbolic link under a block's name
is a miss that never blocks, and the entry (never what a link points to) is removed so a writer can replace it.
Writes go through descriptors of the namespace and fan-out directories opened with ``O_NOFOLLOW``: a link in
place of the namespace directory fails the put, one in place of a fan-out directory is removed and replaced by
a directory. A namespace directory removed while the store is open (a cleared cache) is made again by the next
put, as at start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from .base import BlockStore
from .errors import CorruptBlock, InvalidStoreUrl, StoreUnavailable

__all__ = ["DiskBlockStore", "parse_size"]

DEFAULT_MAX_BYTES = 10 << 30
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
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
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(namespace, ttl, secret)
        self.root = Path(path) / self.namespace
        self.max_bytes = parse_size(max_bytes)
        self._evict_lock = threading.Lock()
        try:
            os.close(self._open_root())  # made if missing; a link in its place is refused, as at every put
            self._total = self._scan(remove_stale=True)[0]
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a block store: {exc}") from exc

    # --------------------------------------------------------------------------------------- layout
    def path_of(self, key: bytes) -> Path:
        name = self.key_id(key)
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

    def _get(self, keys: list[bytes], limit: int) -> Sequence[bytes | None | Exception]:
        return [self._read_file(self.path_of(key), limit) for key in keys]

    def _put_if_absent(self, key: bytes, value: bytes) -> bool:
        final = self.path_of(key)
        if self._fresh(final):
            return False
        root = self._open_root()
        try:
            fanout = _open_fanout(root, final.parent.name)
            try:
                written = _write_new(root, fanout, final.name, value)
            finally:
                os.close(fanout)
        finally:
            os.close(root)
        if not written:
            return False
        with self._evict_lock:
            self._total += len(value)
            over = self._total > self.max_bytes
        if over:
            self._evict()
        return True

    def _open_root(self) -> int:
        """The namespace directory's descriptor, never through a symbolic link planted there (ELOOP: the put
        fails). Made again, as at start, when it has been removed while the store is open (a cleared cache
        directory): without that every later put failed until the process restarted."""
        try:
            return os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.root, _DIR_FLAGS)

    def _delete(self, keys: list[bytes]) -> None:
        for key in keys:
            _unlink_entry(self.path_of(key))

    def _unreachable(self, exc: BaseException) -> bool:
        return False  # a local call fails fast: no back-off needed (a stuck disk misses its read deadline)

    # --------------------------------------------------------------------------------------- helpers
    def _fresh(self, path: Path) -> bool:
        """A regular file is at ``path`` and has not outlived the TTL (an expired block, and anything that is
        not a regular file, is removed)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or (self.ttl is not None and time.time() - st.st_mtime > self.ttl):
            _unlink_entry(path)
            return False
        return True

    def _read_file(self, path: Path, limit: int) -> bytes | None | Exception:
        """At most ``limit + 1`` bytes of the block at ``path``; None if absent or expired (removed); a
        CorruptBlock (for the caller to count and remove) if it is not a regular file. Never blocks on a FIFO."""
        try:
            parent = os.open(path.parent, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:  # the fan-out directory is a link or not a directory
            return CorruptBlock(f"{path.parent.name} is not a directory: {exc}")
        try:
            fd = os.open(path.name, _READ_FLAGS, dir_fd=parent)
        except FileNotFoundError:  # evicted or deleted since lookup
            return None
        except OSError as exc:  # ELOOP: a symbolic link (O_NOFOLLOW); ENXIO: a socket or a writer-less device
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                return CorruptBlock(f"not a regular file: {exc.strerror}")
            raise
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO opened without blocking, a device node
                return CorruptBlock(f"not a regular file (mode {stat.filemode(st.st_mode)})")
            if self.ttl is not None and time.time() - st.st_mtime > self.ttl:
                _unlink_entry(path)
                return None
            chunks, left = [], min(limit + 1, st.st_size + 1)
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            # Mark as used for LRU: atime = now, mtime (the write time, for TTL) kept; on the descriptor.
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        finally:
            os.close(fd)
        return b"".join(chunks)

    def _scan(self, remove_stale: bool = False) -> tuple[int, list[tuple[float, int, str]]]:
        """Total block bytes and (atime, size, path) of every block; optionally removes stale temp files."""
        total, entries = 0, []
        now = time.time()
        if not self.root.is_dir():  # removed while open: empty until a put makes it again
            return total, entries
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


def _unlink_entry(path: Path) -> None:
    """Remove the directory entry ``path`` (a link itself, never its target); gone already is fine."""
    with contextlib.suppress(OSError):  # a directory under a block's name stays (and stays a miss)
        os.unlink(path)


def _open_fanout(root: int, name: str) -> int:
    """The fan-out directory ``name`` in the namespace directory ``root`` (a descriptor), made if missing. A
    link or file in its place is removed (the entry, never its target) and a directory made instead, so nothing
    is written through a planted link."""
    for _ in range(2):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=root)  # the mode rule of the start's mkdir: 0o777 less the umask
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=root)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            os.unlink(name, dir_fd=root)
    raise OSError(errno.ELOOP, f"fan-out directory {name} keeps being replaced")


def _write_new(root: int, fanout: int, name: str, value: bytes) -> bool:
    """Write ``value`` to a temporary file in ``root``, fsync it, hard-link it as ``name`` in ``fanout`` (False
    if that name exists: first writer wins) and fsync ``fanout``; the temporary is removed whatever happens."""
    tmp = f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(tmp, _WRITE_FLAGS, 0o666, dir_fd=root)  # 0o666 less the umask, as open(path, "wb") made it
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(value)
            f.flush()
            os.fsync(fd)
        try:
            os.link(tmp, name, src_dir_fd=root, dst_dir_fd=fanout)
        except FileExistsError:
            return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=root)
    os.fsync(fanout)
    return True
