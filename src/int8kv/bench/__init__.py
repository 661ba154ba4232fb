"""Benchmarks, run as `python -m int8kv.bench <name> [options]` (see `python -m int8kv.bench --help`).

Each benchmark module exposes `run(...) -> dict`, `report(dict) -> str` and `main(argv) -> dict`.
"""

BENCHMARKS = {
    "attention": "int8kv.bench.attention",
    "codec": "int8kv.bench.codec",
    "e2e": "int8kv.bench.e2e",
    "kv4": "int8kv.bench.kv4",
    "kv4_attention": "int8kv.bench.kv4_attention",
    "q4w_attention": "int8kv.bench.q4w_attention",
    "engine_paths": "int8kv.bench.engine_paths",
    "prefix": "int8kv.bench.prefix",
    "store": "int8kv.bench.store",
    "store_io": "int8kv.bench.store_io",
    "serve": "int8kv.bench.serve",
    "slope": "int8kv.bench.slope",
    "plots": "int8kv.bench.plots",
    "window": "int8kv.bench.window",
    "hybrid": "int8kv.bench.hybrid",
    "busy": "int8kv.bench.busy",
    "gguf": "int8kv.bench.gguf",
    "structured": "int8kv.bench.structured",
}
