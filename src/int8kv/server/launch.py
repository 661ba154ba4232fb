"""`int8kv serve` as a child process on a free loopback port, for benchmarks and tests: started with a bounded
wait for /health, stopped by its own pid (SIGTERM, then SIGKILL only if it does not exit in time)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import int8kv

from ..errors import KvCacheError

PACKAGE_ROOT = Path(int8kv.__file__).resolve().parents[1]  # so the child imports this very int8kv


class ServerStartError(KvCacheError, RuntimeError):
    """The child server exited or did not answer /health in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def read_metric(base: str, name: str) -> float:
    """One unlabelled sample from the server's /metrics."""
    _, text = http_get(base + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in /metrics")


class LocalServer:
    """`python -m int8kv.cli serve <args>` on 127.0.0.1:<free port>; `base` is its URL, `stop()` sends SIGTERM."""

    def __init__(self, *args: str, startup_timeout: float = 300.0, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`env`: variables added to the child's environment."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE_ROOT),
                                                                                    os.environ.get("PYTHONPATH")) if p))
        self._log = open(self.log_path, "w") if self.log_path else None  # noqa: SIM115 - closed in _reap()
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "int8kv.cli", "serve", "--port", str(self.port),
                                      "--quiet", *args], env=env, stdout=out, stderr=out)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                self._reap()
                raise ServerStartError(f"server exited with {self.proc.returncode} during start-up:\n{self.output()}")
            try:
                if http_get(self.base + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(f"server not ready within {startup_timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reap()

    def _reap(self) -> None:
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
