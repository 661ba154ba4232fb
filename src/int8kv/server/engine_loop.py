"""The engine thread: the one thread that touches the `LLM`, so HTTP handlers never wait on a step.

Handlers talk to it through an inbox (add a group of requests, abort or finish some, end all, run a call,
stop) and get each request's updates on an asyncio queue of their own, delivered with `call_soon_threadsafe`.
Between two steps the thread drains the inbox, so requests join and leave between steps; an abort frees the
request's blocks before the next step. A step that raises (the engine isolates per-request failures, so this
means a bug) fails every live request and the thread goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import LLM, RequestUpdate, SamplingParams
from ..errors import KvCacheError
from .metrics import Metrics, RequestTiming

log = logging.getLogger("int8kv.server")


class QueueFull(KvCacheError):
    """More requests would wait for a slot than the server's queue holds (HTTP 429)."""


class ServerStopping(KvCacheError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Sink:
    """Where one request's updates go: an asyncio queue on the handler's event loop."""

    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    first_token: bool = False

    def put(self, update: RequestUpdate) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


_REASONS = {"requests_finished": "stop", "requests_failed": "error"}  # counter -> vLLM's finished_reason


@dataclass
class _Add:
    groups: list[tuple[list[int], list[SamplingParams], Sink]]  # (prompt, its choices' params, sink) per group
    done: concurrent.futures.Future


class EngineLoop:
    def __init__(self, llm: LLM, metrics: Metrics, max_queue: int) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, Sink] = {}
        self._timings: dict[int, RequestTiming] = {}  # per live request, for the per-request metrics
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="int8kv-engine", daemon=True)

    # -- called from handlers (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    def add(self, groups: list[tuple[list[int], list[SamplingParams], Sink]]) -> concurrent.futures.Future:
        """Queue one HTTP request's choices, all or none: per (prompt, params, sink) one forked group whose
        prompt is prefilled once (`LLM.add_forked_request`, one choice per SamplingParams). The future gives
        every choice's id in order or raises InvalidRequest / KvPoolExhausted (400), QueueFull (429) or
        ServerStopping (503)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(groups, done))
        return done

    def abort(self, request_ids: list[int], finished: bool = False) -> None:
        """Take requests out of the engine (their blocks freed before the next step). `finished`: they are
        complete (a stop string found in their text), counted as finished, not aborted."""
        self._send(("finish" if finished else "abort", request_ids))

    def end_all(self) -> None:
        """End every live request now (the shutdown timeout): each handler gets a last update with
        finish_reason "abort"."""
        self._send(("end", None))

    def call(self, fn: Any) -> concurrent.futures.Future:
        """Run `fn(llm)` on the engine thread between two steps; the future gives its result or exception."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", (fn, done)))
        return done

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, then end the thread (handlers still waiting get a finished update)."""
        self._send(("stop", None))
        self._thread.join(timeout)

    def _send(self, message: Any) -> None:
        self._inbox.put(message)
        self._wake.set()

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.clear()
            self._drain()
            if self._stopping:
                break
            self._publish()  # adds and aborts show at once, even when no step follows
            if self.llm.has_unfinished():
                try:
                    self.llm.step()
                except Exception:  # noqa: BLE001 - a bug in a step must not take the server down
                    log.exception("engine step failed; failing every live request")
                    self._abort(list(self._sinks), "error", "requests_failed")
                # Published before the updates go out: a client that sees its response done and then scrapes
                # /metrics finds the blocks its request held already free.
                self._publish()
                self._deliver()
            else:
                self._wake.wait(1.0)
        self._abort(list(self._sinks), "abort", "requests_aborted")
        self._publish()

    def _drain(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = "add" if isinstance(message, _Add) else message[0]
            if kind == "add":
                self._add(message)
            elif kind in ("abort", "finish"):
                self._abort(message[1], None, "requests_aborted" if kind == "abort" else "requests_finished")
            elif kind == "end":
                self._abort(list(self._sinks), "abort", "requests_aborted")
            elif kind == "call":
                self._call(*message[1])
            else:
                self._stopping = True

    def _call(self, fn: Any, done: concurrent.futures.Future) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(self.llm))
        except Exception as e:  # noqa: BLE001 - handed to the waiting handler
            done.set_exception(e)

    def _add(self, message: _Add) -> None:
        if not message.done.set_running_or_notify_cancel():
            return
        try:
            if self._stopping:
                raise ServerStopping("the server is shutting down")
            free_slots = self.llm.scheduler.max_num_seqs - self.llm.num_running
            queued = self.llm.num_waiting + sum(len(params) for _, params, _ in message.groups) - free_slots
            if queued > self.max_queue:
                self.metrics.count("requests_rejected")
                raise QueueFull(f"{self.llm.num_waiting} requests already wait for a slot; the queue holds "
                                f"{self.max_queue}. Retry later.")
            ids: list[int] = []
            try:
                now = time.perf_counter()
                for prompt, params, sink in message.groups:
                    for request_id, p in zip(self.llm.add_forked_request(prompt, params), params, strict=True):
                        ids.append(request_id)
                        self._sinks[request_id] = sink
                        self._timings[request_id] = RequestTiming(sink.arrived, now, p.max_tokens, len(prompt))
            except BaseException:
                for request_id in ids:  # all or none: the group's earlier members leave again
                    self.llm.abort_request(request_id)
                    del self._sinks[request_id]
                    del self._timings[request_id]
                raise
        except Exception as e:  # noqa: BLE001 - handed to the waiting handler
            message.done.set_exception(e)
        else:
            message.done.set_result(ids)

    def _abort(self, request_ids: list[int], reason: str | None, counter: str) -> None:
        """Take requests out (freeing their blocks now), each counted in `counter` if it was still live; with a
        reason, tell their handlers they ended so."""
        for request_id in request_ids:
            sink = self._sinks.pop(request_id, None)
            timing = self._timings.pop(request_id, None)
            if self.llm.abort_request(request_id):
                self.metrics.count(counter)
                if timing is not None:
                    self.metrics.request_done(_REASONS.get(counter, "abort"), timing)
            if sink is not None and reason is not None:
                sink.put(RequestUpdate(request_id, [], True, reason, f"request ended: {reason}", 0, 0))

    def _deliver(self) -> None:
        now = time.perf_counter()
        for update in self.llm.pop_updates():
            sink = self._sinks.get(update.request_id)
            if sink is None:
                continue
            timing = self._timings[update.request_id]
            timing.admitted = update.admitted_at
            timing.output_tokens = update.num_output_tokens
            if update.new_token_ids:
                if timing.first is None:
                    timing.first = now
                    self.metrics.vllm["time_to_first_token_seconds"].observe(now - timing.arrived)
                else:
                    self.metrics.next_tokens(now - timing.last, len(update.new_token_ids))
                timing.last = now
            if update.new_token_ids and not sink.first_token:  # int8kv's own: per HTTP request
                sink.first_token = True
                self.metrics.ttft.observe(now - sink.arrived)
            if update.finished:
                del self._sinks[update.request_id]
                del self._timings[update.request_id]
                self.metrics.count("requests_failed" if update.finish_reason == "error" else "requests_finished")
                self.metrics.request_done(update.finish_reason or "stop", timing)
            sink.put(update)

    def _publish(self) -> None:
        llm = self.llm
        stats = llm.stats
        free = llm.cache.num_free_blocks
        self.metrics.publish({
            "kv_blocks_used": llm.cache.num_blocks - free,
            "kv_blocks_free": free,
            "kv_blocks_total": llm.cache.num_blocks,
            "kv_bytes_per_token": llm.kv_bytes_per_token(),
            "prefix_cache_hit_rate": stats.prefix_hit_rate,
            "prefix_cache_queried_tokens": stats.prefix_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
            "kv_store_hit_tokens": stats.store_hit_tokens,
            "kv_store_miss_tokens": (stats.prefix_queried_tokens - stats.prefix_hit_tokens - stats.store_hit_tokens
                                     if llm.kv_store is not None else 0),
            "kv_store_faults": stats.store_faults,
            "requests_running": llm.num_running,
            "requests_waiting": llm.num_waiting,
            "preemptions": stats.preemptions,
            "generated_tokens": stats.generated_tokens,
            "prompt_tokens": stats.prefill_tokens,
        })
