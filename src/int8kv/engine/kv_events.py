"""KV cache events in vLLM's wire format, so the KV-aware routers built for vLLM (llm-d's scheduler, Dynamo's KV
router) can route int8kv replicas: after every engine step, one batch of the blocks the pool's prefix cache
gained (`BlockStored`), lost to eviction (`BlockRemoved`) or all of them (`AllBlocksCleared`).

The events are msgspec Structs with vLLM's names and fields in vLLM's order, msgpack-encoded; a batch goes out
on a ZeroMQ PUB socket as three frames (topic, an 8-byte big-endian sequence number, the payload), and an
optional ROUTER socket replays the batches kept in memory from a sequence number a subscriber sends (8 bytes,
big-endian), ending with sequence -1 and an empty payload. Block hashes are int8kv's prefix keys (bytes: the
same keys as prefix caching and the block store), which vLLM's `ExternalBlockHash` (bytes or int) allows.
Configured as vLLM's `--kv-events-config` is (`KvEventsConfig.parse`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from ..errors import InvalidEngineConfig

MEDIUM = "CPU"  # where the blocks live (vLLM's GPU engines say "GPU")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to the set of blocks the prefix cache holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None  # the block table group, with several (sliding and full layers)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig fields that apply here: events on or off, the ZeroMQ publisher's endpoints (an
    endpoint with `*` binds, any other connects), how many batches the replay keeps, the PUB socket's high-water
    mark, the queue to the publishing thread, and the topic frame."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KvEventsConfig:
        """A config from JSON text or a dict; InvalidEngineConfig naming an unknown key or a bad value."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidEngineConfig(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise InvalidEngineConfig("kv_events_config is a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise InvalidEngineConfig(f"kv_events_config: {', '.join(unknown)} is not supported here "
                                      f"(known: {', '.join(known)})")
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        kinds = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "buffer_steps": int, "hwm": int,
                 "max_queue_size": int, "topic": str}
        for name, kind in kinds.items():
            v = getattr(self, name)
            if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 1)):
                what = "positive int" if kind is int else kind.__name__
                raise InvalidEngineConfig(f"kv_events_config: {name} must be a {what}, got {v!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise InvalidEngineConfig(f"kv_events_config: replay_endpoint must be a string or null, got "
                                      f"{self.replay_endpoint!r}")
        if self.publisher not in ("zmq", "null"):
            raise InvalidEngineConfig(f"kv_events_config: publisher {self.publisher!r} is not supported (zmq or null)")


class EventLog:
    """What the block allocator did to the prefix cache since the last `drain`, in order. The allocator reports
    keys (`stored`, `removed`, `cleared`); the scheduler, which knows the tokens, completes each stored block right
    after registering it (`complete`)."""

    def __init__(self, block_size: int, num_groups: int) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self._events: list[Any] = []  # events, and (group, key) of stored blocks not completed yet
        self._open = 0

    def stored(self, group: int, key: bytes) -> None:
        self._events.append((group, key))
        self._open += 1

    def removed(self, group: int, key: bytes) -> None:
        self._events.append(BlockRemoved([key], MEDIUM, self._group(group)))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def complete(self, keys: Sequence[bytes], tokens: Callable[[int, int], list[int]]) -> None:
        """Fill in the stored blocks of a sequence whose prefix keys are `keys` (block i holds
        `tokens(i * block_size, (i + 1) * block_size)`)."""
        if not self._open:
            return
        index = {key: i for i, key in enumerate(keys)}
        for n, event in enumerate(self._events):
            if isinstance(event, tuple) and event[1] in index:
                group, key = event
                i, bs = index[key], self.block_size
                self._events[n] = BlockStored([key], keys[i - 1] if i else None, tokens(i * bs, (i + 1) * bs), bs,
                                              None, MEDIUM, None, self._group(group))
                self._open -= 1

    def drain(self) -> list[Any]:
        """The completed events, oldest first; a stored block never completed (no sequence named it) is dropped."""
        out = [e for e in self._events if not isinstance(e, tuple)]
        self._events.clear()
        self._open = 0
        return out

    def _group(self, group: int) -> int | None:
        return group if self.num_groups > 1 else None


class ZmqPublisher:
    """Batches out on a PUB socket from a thread of its own (a step only queues its batch), with the replay
    ROUTER socket when configured."""

    def __init__(self, config: KvEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            _open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidEngineConfig(f"kv_events_config: cannot open {config.endpoint!r}: {e}") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._running = True
        self.dropped = 0  # batches refused because the queue was full
        self._thread = threading.Thread(target=self._run, name="int8kv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a stalled consumer never stops the engine
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        if self._running:
            self._running = False
            self._queue.put(None)
            self._thread.join(timeout)
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._kept.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _open(sock: Any, endpoint: str) -> None:
    """Bind an endpoint with a wildcard (or ipc/inproc), connect any other, as vLLM's publisher does."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class KvEvents:
    """One engine's events: the log its allocator writes and the publisher each step's batch goes to."""

    def __init__(self, config: KvEventsConfig, block_size: int, num_groups: int) -> None:
        self.log = EventLog(block_size, num_groups)
        self.publisher = ZmqPublisher(config) if config.publisher == "zmq" else None

    def flush(self) -> None:
        """Publish what the step did (nothing when it changed no cached block)."""
        events = self.log.drain()
        if events and self.publisher is not None:
            self.publisher.publish(KVEventBatch(time.time(), events))

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
