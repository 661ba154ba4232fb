"""Bind the port, start the engine and uvicorn, serve until SIGTERM/SIGINT, shut down cleanly and return 0.

`bind(host, port)` comes first (the CLI calls it before loading the model), so a port already taken fails in
a second with one line instead of after the model has loaded. On SIGTERM uvicorn stops accepting connections
and waits for open responses; after `Limits.shutdown_timeout` seconds the app itself ends every request still
running (`Service.begin_shutdown`): each stream gets a last chunk with finish_reason "abort" and `[DONE]`, so
uvicorn has nothing to cancel (its own cancelling, which cuts streams and logs CancelledError, is only a
backstop `SHUTDOWN_MARGIN` seconds later). Then the app's lifespan stops the engine thread. uvicorn re-raises
the signal it caught once it is done; a no-op handler installed here takes it, so the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import urllib.parse

from ..engine import LLM
from ..errors import KvCacheError
from .app import Limits, build_app

SHUTDOWN_MARGIN = 10.0  # seconds the ended streams get to flush their last chunk before uvicorn cancels them


class PortInUse(KvCacheError, OSError):
    """The address to serve on cannot be bound (taken, or not an address of this machine)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), ready for uvicorn; PortInUse if it cannot be bound."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise PortInUse(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there?)"
                        ) from None
    sock.set_inheritable(True)
    return sock


def store_name(url: str | None) -> str:
    """The KV store as the startup line names it, a password in the URL replaced by ***."""
    if not url:
        return "no KV store"
    parts = urllib.parse.urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return f"KV store {url}"


def serve(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          log_level: str = "warning", api_key: str | None = None, sock: socket.socket | None = None,
          kv_store: str | None = None, log_requests: bool = True, tool_parser: str | None = None) -> int:
    import uvicorn

    limits = limits or Limits()
    sock = sock or bind(host, port)
    app = build_app(llm, model_name, limits, api_key, tool_parser)
    service = app.state.service
    config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(limits.shutdown_timeout + SHUTDOWN_MARGIN))

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            service.begin_shutdown()
            await super().shutdown(sockets)

    server = Server(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    requests_log = logging.getLogger("int8kv.server.requests")
    if log_requests:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("int8kv: %(message)s"))
        requests_log.addHandler(handler)
        requests_log.setLevel(logging.INFO)
        requests_log.propagate = False
    print(f"int8kv: serving {model_name} on http://{host}:{port}/v1 (KV {llm.format.as_str()}, "
          f"{llm.cache.num_blocks} blocks of {llm.cache.block_size} tokens, {store_name(kv_store)}, context "
          f"{service.max_model_len} tokens{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
