"""numba's disk cache (``cache=True``) shared safely by processes that compile at the same time.

numba keeps one index file per function (signature -> data file) and one data file per compiled signature. Its
save (numba 0.68, ``caching.IndexDataCacheFile.save``) reads the index, takes the first free data-file number,
writes the index, then the data file, under no lock. Two processes compiling two signatures of one function at
once (the suite's two pytest workers; server replicas starting together) can both take number 1: the index
then names one process's machine code under the other's signature, and a later load runs it on argument types
it was not compiled for. Nothing in numba checks. A process that loads while another saves can also read an index
entry whose data file is not yet written, or still holds a stale build of the same number.

:func:`share_compiles` gives each cached dispatcher of a module:

* a cache whose index is read under a shared lock and written (index and data together) under an exclusive one,
  in a lock file beside the index, so an index entry always names the data written for its key;
* a compile lock per (function, signature): a process that needs a signature another process is compiling waits
  for it and then loads it from the disk cache instead of compiling it a second time. One kernel specialisation
  is 15-50 s of CPU (ops/cpu.py); the suite's two workers used to compile each one twice at once.

Locks are ``flock`` on files in the cache directory, released when the holder ends however it ends; a directory
where they cannot be made leaves numba's own behaviour. A holder that does not end (stopped by SIGSTOP or
Ctrl-Z, hung) must not stop every other process: a waiter polls, says after ``LOCK_NOTE_S`` seconds which lock
it waits for and the holder's pid (an exclusive holder writes it into the lock file), and gives up after
``$INT8KV_NUMBA_LOCK_TIMEOUT`` seconds (default ``LOCK_TIMEOUT_S``), or at once past the note when the holder is
known to be stopped. Without the compile lock it compiles in-process (a second compile of the signature, no
more); without the index lock it neither reads nor writes the index (a miss, an unsaved build), so an index
entry still always names the data written for its key.

A damaged entry (an empty, truncated or garbage ``.nbi`` or ``.nbc``: a full disk, a killed writer on a
filesystem without atomic renames) is a miss with a logged warning: the signature compiles again and its save
overwrites the entry (a damaged index is replaced by an empty one first). It used to fail every later process
at its first kernel call. numba's entries are pickles holding machine code, so whoever can write the cache
directory runs code in every process that loads from it, pickle or not: the directory must be trusted as much as
the package's own files (numba's default is the package's ``__pycache__``; a shared ``NUMBA_CACHE_DIR`` must not
be writable by other users). Each cached dispatcher must come from its own Python
function: twins made from one (``njit(parallel=True)(f)`` and ``njit(f.py_func)``) share an index file and its
keys (the key holds the signature and the code, not the options), so one would load the other's build;
:func:`share_compiles` refuses them.

Each index key also holds a digest of this package's modules that contain numba code (`numba_sources_digest`).
numba keys a cached build by the function's own bytecode and drops an index when the function's own file
changes, but a kernel inlines intrinsics and callees from other modules: with only ops/cpu_simd.py changed (a
branch switch), ops/cpu.py's kernels would load from the cache as built from the old intrinsics.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator

import numba
from numba.core import caching, sigutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher

log = logging.getLogger("int8kv.numba_cache")

LOCK_NOTE_S = 5.0  # a wait this long is logged once, naming the lock and its holder
LOCK_TIMEOUT_S = 300.0  # then the waiter goes on without the lock; a kernel's compile is 15-50 s of CPU
TIMEOUT_ENV = "INT8KV_NUMBA_LOCK_TIMEOUT"

_HELD: dict[str, int] = {}  # lock path -> depth, for the locks this process holds (under numba's compiler lock)
_DIGESTS: dict[str, str] = {}  # package directory -> numba_sources_digest, computed once per process


def numba_sources_digest(root: str | None = None) -> str:
    """SHA-256 (hex) over the ``.py`` files under ``root`` (default: this package) whose text mentions numba,
    their relative paths and contents, in path order: what every cached kernel's key holds, so that editing
    any module with numba code rebuilds every kernel and editing any other rebuilds none. Computed once per
    process and kept, as it reads every module."""
    root = os.path.dirname(os.path.abspath(__file__)) if root is None else os.path.abspath(root)
    digest = _DIGESTS.get(root)
    if digest is None:
        hasher = hashlib.sha256()
        paths = []
        for folder, _, files in os.walk(root):
            paths += [os.path.join(folder, name) for name in files if name.endswith(".py")]
        for path in sorted(paths):
            with open(path, "rb") as f:
                text = f.read()
            if b"numba" in text:
                hasher.update(os.path.relpath(path, root).encode() + b"\0" + text + b"\0")
        digest = _DIGESTS[root] = hasher.hexdigest()
    return digest


def _lock_timeout() -> float:
    try:
        return max(0.0, float(os.environ.get(TIMEOUT_ENV, LOCK_TIMEOUT_S)))
    except ValueError:
        return LOCK_TIMEOUT_S


def _holder(fd: int) -> int | None:
    """The pid an exclusive holder wrote into the lock file, if any."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def _stopped(pid: int | None) -> bool:
    """``pid`` is stopped (SIGSTOP, Ctrl-Z) or traced, as /proc tells (False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _acquire(fd: int, path: str, shared: bool) -> bool:
    """Take ``flock`` on ``fd``, polling; False once the wait has lasted the timeout (module docs)."""
    operation = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    start, pause, noted = time.monotonic(), 0.002, False
    while True:
        try:
            fcntl.flock(fd, operation)
            return True
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= min(LOCK_NOTE_S, _lock_timeout()):
            pid = _holder(fd)
            if not noted:
                noted = True
                log.warning("waiting for numba cache lock %s (held by %s) for %.0f s; going on without it after "
                            "%g s (%s)", path, f"pid {pid}" if pid else "an unknown process", waited,
                            _lock_timeout(), TIMEOUT_ENV)
            if _stopped(pid) or waited >= _lock_timeout():
                log.warning("going on without numba cache lock %s (held by %s%s)", path,
                            f"pid {pid}" if pid else "an unknown process", ", stopped" if _stopped(pid) else "")
                return False
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


@contextlib.contextmanager
def _locked(path: str, shared: bool = False) -> Iterator[bool | None]:
    """Hold ``flock`` on ``path`` (created if needed); yields True when held, False when the wait timed out
    (module docs), None when the path cannot be opened (not locked: numba's own behaviour). Called with numba's
    compiler lock held, so one thread of this process at a time; re-entrant for the nested compiles of callees."""
    if path in _HELD:
        _HELD[path] += 1
        try:
            yield True
        finally:
            _HELD[path] -= 1
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield None
        return
    try:
        if not _acquire(fd, path, shared):
            yield False
            return
        if not shared:  # named in a waiter's message
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[path] = 1
        try:
            yield True
        finally:
            del _HELD[path]
            if not shared:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


class SharedFunctionCache(caching.FunctionCache):
    """numba's function cache with its index read under a shared lock and written under an exclusive one."""

    def _index_key(self, sig, codegen):
        """numba's key (signature, target, the function's bytecode) and the digest of the package's numba
        modules (module docs)."""
        return (*super()._index_key(sig, codegen), numba_sources_digest())

    def _lock_path(self, suffix: str) -> str:
        return os.path.join(self.cache_path, f"{self._impl.filename_base}.{suffix}.lock")

    def load_overload(self, sig, target_context):
        with _locked(self._lock_path("index"), shared=True) as held:
            if held is False:  # timed out: the holder may be halfway through writing the index and data
                return None
            try:
                return super().load_overload(sig, target_context)
            except Exception as exc:  # a damaged entry, whatever unpickling it raised: a miss (module docs)
                log.warning("numba cache entry of %s for %s (index %s) unreadable (%s: %s): compiling it again",
                            self._py_func.__qualname__, sig, self._cache_file._index_path, type(exc).__name__, exc)
                return None

    def save_overload(self, sig, data):
        try:
            self._impl.locator.ensure_cache_path()
        except OSError:
            return super().save_overload(sig, data)
        with _locked(self._lock_path("index")) as held:
            if held is False:
                log.warning("numba cache build of %s for %s not saved: its index lock was not free",
                            self._py_func.__qualname__, sig)
                return
            try:
                self._cache_file._load_index()
            except Exception as exc:  # numba's save reads the index first: a damaged one is replaced
                log.warning("numba cache index %s unreadable (%s: %s): replaced by an empty one",
                            self._cache_file._index_path, type(exc).__name__, exc)
                self._cache_file.flush()
            super().save_overload(sig, data)

    @contextlib.contextmanager
    def compiling(self, sig) -> Iterator[None]:
        """Held while this process loads or compiles ``sig``: one process at a time per signature, or this one
        without the lock once its holder has kept it past the timeout (module docs)."""
        digest = hashlib.sha1(repr(sig).encode()).hexdigest()[:16]
        try:
            self._impl.locator.ensure_cache_path()
        except OSError:
            yield
            return
        with _locked(self._lock_path(digest)):
            yield


def _share(dispatcher: CPUDispatcher) -> None:
    try:
        cache = SharedFunctionCache(dispatcher.py_func)
    except RuntimeError:  # no cache location numba can write: its own (null) cache stays
        return
    dispatcher._cache = cache  # what numba's own enable_caching() sets
    compile_once = dispatcher.compile

    def compile(sig):
        if tuple(sigutils.normalize_signature(sig)[0]) in dispatcher.overloads:  # built here already: no lock
            return compile_once(sig)
        # numba's compiler lock first (compile_once takes it again: it is re-entrant), so no thread of this
        # process waits for a file lock that another of its threads holds while it waits for the compiler lock
        with global_compiler_lock, cache.compiling(sig):
            return compile_once(sig)

    dispatcher.compile = compile


def share_compiles(namespace: dict) -> None:
    """Give every cached numba dispatcher in ``namespace`` (a module's ``globals()``) the shared cache and the
    per-signature compile lock (module docs). Twins of one Python function are refused (ValueError)."""
    cached = [(name, value) for name, value in namespace.items()
              if isinstance(value, CPUDispatcher) and isinstance(value._cache, caching.FunctionCache)]
    seen: dict[object, str] = {}
    for name, value in cached:  # every check before any change
        if value.py_func in seen:
            raise ValueError(f"{seen[value.py_func]} and {name} are cached builds of one Python function: their "
                             "disk cache entries would collide; give each its own function")
        seen[value.py_func] = name
    for _, value in cached:
        if not isinstance(value._cache, SharedFunctionCache):
            _share(value)


def require_jit(module: str) -> None:
    """Refuse (UnknownBackend) to load ``module``, whose kernels exist only as numba-compiled code (LLVM IR
    intrinsics, calls by address), when numba's compiler is off (``NUMBA_DISABLE_JIT=1``, numba's debugging
    switch): run as Python they failed at their first call with an AttributeError from inside numba. The codec's
    kernels and the reference backend run as Python there (slowly)."""
    if numba.config.DISABLE_JIT:
        from .errors import UnknownBackend  # here: the tests load this file alone, outside its package

        raise UnknownBackend(
            f"{module} runs numba-compiled kernels only, and NUMBA_DISABLE_JIT=1 turns numba's compiler off: unset "
            "it, or use backend='reference' (the float64 oracle) for attention"
        )
