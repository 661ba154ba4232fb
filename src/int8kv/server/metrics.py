"""`GET /metrics`: the engine's state in Prometheus text format, from its own registry (not the global one,
so two servers in one process, as in tests, never clash).

Two sets of names: int8kv's own (`int8kv_*`, FIELDS) and vLLM's (`vllm:*`, each labelled `model_name`), so a
dashboard or alert written for vLLM finds its series unchanged. docs/serving.md lists every metric.

The engine thread publishes a snapshot after every step (`Metrics.publish`) and records each request's timings
as its updates go out (`Metrics.request_*`); a scrape reads the latest values and never touches the engine, so
it never waits for a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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

def _usage(values: dict[str, float]) -> float:
    """The share of the pool's blocks in use."""
    return values.get("kv_blocks_used", 0) / max(values.get("kv_blocks_total", 0), 1)


# vLLM's names for values of the snapshot: (vLLM name, help, kind, how it is computed from the snapshot)
VLLM_FIELDS = (
    ("num_requests_running", "requests in the running batch", "gauge", lambda v: v.get("requests_running", 0)),
    ("num_requests_waiting", "requests waiting for a slot", "gauge", lambda v: v.get("requests_waiting", 0)),
    ("kv_cache_usage_perc", "share of the KV cache pool's blocks in use (1 = full)", "gauge", _usage),
    ("gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under the name older vLLM dashboards query", "gauge", _usage),
    ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", "counter",
     lambda v: v.get("prefix_cache_queried_tokens", 0)),
    ("prefix_cache_hits", "prompt tokens found in the pool's prefix cache", "counter",
     lambda v: v.get("prefix_cache_hit_tokens", 0)),
    ("prompt_tokens", "prompt tokens run through the model", "counter", lambda v: v.get("prompt_tokens", 0)),
    ("generation_tokens", "tokens generated", "counter", lambda v: v.get("generated_tokens", 0)),
    ("num_preemptions", "requests preempted", "counter", lambda v: v.get("preemptions", 0)),
)
# Bucket edges (seconds, tokens) spread from a fast CPU step to a long queue.
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160, 600)
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# vLLM's per-request histograms: (name without the prefix, help, buckets)
VLLM_HISTOGRAMS = (
    ("time_to_first_token_seconds", "seconds from a request's arrival to its first token", LATENCY),
    ("inter_token_latency_seconds", "seconds between two tokens of one request", LATENCY),
    ("time_per_output_token_seconds", "vllm:inter_token_latency_seconds under its older name", LATENCY),
    ("request_time_per_output_token_seconds", "a finished request's decode time per token after its first",
     LATENCY),
    ("e2e_request_latency_seconds", "seconds from a request's arrival to its end", LATENCY),
    ("request_queue_time_seconds", "seconds a request waited before it first ran", LATENCY),
    ("request_prefill_time_seconds", "seconds from a request's first step to its first token", LATENCY),
    ("request_decode_time_seconds", "seconds from a request's first token to its end", LATENCY),
    ("request_inference_time_seconds", "seconds from a request's first step to its end", LATENCY),
    ("request_prompt_tokens", "a finished request's prompt tokens", TOKENS),
    ("request_generation_tokens", "a finished request's generated tokens", TOKENS),
    ("request_max_num_generation_tokens", "a finished request's max_tokens", TOKENS),
    ("request_params_max_tokens", "a finished request's max_tokens", TOKENS),
)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class RequestTiming:
    """One request's moments (time.perf_counter()) and sizes, kept by the engine thread while it is live:
    `arrived` at the server, `added` to the engine, `admitted` to its first step, its `first` and `last` tokens
    (None until they happen)."""

    arrived: float
    added: float
    max_tokens: int
    prompt_tokens: int
    output_tokens: int = 0
    admitted: float | None = None
    first: float | None = None
    last: float | None = None


class _Snapshot(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        values, label = self.metrics.values, [self.metrics.model_name]
        for name, text, kind in FIELDS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"int8kv_{name}", text, value=values.get(name, 0))
        for name, text, kind, value in VLLM_FIELDS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"vllm:{name}", text, labels=["model_name"])
            family.add_metric(label, value(values))
            yield family


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.values: dict[str, float] = {}
        self.counts = {"requests_finished": 0, "requests_aborted": 0, "requests_failed": 0, "requests_rejected": 0}
        self.registry.register(_Snapshot(self))
        # Seconds from a request's arrival to its first generated token (queueing and prefill included).
        self.ttft = Histogram(
            "int8kv_time_to_first_token_seconds", "time from a request's arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry,
        )
        self.vllm = {name: Histogram(f"vllm:{name}", text, ["model_name"], buckets=buckets, registry=self.registry)
                     .labels(model_name) for name, text, buckets in VLLM_HISTOGRAMS}
        success = Counter("vllm:request_success", "finished requests by their finish reason",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

    def count(self, name: str, n: int = 1) -> None:
        """Add to a request counter (engine thread only; published with the next snapshot)."""
        self.counts[name] += n

    def publish(self, values: dict[str, float]) -> None:
        """Replace the snapshot, request counters included (one assignment: a scrape sees the old or the new
        one, never a mix, so an abort's count and its freed blocks appear together)."""
        self.values = {**values, **self.counts}

    def next_tokens(self, seconds: float, tokens: int) -> None:
        """`tokens` more tokens of a request came `seconds` after its previous ones: one interval each."""
        for _ in range(tokens):
            for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
                self.vllm[name].observe(seconds / tokens)

    def request_done(self, reason: str, t: RequestTiming) -> None:
        """A request ended now with `reason` (FINISH_REASONS)."""
        h, end = self.vllm, time.perf_counter()
        self.success[reason].inc()
        h["e2e_request_latency_seconds"].observe(end - t.arrived)
        if t.admitted is not None:
            h["request_queue_time_seconds"].observe(max(t.admitted - t.added, 0.0))
            h["request_inference_time_seconds"].observe(end - t.admitted)
            if t.first is not None:
                h["request_prefill_time_seconds"].observe(max(t.first - t.admitted, 0.0))
        if t.first is not None:
            h["request_decode_time_seconds"].observe(end - t.first)
            if t.output_tokens > 1:
                h["request_time_per_output_token_seconds"].observe((t.last - t.first) / (t.output_tokens - 1))
        h["request_prompt_tokens"].observe(t.prompt_tokens)
        h["request_generation_tokens"].observe(t.output_tokens)
        h["request_max_num_generation_tokens"].observe(t.max_tokens)
        h["request_params_max_tokens"].observe(t.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
