"""The filesystem side of KV files: path arguments, files that are not regular, stale temporaries of killed saves.

Each test here failed on the single-module store.py it replaced (issue 10): a FIFO hung every reader, an int
was taken as a file descriptor and closed, a save killed with SIGKILL left its temporary forever.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from store_helpers import INT8, assert_unchanged, filled_cache, refuses, snapshot

from int8kv.cli import main
from int8kv.errors import StoreError
from int8kv.store import (
    KvFileUnreadable,
    KvFileUnwritable,
    KvPathError,
    SaveError,
    inspect_kv,
    load_kv,
    save_kv,
)
from int8kv.store.files import (
    STALE_TEMP_AGE_S,
    refuse_irregular,
    refuse_unwritable,
    remove_stale_temporaries,
    write_atomic,
)

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


def _dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_bounded(fn, fifo: Path, timeout: float = 20.0):
    """Run fn() in a thread; if it is still blocked after `timeout`, open the FIFO's other end to release it
    (so the test ends either way) and fail."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(timeout)
        pytest.fail(f"blocked for more than {timeout} s on a FIFO")
    return result


@needs_fifo
@pytest.mark.parametrize("reader", ["load_kv", "inspect_kv", "cli"])
def test_a_fifo_is_refused_without_blocking(tmp_path, capsys, reader) -> None:
    fifo = tmp_path / "f.kv"
    os.mkfifo(fifo)
    target = filled_cache(INT8, tokens=5)
    before = snapshot(target)
    calls = {
        "load_kv": lambda: load_kv(fifo, target),
        "inspect_kv": lambda: inspect_kv(fifo),
        "cli": lambda: main(["cache", "inspect", str(fifo)]),
    }
    result = _run_bounded(calls[reader], fifo)
    if reader == "cli":
        assert result.get("value") == 1, result
        assert "FIFO" in capsys.readouterr().err
    else:
        error = result.get("error")
        assert isinstance(error, KvFileUnreadable) and isinstance(error, OSError), result
        assert "FIFO" in str(error)
    assert [p.name for p in tmp_path.iterdir()] == ["f.kv"]
    assert_unchanged(target, before)


@needs_fifo
def test_a_fifo_swapped_in_after_the_stat_does_not_block(tmp_path, monkeypatch) -> None:
    # The path passes the stat as a regular file, then is a FIFO when opened: the non-blocking open returns at
    # once and the fstat of the opened descriptor refuses it.
    fifo, regular = tmp_path / "f.kv", tmp_path / "r.kv"
    os.mkfifo(fifo)
    regular.write_bytes(b"x" * 16)
    real_stat = os.stat

    def swapped(path, *args, **kwargs):
        return real_stat(regular if os.fspath(path) == os.fspath(fifo) else path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", swapped)
    result = _run_bounded(lambda: inspect_kv(fifo), fifo)
    monkeypatch.undo()
    assert isinstance(result.get("error"), KvFileUnreadable) and "FIFO" in str(result["error"]), result


def test_devices_and_directories_are_refused(tmp_path) -> None:
    target = filled_cache(INT8, tokens=5)
    err = refuses(tmp_path, target, KvFileUnreadable)
    assert "directory" in str(err)
    for mode, kind in ((stat.S_IFCHR | 0o666, "character device"), (stat.S_IFBLK | 0o660, "block device")):
        with pytest.raises(KvFileUnreadable, match=kind):  # the reader's mode check, without making a device
            refuse_irregular(mode, "x.kv")


def _node(tmp_path: Path, kind: str) -> tuple[Path, list]:
    """A non-regular node at tmp_path/<kind>.kv, made without root, and what must stay as it is."""
    path = tmp_path / f"{kind}.kv"
    regular = tmp_path / "regular.kv"
    regular.write_bytes(b"the file a link points to")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.close()
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("kept")
    elif kind == "link to a file":
        path.symlink_to(regular)
    elif kind == "link to a directory":
        path.symlink_to(tmp_path)
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere.kv")
    return path, [regular.read_bytes()]


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(socket, "AF_UNIX"), reason="needs FIFOs, sockets")
@pytest.mark.parametrize(
    "kind", ["fifo", "socket", "directory", "link to a file", "link to a directory", "dangling link"]
)
def test_save_never_replaces_what_is_not_a_regular_file(tmp_path, kind) -> None:
    path, _ = _node(tmp_path, kind)
    before = os.lstat(path)
    with pytest.raises(KvFileUnwritable, match="not a regular file") as info:
        save_kv(path, filled_cache(INT8))
    assert isinstance(info.value, StoreError) and isinstance(info.value, OSError)
    after = os.lstat(path)  # the same node, untouched, and no temporary left beside it
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
    assert (tmp_path / "regular.kv").read_bytes() == b"the file a link points to"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    if kind == "directory":
        assert [p.name for p in path.iterdir()] == ["inside"]


def test_save_refuses_device_modes() -> None:
    # The check save_kv applies to an lstat of the target, on the modes of devices (made without mknod).
    for mode, kind in ((stat.S_IFCHR | 0o666, "character device"), (stat.S_IFBLK | 0o660, "block device"),
                       (stat.S_IFLNK | 0o777, "symbolic link")):
        with pytest.raises(KvFileUnwritable, match=kind):
            refuse_unwritable(mode, "x.kv")
    refuse_unwritable(stat.S_IFREG | 0o644, "x.kv")  # a regular file is replaced


@pytest.mark.parametrize("where, message", [
    ("missing/s.kv", "No such file or directory"),
    ("file/s.kv", "Not a directory"),
    ("missing/", "names a directory"),
    ("file/", "names a directory"),
])
def test_save_into_a_folder_that_is_not_one_is_a_typed_error(tmp_path, where, message) -> None:
    (tmp_path / "file").write_bytes(b"a regular file")
    with pytest.raises(KvFileUnwritable, match=message):
        save_kv(f"{tmp_path}/{where}", filled_cache(INT8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert (tmp_path / "file").read_bytes() == b"a regular file"


@needs_fifo
def test_a_fifo_put_at_the_target_during_the_write_is_not_replaced(tmp_path) -> None:
    path = tmp_path / "s.kv"
    path.write_bytes(b"old")

    def chunks():
        yield b"new bytes"
        path.unlink()
        os.mkfifo(path)  # swapped in after the first check, before the rename
        yield b"more"

    with pytest.raises(KvFileUnwritable, match="FIFO"):
        write_atomic(path, chunks())
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["s.kv"]


def test_a_failed_write_is_a_typed_error_and_leaves_the_old_file(tmp_path) -> None:
    path = tmp_path / "s.kv"
    path.write_bytes(b"old")

    def chunks():
        yield b"new"
        raise OSError(28, "No space left on device")

    with pytest.raises(KvFileUnwritable, match="No space left"):
        write_atomic(path, chunks())
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["s.kv"]


def test_a_path_that_is_not_a_path_is_refused(tmp_path) -> None:
    path = tmp_path / "s.kv"
    save_kv(path, filled_cache(INT8))
    target = filled_cache(INT8, tokens=5)
    fd = os.open(path, os.O_RDONLY)
    try:
        for bad in (fd, True, 3.0, b"s.kv", "", "a\0b", None, [str(path)]):
            err = refuses(bad, target, KvPathError)  # type: ignore[arg-type]
            assert isinstance(err, TypeError)
            with pytest.raises(KvPathError):
                inspect_kv(bad)  # type: ignore[arg-type]
            with pytest.raises(KvPathError):
                save_kv(bad, filled_cache(INT8))  # type: ignore[arg-type]
        os.fstat(fd)  # still open: the int was never taken as a descriptor
        assert os.read(fd, 8) == path.read_bytes()[:8]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.kv"]


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from int8kv import QuantizedKvCache, save_kv

    cache = QuantizedKvCache(2, 8, 2, 8)
    cache.push_step([torch.ones(4, 2, 8)] * 2, [torch.ones(4, 2, 8)] * 2)
    real_fsync = os.fsync

    def killed(fd):
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 between writing the temporary and renaming it

    os.fsync = killed
    save_kv(sys.argv[1], cache)
    """
)


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL and PID checks are POSIX")
def test_the_next_save_removes_what_a_killed_save_left(tmp_path) -> None:
    path = tmp_path / "s.kv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], env=env, timeout=300, check=False)
    assert proc.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".s.kv.") and left[0].endswith(".tmp") and not path.exists()

    # Temporaries the next save must keep: another target's, a live writer's (this process), a fresh one
    # whose writer is unknown, and a file that only looks similar.
    me = os.getpid()
    host = left[0].split(".")[3].split("-")[0]
    keep = [
        f".other.kv.{host}-{_dead_pid()}.abcd1234.tmp",
        f".s.kv.{host}-{me}.live0000.tmp",
        ".s.kv.fresh000.tmp",
        "s.kv.tmp",
        f".s.kv.{host}-{me}.notatemp",
    ]
    # ...and the ones it must remove: a dead writer of this host, an old one of another host, an old legacy one.
    stale = [f".s.kv.{host}-{_dead_pid()}.dead0000.tmp", ".s.kv.ffffffff-1.other000.tmp", ".s.kv.legacy00.tmp"]
    for name in keep + stale:
        (tmp_path / name).write_bytes(b"partial")
    old = time.time() - STALE_TEMP_AGE_S - 60
    for name in stale[1:]:
        os.utime(tmp_path / name, (old, old))

    # A refused save touches nothing, stale temporaries included.
    with pytest.raises(SaveError):
        save_kv(path, filled_cache(INT8), metadata={"x": float("nan")})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left + keep + stale)

    save_kv(path, filled_cache(INT8))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s.kv", *keep])
    assert load_kv(path).seq_len == 20


def test_stale_removal_never_takes_a_live_or_recent_temporary(tmp_path) -> None:
    path = tmp_path / "t.kv"
    (tmp_path / ".t.kv.legacy00.tmp").write_bytes(b"x")
    assert remove_stale_temporaries(path) == []  # fresh: its writer may still be running
    later = time.time() + STALE_TEMP_AGE_S + 1
    assert remove_stale_temporaries(path, now=later) == [".t.kv.legacy00.tmp"]
    os.symlink(tmp_path / "elsewhere", tmp_path / ".t.kv.symlink0.tmp")
    assert remove_stale_temporaries(path, now=later) == []  # only regular files
