"""Start the engine and uvicorn, serve until SIGTERM/SIGINT, shut down cleanly and return 0.

On SIGTERM uvicorn stops accepting connections, lets running requests finish for `Limits.shutdown_timeout`
seconds, cancels the rest (their handlers abort them in the engine), then the app's lifespan stops the engine
thread. uvicorn re-raises the signal it caught once it is done; a no-op handler installed here takes it, so the
process exits 0 instead of dying of SIGTERM.
"""

from __future__ import annotations

import signal
import sys

from ..engine import LLM
from .app import Limits, build_app


def serve(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          log_level: str = "warning") -> int:
    import uvicorn

    limits = limits or Limits()
    app = build_app(llm, model_name, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(limits.shutdown_timeout))
    server = uvicorn.Server(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"int8kv: serving {model_name} on http://{host}:{port}/v1 (KV {llm.format.as_str()}, "
          f"{llm.cache.num_blocks} blocks of {llm.cache.block_size} tokens)", file=sys.stderr, flush=True)
    server.run()
    return 0 if server.started else 1
