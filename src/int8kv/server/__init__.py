"""`int8kv serve`: an OpenAI-compatible HTTP server on the continuous-batching INT8 engine.

app.py (endpoints), protocol.py (OpenAI's JSON shapes), engine_loop.py (the one thread that steps the engine),
text.py (token deltas to text, stop strings), metrics.py (Prometheus), run.py (start, serve, SIGTERM).
"""

from .app import Limits, build_app
from .run import serve

__all__ = ["Limits", "build_app", "serve"]
