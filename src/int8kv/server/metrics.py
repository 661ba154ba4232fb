"""`GET /metrics`: the engine's state in Prometheus text format, from its own registry (not the global one,
so two servers in one process, as in tests, never clash).

The engine thread publishes a snapshot after every step (`Metrics.publish`); a scrape reads the latest one and
never touches the engine, so it never waits for a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, help, kind): kind "gauge" is a level, "counter" a running total since start.
FIELDS = (
    ("kv_blocks_used", "KV cache blocks held by requests", "gauge"),
    ("kv_blocks_free", "KV cache blocks free for new tokens", "gauge"),
    ("kv_blocks_total", "KV cache blocks in the pool", "gauge"),
    ("kv_bytes_per_token", "KV bytes one token takes, all layers, K and V", "gauge"),
    ("prefix_cache_hit_rate", "share of the prompt tokens of full blocks found in the pool or the KV store", "gauge"),
    ("prefix_cache_queried_tokens", "prompt tokens of full blocks looked up in the prefix cache", "counter"),
    ("prefix_cache_hit_tokens", "prompt tokens found in the pool's prefix cache", "counter"),
    ("kv_store_hit_tokens", "prompt tokens loaded from the shared KV block store", "counter"),
    ("kv_store_miss_tokens", "prompt tokens of full blocks neither the pool nor the KV store had", "counter"),
    ("kv_store_faults", "KV block store fetches that failed or fell short", "counter"),
    ("requests_running", "requests in the running batch", "gauge"),
    ("requests_waiting", "requests queued for a slot", "gauge"),
    ("preemptions", "requests preempted (blocks freed, recomputed later)", "counter"),
    ("generated_tokens", "tokens generated", "counter"),
    ("prompt_tokens", "prompt tokens run through the model", "counter"),
    ("requests_finished", "requests completed (EOS, max_tokens or a stop string)", "counter"),
    ("requests_aborted", "requests aborted (client gone, shutdown)", "counter"),
    ("requests_failed", "requests that failed inside a step", "counter"),
    ("requests_rejected", "requests refused because the queue was full", "counter"),
)


class _Snapshot(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        values = self.metrics.values
        for name, text, kind in FIELDS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"int8kv_{name}", text, value=values.get(name, 0))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.values: dict[str, float] = {}
        self.counts = {"requests_finished": 0, "requests_aborted": 0, "requests_failed": 0, "requests_rejected": 0}
        self.registry.register(_Snapshot(self))
        # Seconds from a request's arrival to its first generated token (queueing and prefill included).
        self.ttft = Histogram(
            "int8kv_time_to_first_token_seconds", "time from a request's arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry,
        )

    def count(self, name: str, n: int = 1) -> None:
        """Add to a request counter (engine thread only; published with the next snapshot)."""
        self.counts[name] += n

    def publish(self, values: dict[str, float]) -> None:
        """Replace the snapshot, request counters included (one assignment: a scrape sees the old or the new
        one, never a mix, so an abort's count and its freed blocks appear together)."""
        self.values = {**values, **self.counts}

    def render(self) -> bytes:
        return generate_latest(self.registry)
