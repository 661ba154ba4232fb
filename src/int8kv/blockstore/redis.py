"""Redis / Valkey backend (``redis://``, ``rediss://``, ``valkey://``, ``valkeys://`` and their ``+cluster`` forms).

URLs::

    redis://[[user]:password@]host[:port][/db][?options]        one node (db 0 by default)
    rediss://...                                                 the same over TLS
    redis+cluster://[[user]:password@]host:port,host:port,...[/][?options]     a Redis/Valkey Cluster
    rediss+cluster://...                                         a cluster over TLS
    valkey://, valkeys://, valkey+cluster://, valkeys+cluster://  aliases of the above

Options (query string): ``timeout`` (socket read/write timeout in seconds, default 2), ``connect_timeout``
(default 1), and for TLS ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (none, optional,
required). The password is percent-decoded (``%40`` for ``@``).

Keys are ``namespace:`` + :meth:`BlockStore.key_id` (the key's hex, or an HMAC of it with a secret); values
are written with ``SET key value NX [EX ttl]`` (first writer wins). Lookups (``EXISTS``) and gets (``EXISTS``
+ ``GETRANGE 0 limit``: never more than the expected size + 1 bytes of a value) are one pipelined round trip
(one per node in a cluster); a key of another type fails only its own command (``WRONGTYPE``), which is one
refused value. Every client, the embedded store's included, is built by :func:`client_options`: socket
timeouts and no retries (a fault is a miss; the store's back-off decides when to ask again).
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from .base import BlockStore
from .errors import InvalidStoreUrl, StoreUnavailable

__all__ = ["REDIS_SCHEMES", "RedisBlockStore", "RedisTarget", "client_factory", "client_options", "parse_redis_url"]

# scheme -> (tls, cluster)
REDIS_SCHEMES = {
    f"{name}{tls}{cluster}": (bool(tls), bool(cluster))
    for name in ("redis", "valkey")
    for tls in ("", "s")
    for cluster in ("", "+cluster")
}
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_CERT_REQS = ("none", "optional", "required")
DEFAULT_PORT = 6379
DEFAULT_TIMEOUT = 2.0
DEFAULT_CONNECT_TIMEOUT = 1.0


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis/Valkey URL: where to connect and how (the password is kept out of ``repr``)."""

    hosts: tuple[tuple[str, int], ...]  # empty with unix_socket
    tls: bool = False
    cluster: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: float = DEFAULT_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    ssl: dict[str, str] = field(default_factory=dict)
    unix_socket: str | None = None

    def describe(self) -> str:
        """The URL without its password, for logs."""
        scheme = "rediss" if self.tls else "redis"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)
        user = f"{self.username or ''}:***@" if self.password is not None else ""
        return f"{scheme}{'+cluster' if self.cluster else ''}://{user}{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a Redis/Valkey URL of the forms in the module docstring; raises InvalidStoreUrl."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidStoreUrl(f"not a redis/valkey URL: {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise InvalidStoreUrl(f"unknown scheme {scheme!r}; accepted: {', '.join(sorted(REDIS_SCHEMES))}")
    tls, cluster = REDIS_SCHEMES[scheme]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon:  # redis://secret@host is the common short form for a password without a user
            username, password = None, unquote(user)
    hosts = tuple(_parse_host(h, url) for h in hostlist.split(","))
    if not cluster and len(hosts) != 1:
        raise InvalidStoreUrl(f"{scheme}:// takes one host; use {scheme}+cluster:// for a list of nodes")
    db = 0
    if path.strip("/"):
        if not path.strip("/").isdigit():
            raise InvalidStoreUrl(f"the database must be a number, got {path!r} in {_redact(url)}")
        db = int(path.strip("/"))
        if cluster and db != 0:
            raise InvalidStoreUrl("a cluster has only database 0")
    options: dict[str, Any] = {}
    ssl: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name in ("timeout", "connect_timeout"):
            try:
                options[name] = float(value)
            except ValueError:
                options[name] = -1.0
            if not 0 < options[name] <= 3600:
                raise InvalidStoreUrl(f"{name} must be a number of seconds in (0, 3600], got {value!r}")
        elif name in _SSL_OPTIONS:
            if not tls:
                raise InvalidStoreUrl(f"{name} needs a TLS scheme (rediss://, valkeys://)")
            if name == "ssl_cert_reqs" and value not in _CERT_REQS:
                raise InvalidStoreUrl(f"ssl_cert_reqs must be one of {_CERT_REQS}, got {value!r}")
            ssl[name] = value
        else:
            raise InvalidStoreUrl(f"unknown option {name!r}; accepted: timeout, connect_timeout, {_SSL_OPTIONS}")
    return RedisTarget(hosts, tls, cluster, db, username, password, ssl=ssl, **options)


def _parse_host(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):
        host, close, port_text = text[1:].partition("]")
        if not close or (port_text and not port_text.startswith(":")):
            raise InvalidStoreUrl(f"malformed IPv6 host {text!r} in {_redact(url)}")
        port_text = port_text[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise InvalidStoreUrl(f"malformed IPv6 host {text!r} in {_redact(url)}") from exc
    else:
        host, _, port_text = text.partition(":")
    if not host or any(c in host for c in " /@?#"):
        raise InvalidStoreUrl(f"missing or malformed host {text!r} in {_redact(url)}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidStoreUrl(f"malformed port {port_text!r} in {_redact(url)}")
    return host, int(port_text)


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    return f"{scheme}{sep}***@{tail}" if at else url


def _redis() -> Any:
    try:
        import redis
        import redis.cluster
    except ImportError as exc:  # pragma: no cover - the store extra is installed in development
        raise StoreUnavailable("the redis:// store needs the redis package: pip install 'int8kv[store]'") from exc
    return redis


def client_options(target: RedisTarget) -> dict[str, Any]:
    """The redis-py options of every client of the store (node, cluster, embedded): the target's socket
    timeouts and no retries: redis-py's default retry policy (3 retries with backoff, 10 in the cluster client)
    multiplies every timeout, so a paused server held a caller for many times its timeout per fault; the store's
    reader deadline and back-off now bound a fault instead (docs/block_store.md, "Faults")."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: dict[str, Any] = {
        "username": target.username,
        "password": target.password,
        "socket_timeout": target.timeout,
        "socket_connect_timeout": target.connect_timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if target.tls:
        options["ssl"] = True
        options.update(target.ssl)
    return options


def client_factory(target: RedisTarget) -> Callable[[], Any]:
    """A function that builds the redis-py client (a cluster client contacts the cluster when built)."""
    redis = _redis()
    options = client_options(target)
    if target.cluster:
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.hosts]
        return lambda: redis.cluster.RedisCluster(startup_nodes=nodes, require_full_coverage=False, **options)
    if target.unix_socket is not None:
        return lambda: redis.Redis(unix_socket_path=target.unix_socket, db=target.db, **options)
    host, port = target.hosts[0]
    return lambda: redis.Redis(host=host, port=port, db=target.db, **options)


class RedisBlockStore(BlockStore):
    """Blocks in a Redis or Valkey server or cluster, through the ``redis`` client.

    Construct with :meth:`from_url`, or pass a ``client_factory`` returning a ready ``redis.Redis`` /
    ``redis.cluster.RedisCluster``. The client is built on first use, so an unreachable server at start-up
    is a miss like any other fault (and is tried again on the next call).
    """

    scheme = "redis"

    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        namespace: str = "int8kv",
        ttl: float | None = None,
        cluster: bool = False,
        description: str = "redis",
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(namespace, ttl, secret)
        self._factory = client_factory
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.cluster = cluster
        self.description = description
        self._prefix = f"{self.namespace}:".encode()

    @classmethod
    def from_url(
        cls, url: str, *, namespace: str = "int8kv", ttl: float | None = None, secret: str | bytes | None = None
    ) -> RedisBlockStore:
        target = parse_redis_url(url)
        return cls(
            client_factory(target), namespace=namespace, ttl=ttl, cluster=target.cluster,
            description=target.describe(), secret=secret,
        )

    @property
    def client(self) -> Any:
        """The redis-py client (built now if not yet): for raw access such as benchmarks and tests."""
        if self._client is None:
            with self._client_lock:  # the writer thread and the engine may both make the first call
                if self._client is None:
                    self._client = self._factory()
        return self._client

    def key_name(self, key: bytes) -> bytes:
        """The Redis key of a block key: ``namespace:`` + :meth:`key_id`."""
        return self._prefix + self.key_id(key).encode()

    def pipeline(self) -> Any:
        """A non-transactional pipeline of the client (a cluster pipeline splits it per node)."""
        return self.client.pipeline() if self.cluster else self.client.pipeline(transaction=False)

    def _connect(self) -> None:
        # Building a cluster client asks a startup node for the slot map (~0.1 s on loopback here, more than
        # a read deadline); a node client connects lazily, inside the read.
        self.client  # noqa: B018 - builds it

    def _exists(self, keys: list[bytes]) -> Sequence[bool]:
        pipe = self.pipeline()
        for key in keys:
            pipe.exists(self.key_name(key))
        return [bool(n) for n in pipe.execute()]

    def _exists_each(self, keys: list[bytes]) -> Sequence[bool]:
        return self._exists(keys)  # one pipeline, every key answered

    def _get(self, keys: list[bytes], limit: int) -> Sequence[bytes | None | Exception]:
        pipe = self.pipeline()
        for key in keys:
            pipe.exists(self.key_name(key))
            pipe.getrange(self.key_name(key), 0, limit)  # inclusive end: at most limit + 1 bytes
        replies = pipe.execute(raise_on_error=False)
        response_error = _redis().ResponseError
        out: list[bytes | None | Exception] = []
        for present, value in zip(replies[::2], replies[1::2], strict=True):
            for reply in (present, value):
                if isinstance(reply, Exception) and not isinstance(reply, response_error):
                    raise reply  # the connection failed: the whole call is a fault
            # GETRANGE of a missing key is b"" too: EXISTS tells it from an empty value (refused, removed).
            out.append(value if isinstance(value, Exception) else (bytes(value) if present else None))
        return out

    def _put_if_absent(self, key: bytes, value: bytes) -> bool:
        return bool(self.client.set(self.key_name(key), value, nx=True, ex=self.ttl))

    def _delete(self, keys: list[bytes]) -> None:
        if self.cluster:  # one DEL per key: a cluster DEL of several keys must stay within one slot
            pipe = self.pipeline()
            for key in keys:
                pipe.delete(self.key_name(key))
            pipe.execute()
        else:
            self.client.delete(*(self.key_name(k) for k in keys))

    def _unreachable(self, exc: BaseException) -> bool:
        # A reply error (OOM under maxmemory/noeviction, WRONGTYPE) comes from a server that answers; a cluster
        # that is down or moving slots does not count as answering.
        redis = _redis()
        return not isinstance(exc, redis.ResponseError) or isinstance(exc, redis.exceptions.ClusterError)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __repr__(self) -> str:
        return f"RedisBlockStore({self.description}, namespace={self.namespace!r})"
