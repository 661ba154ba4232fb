"""Store URLs: the factory's scheme dispatch and the Redis/Valkey URL parser (TLS and cluster forms)."""

from __future__ import annotations

import pytest

from int8kv.blockstore import InvalidBlockKey, InvalidStoreSecret, InvalidStoreUrl, StoreUnavailable, open_block_store
from int8kv.blockstore.base import READ_DEADLINE_ENV, BlockStore
from int8kv.blockstore.disk import DiskBlockStore, parse_size
from int8kv.blockstore.factory import SECRET_ENV
from int8kv.blockstore.redis import RedisBlockStore, parse_redis_url


def test_tls_url_with_password_user_db_and_options():
    t = parse_redis_url("rediss://alice:s%40cr%3At@cache.example:6380/3?timeout=0.5&ssl_cert_reqs=none")
    assert t.tls and not t.cluster
    assert t.hosts == (("cache.example", 6380),)
    assert (t.username, t.password, t.db, t.timeout) == ("alice", "s@cr:t", 3, 0.5)
    assert t.ssl == {"ssl_cert_reqs": "none"}
    assert "s@cr" not in repr(t) and "s@cr" not in t.describe() and "***" in t.describe()


def test_password_only_forms_and_defaults():
    assert parse_redis_url("valkeys://:pw@h").password == "pw"
    t = parse_redis_url("redis://pw@h")
    assert (t.username, t.password, t.hosts, t.db, t.tls) == (None, "pw", (("h", 6379),), 0, False)
    assert parse_redis_url("valkey://[::1]:7000/1").hosts == (("::1", 7000),)


def test_cluster_urls():
    t = parse_redis_url("valkey+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert t.cluster and not t.tls and t.password == "pw"
    assert t.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    tls = parse_redis_url("rediss+cluster://h1:1,h2:2/?ssl_ca_certs=/etc/ca.pem")
    assert tls.tls and tls.ssl == {"ssl_ca_certs": "/etc/ca.pem"}


@pytest.mark.parametrize(
    "url",
    [
        "redis://h1:1,h2:2",  # several hosts without +cluster
        "redis+cluster://h1:1/2",  # a cluster has only db 0
        "redis://h:99999",
        "redis://h:port",
        "redis://:pw@",
        "redis://[::1",
        "redis://h/db",
        "redis://h?timeout=0",
        "redis://h?timeout=abc",
        "redis://h?ssl_ca_certs=/ca.pem",  # a TLS option without TLS
        "rediss://h?ssl_cert_reqs=maybe",
        "redis://h?frobnicate=1",
        "memcached://h",
        "redis:/h",
    ],
)
def test_malformed_urls_are_typed_errors(url):
    with pytest.raises(InvalidStoreUrl):
        parse_redis_url(url)


def test_factory_dispatches_by_scheme(tmp_path):
    store = open_block_store(f"disk:{tmp_path}?max_bytes=1m", namespace="ns-1", ttl=60)
    assert isinstance(store, DiskBlockStore) and store.max_bytes == 1 << 20 and store.ttl == 60
    assert store.root == tmp_path / "ns-1"
    redis_store = open_block_store("rediss://:pw@127.0.0.1:1/0", namespace="tenant.a")
    assert isinstance(redis_store, RedisBlockStore)  # no connection is made until first use
    assert redis_store.key_name(b"\x01\xab") == b"tenant.a:01ab"
    assert "pw" not in repr(redis_store)
    redis_store.close()


@pytest.mark.parametrize(
    "url",
    ["", "disk:", "disk:/x?max_bytes=lots", "disk:/x?size=1", "embedded?tcp=maybe", "embedded?port=1", "s3://b"],
)
def test_factory_refuses_bad_urls(url, tmp_path):
    with pytest.raises(InvalidStoreUrl):
        open_block_store(url.replace("/x", str(tmp_path)))


@pytest.mark.parametrize("namespace", ["", "a:b", "a/b", "x" * 65, 3])
def test_bad_namespace_is_refused(namespace, tmp_path):
    with pytest.raises(InvalidBlockKey):
        open_block_store(f"disk:{tmp_path}", namespace=namespace)


@pytest.mark.parametrize("ttl", [0, -1, 0.5, True, "60", 2**31])
def test_bad_ttl_is_refused(ttl, tmp_path):
    with pytest.raises(InvalidBlockKey):
        open_block_store(f"disk:{tmp_path}", ttl=ttl)


def test_parse_size():
    assert [parse_size(s) for s in ("1", "2k", "3M", "4GiB", "1tb", 5)] == [1, 2048, 3 << 20, 4 << 30, 1 << 40, 5]
    for bad in ("", "0", "-1", "1x", "1.5g", 0):
        with pytest.raises(InvalidStoreUrl):
            parse_size(bad)


def test_disk_store_on_an_unusable_path_is_a_typed_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreUnavailable):
        open_block_store(f"disk:{blocker}")


def test_a_secret_from_the_argument_or_the_environment_names_keys_apart(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    key = bytes(range(32))
    plain = open_block_store(f"disk:{tmp_path}")
    given = open_block_store(f"disk:{tmp_path}", secret="sixteen bytes ok")
    monkeypatch.setenv(SECRET_ENV, "sixteen bytes ok")
    from_env = open_block_store("redis://127.0.0.1:1/0")
    assert not plain.authenticated and given.authenticated and from_env.authenticated
    assert plain.key_id(key) == key.hex()
    assert given.key_id(key) == from_env.key_id(key) != key.hex() and len(given.key_id(key)) == 64
    assert open_block_store(f"disk:{tmp_path}", secret="another secret!!").key_id(key) != given.key_id(key)
    from_env.close()


@pytest.mark.parametrize("secret", ["short", b"", b"fifteen bytes!!", bytes(16), "0" * 32])
def test_a_short_or_one_byte_secret_is_refused_before_anything_opens(secret, tmp_path, monkeypatch):
    with pytest.raises(InvalidStoreSecret):
        open_block_store("embedded", secret=secret)  # refused before a server starts
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(InvalidStoreSecret):
        open_block_store(f"disk:{tmp_path}")
    assert not (tmp_path / "int8kv").exists()


def test_the_read_deadline_comes_from_the_environment_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(READ_DEADLINE_ENV, "0.25")
    assert open_block_store(f"disk:{tmp_path}").read_deadline == 0.25
    monkeypatch.delenv(READ_DEADLINE_ENV)
    assert open_block_store(f"disk:{tmp_path}").read_deadline == BlockStore.read_deadline == 0.1
    for bad in ("0", "-1", "soon", "nan", "1e9"):
        monkeypatch.setenv(READ_DEADLINE_ENV, bad)
        with pytest.raises(InvalidStoreUrl, match=READ_DEADLINE_ENV):
            open_block_store(f"disk:{tmp_path}")
