"""The filesystem side of KV files: path arguments, opening for reading without blocking, atomic writes, and
removing the temporaries a killed writer left behind. Knows nothing of the format's contents."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import KvFileUnreadable, KvFileUnwritable, KvPathError

__all__ = [
    "STALE_TEMP_AGE_S",
    "check_path",
    "check_save_target",
    "open_for_reading",
    "refuse_irregular",
    "refuse_unwritable",
    "remove_stale_temporaries",
    "write_atomic",
]

# A temporary no writer has touched for this long is abandoned whoever made it (another host on a shared
# directory, a reused PID, a name from before PIDs were recorded). A live writer touches its temporary with
# every chunk it writes, and a whole save of a typical state takes well under a second, so a day is far beyond
# any stall of a live writer.
STALE_TEMP_AGE_S = 24 * 3600
# Identifies this machine in temporary names, so a PID is only tested on the machine that owns it.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# Linux's largest possible PID is 2**22; anything larger in a name cannot be a live process here.
_MAX_PID = 1 << 22


def check_path(path: object) -> str:
    """``path`` as a str, or KvPathError: only str and os.PathLike are paths. An int would be taken by
    ``open`` as a file descriptor (and closed), bytes and PathLikes returning bytes are refused too."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise KvPathError(f"a KV file path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise KvPathError(f"a KV file path must be text, got {type(text).__name__}")
    if not text or "\0" in text:
        raise KvPathError(f"a KV file path must be non-empty and hold no NUL byte, got {text!r}")
    return text


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def refuse_irregular(mode: int, path: str) -> None:
    if not stat.S_ISREG(mode):
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
        raise KvFileUnreadable(code, f"not a regular file ({_kind(mode)}): KV files are regular files", path)


def refuse_unwritable(mode: int, path: str) -> None:
    """KvFileUnwritable unless ``mode`` (an ``lstat`` of the target) is a regular file's: renaming over a
    device, FIFO, socket or symlink would replace that node (as root, a system's /dev/null) with a file."""
    if not stat.S_ISREG(mode):
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EEXIST
        raise KvFileUnwritable(code, f"not a regular file ({_kind(mode)}): save_kv only replaces regular files", path)


def _unwritable(exc: OSError, path: str, where: str = "") -> KvFileUnwritable:
    return KvFileUnwritable(exc.errno, f"cannot write KV file{where}: {exc.strerror or exc}", path)


def check_save_target(path: str) -> None:
    """Refuse (KvFileUnwritable) a save target that is not a regular file or a new name in an existing folder;
    changes nothing. The target is not followed if it is a symlink (the link itself is refused)."""
    if path.endswith(("/", os.sep)):
        raise KvFileUnwritable(errno.EISDIR, "the path names a directory, not a file to write", path)
    try:
        refuse_unwritable(os.lstat(path).st_mode, path)
        return
    except FileNotFoundError:
        pass  # a new file: its folder must exist
    except KvFileUnwritable:
        raise
    except OSError as exc:  # ENOTDIR (under a regular file), EACCES, ELOOP, ENAMETOOLONG
        raise _unwritable(exc, path) from exc
    folder = os.path.dirname(path) or "."
    try:
        is_dir = stat.S_ISDIR(os.stat(folder).st_mode)
    except OSError as exc:
        raise _unwritable(exc, path, f" in folder {folder!r}") from exc
    if not is_dir:
        raise KvFileUnwritable(errno.ENOTDIR, f"cannot write KV file: {folder!r} is not a folder", path)


@contextlib.contextmanager
def open_for_reading(path: str) -> Iterator[tuple[BinaryIO, int]]:
    """Open a regular file for reading and yield it with its size; OSErrors become KvFileUnreadable.

    A FIFO or a device would block ``open`` (or every read) forever, so the path is stat'ed first, opened
    with O_NONBLOCK (a FIFO that appears between the two calls cannot block the open), and the opened
    descriptor is fstat'ed and checked again (the path may have been swapped meanwhile).
    """
    try:
        refuse_irregular(os.stat(path).st_mode, path)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except KvFileUnreadable:
        raise
    except OSError as exc:
        raise KvFileUnreadable(exc.errno, f"cannot open KV file: {exc.strerror}", path) from exc
    try:
        st = os.fstat(fd)
        refuse_irregular(st.st_mode, path)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file: reads behave the same, restored for clarity
        f = os.fdopen(fd, "rb")
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError) and not isinstance(exc, KvFileUnreadable):
            raise KvFileUnreadable(exc.errno, f"cannot open KV file: {exc.strerror}", path) from exc
        raise
    try:
        yield f, st.st_size
    except OSError as exc:
        if isinstance(exc, KvFileUnreadable):
            raise
        raise KvFileUnreadable(exc.errno, f"cannot read KV file: {exc.strerror}", path) from exc
    finally:
        f.close()


def _default_mode() -> int:
    # mkstemp creates files 0600; a saved cache should get the permissions any other new file would.
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_NEW_FILE_MODE = _default_mode()


def _temp_pattern(name: str) -> re.Pattern[str]:
    # ".{name}.{host}-{pid}.{random}.tmp" (this writer) or ".{name}.{random}.tmp" (int8kv before PIDs were
    # recorded); mkstemp's random part is 8 of [a-z0-9_].
    return re.compile(rf"\.{re.escape(name)}\.(?:([0-9a-f]{{8}})-([0-9]{{1,12}})\.)?[a-z0-9_]{{8}}\.tmp")


def _process_exists(pid: int) -> bool:
    if pid <= 0 or pid > _MAX_PID:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists but belongs to another user
        return True
    return True


def remove_stale_temporaries(path: Path, now: float | None = None) -> list[str]:
    """Remove the temporaries of earlier saves to ``path`` that no writer will finish; returns their names.

    A temporary is stale when its name records this host and a PID that no longer exists (the writer was
    killed: removed at once), or when nobody has modified it for STALE_TEMP_AGE_S (any other case: another
    host, a PID since reused, an older name). A live writer's temporary is never removed: its process exists
    and it keeps the file's mtime fresh. PIDs are tested only on POSIX (``os.kill`` terminates on Windows).
    Best effort: a temporary that cannot be examined or removed is left.
    """
    directory = path.parent
    pattern = _temp_pattern(path.name)
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            host, pid = match.groups()
            dead = os.name == "posix" and host == _HOST and pid is not None and not _process_exists(int(pid))
            if dead or now - st.st_mtime > STALE_TEMP_AGE_S:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
    return removed


def write_atomic(path: Path, chunks: Iterable[memoryview | bytes]) -> None:
    """Write ``chunks`` to ``path`` atomically: a temporary in the same directory (stale ones of the same
    target removed first), fsynced, renamed over ``path``, and the directory fsynced. A crash leaves either
    the old file or the complete new one at ``path``, never a partial file; a failure removes the temporary.
    Only a regular file or a new name is replaced (`check_save_target`, checked first and again just before
    the rename); OSErrors become KvFileUnwritable.
    """
    name = str(path)
    check_save_target(name)
    directory = path.parent
    try:
        mode = path.stat().st_mode & 0o7777  # an overwritten file keeps its permissions
    except OSError:
        mode = _NEW_FILE_MODE
    remove_stale_temporaries(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise _unwritable(exc, name) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        check_save_target(name)  # something put at the path while the data was written is not replaced
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, KvFileUnwritable):
            raise _unwritable(exc, name) from exc
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
