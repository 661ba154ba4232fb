"""``open_block_store(url)``: the backend for a URL scheme.

    embedded[?tcp=1&maxmemory=2gb]          a private Valkey server (int8kv.blockstore.embedded)
    disk:PATH[?max_bytes=10g]               files under PATH (int8kv.blockstore.disk)
    redis://, rediss://, valkey://, valkeys://, and +cluster forms   (int8kv.blockstore.redis)

``secret`` (or, when it is None, the environment variable ``INT8KV_KV_STORE_SECRET``) makes every value carry
an HMAC-SHA256 tag of the shared secret, and refuses values without a valid one (docs/block_store.md).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl

from .base import BlockStore
from .codec import check_secret
from .errors import InvalidStoreUrl

__all__ = ["SECRET_ENV", "open_block_store"]

SECRET_ENV = "INT8KV_KV_STORE_SECRET"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _options(query: str, allowed: set[str], url: str) -> dict[str, str]:
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - allowed
    if unknown:
        raise InvalidStoreUrl(f"unknown option(s) {sorted(unknown)} in {url!r}; accepted: {sorted(allowed)}")
    return options


def open_block_store(
    url: str, *, namespace: str = "int8kv", ttl: float | None = None, secret: str | bytes | None = None
) -> BlockStore:
    """Open the store ``url`` names; raises InvalidStoreUrl, InvalidStoreSecret (a secret under 16 bytes) or
    StoreUnavailable (``embedded``). ``secret`` None takes ``INT8KV_KV_STORE_SECRET`` if it is set."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    check_secret(secret)  # before anything starts
    if not isinstance(url, str) or not url:
        raise InvalidStoreUrl(f"a block store URL is a non-empty string, got {url!r}")
    if url == "embedded" or url.startswith("embedded?"):
        from .embedded import DEFAULT_MAXMEMORY, EmbeddedValkeyStore

        options = _options(url.partition("?")[2], {"tcp", "maxmemory"}, url)
        tcp = options.get("tcp", "0").lower()
        if tcp not in _TRUE | _FALSE:
            raise InvalidStoreUrl(f"tcp must be 0 or 1, got {tcp!r}")
        maxmemory = options.get("maxmemory", DEFAULT_MAXMEMORY)
        if not maxmemory.isalnum():
            raise InvalidStoreUrl(f"maxmemory must be a Valkey size such as 512mb, got {maxmemory!r}")
        return EmbeddedValkeyStore(namespace=namespace, ttl=ttl, tcp=tcp in _TRUE, maxmemory=maxmemory, secret=secret)
    if url.startswith("disk:"):
        from .disk import DEFAULT_MAX_BYTES, DiskBlockStore

        path, _, query = url[len("disk:") :].partition("?")
        path = path.removeprefix("//")  # disk:///abs/path and disk:/abs/path are the same
        if not path:
            raise InvalidStoreUrl("disk: needs a directory, as in disk:/var/cache/int8kv")
        options = _options(query, {"max_bytes"}, url)
        max_bytes = options.get("max_bytes", DEFAULT_MAX_BYTES)
        return DiskBlockStore(path, namespace=namespace, ttl=ttl, max_bytes=max_bytes, secret=secret)
    from .redis import REDIS_SCHEMES, RedisBlockStore

    scheme = url.partition("://")[0].lower()
    if scheme in REDIS_SCHEMES:
        return RedisBlockStore.from_url(url, namespace=namespace, ttl=ttl, secret=secret)
    accepted = "embedded, disk:PATH, " + ", ".join(f"{s}://" for s in sorted(REDIS_SCHEMES))
    raise InvalidStoreUrl(f"unknown block store {url!r}; accepted: {accepted}")
