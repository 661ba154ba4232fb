"""KV events in vLLM's format: a subscriber on a real ZeroMQ socket decodes every batch an engine publishes with
structs written down here from vLLM's (vllm/distributed/kv_events.py: KVEventBatch of BlockStored /
BlockRemoved / AllBlocksCleared, msgspec msgpack, tagged by class name), and the blocks stored less the blocks
removed are exactly the keys the engine's prefix cache holds; the replay socket sends the batches again."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
from transformers import LlamaConfig, LlamaForCausalLM

from int8kv.engine import LLM, InvalidEngineConfig, SamplingParams
from int8kv.engine.kv_events import EventLog, KvEventsConfig


# vLLM's schema, field for field
class VBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(VEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VEvent):
    pass


class VKVEventBatch(VBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(VKVEventBatch)


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=300, max_position_embeddings=1024, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def receive(sock: zmq.Socket, topic: bytes, quiet: float = 1.0) -> list[tuple[int, VKVEventBatch]]:
    """Every (sequence number, batch) that arrives until none has for `quiet` seconds."""
    got = []
    while sock.poll(int(quiet * 1000)):
        t, seq, payload = sock.recv_multipart()
        assert t == topic
        got.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return got


def test_stored_less_removed_is_what_the_pool_caches_and_the_replay_resends(tmp_path):
    # ipc endpoints in the test's folder: the engine binds them (as vLLM's publisher binds ipc://), nothing
    # listens on a network interface
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
    # 25 blocks of 16 tokens: three requests of 80 + 16 tokens (6 blocks each, 18 cached after them) and a
    # fourth of 200 + 16 (14 blocks) cannot all stay cached
    llm = LLM(tiny_model(), memory="64KiB", kv_events_config=config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        time.sleep(0.5)  # the subscription reaching the PUB socket (a batch sent before it would be lost)
        prompts = [[(7 * i + 3 * j) % 290 + 5 for j in range(80)] for i in range(3)]
        prompts.append([(11 * j) % 290 + 5 for j in range(200)])
        assert llm.cache.num_blocks == 25
        texts = []  # each request's prompt and output: what its blocks hold
        for _ in range(2):  # the second round hits or recomputes the first's blocks
            for p in prompts:
                (out,) = llm.generate([p], SamplingParams(max_tokens=16, ignore_eos=True))
                texts.append(p + out.token_ids)
        live = receive(sub, b"kv")
        # The replay from sequence 0 has every batch; a subscriber that joined late (PUB drops what it sends
        # before the subscription arrives) saw a gapless tail of them, the same bytes decoded.
        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        batches = replay_from(req, 0)
        assert [s for s, _ in batches] == list(range(len(batches)))  # none lost, in order
        assert live and live == batches[len(batches) - len(live):]
        assert replay_from(req, 2) == batches[2:]
        req.close(0)
        stored, removed, held = [], [], set()
        for _, batch in batches:
            assert batch.data_parallel_rank is None and batch.ts > 0
            for e in batch.events:
                if isinstance(e, BlockStored):
                    assert e.block_size == 16 and len(e.token_ids) == 16 and e.medium == "CPU"
                    assert e.group_idx is None and e.lora_id is None
                    stored.append(e)
                    assert not set(e.block_hashes) & held  # a block is stored again only after its removal
                    held |= set(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    removed.append(e)
                    assert set(e.block_hashes) <= held
                    held -= set(e.block_hashes)
        alloc = llm.cache.allocator
        keys = {alloc.block_key(b) for b in range(alloc.num_blocks)} - {None}
        assert held == keys and removed and len(stored) > len(keys)
        # each stored block holds 16 tokens of a request, and its parent is the block before it in that request
        by_hash = {e.block_hashes[0]: e for e in stored}
        for e in stored:
            starts = [(t, _at(t, e.token_ids)) for t in texts if _at(t, e.token_ids) is not None]
            assert starts, e
            if e.parent_block_hash is None:
                assert any(at == 0 for _, at in starts)
            elif e.parent_block_hash in by_hash:
                parent = by_hash[e.parent_block_hash].token_ids
                assert any(at >= 16 and t[at - 16:at] == parent for t, at in starts)
        assert any(e.parent_block_hash is None and e.token_ids == prompts[0][:16] for e in stored)
    finally:
        llm.close()
        sub.close(0)
        ctx.term()


def replay_from(req: zmq.Socket, first: int) -> list[tuple[int, VKVEventBatch]]:
    """The kept batches from sequence `first` on, asked of the replay socket (8 bytes, big-endian), up to its end
    marker (sequence -1, empty payload)."""
    req.send_multipart([b"", first.to_bytes(8, "big")])
    got = []
    while True:
        assert req.poll(5000)
        _, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            return got
        got.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))


def _at(prompt: list[int], tokens: list[int]) -> int | None:
    for i in range(0, len(prompt) - len(tokens) + 1, 16):
        if prompt[i:i + len(tokens)] == tokens:
            return i
    return None


def test_the_log_keeps_order_and_groups_and_clears():
    log = EventLog(block_size=4, num_groups=2)
    keys = [b"k0", b"k1", b"k2"]
    log.removed(1, b"old")
    log.stored(0, b"k1")
    log.stored(1, b"k1")
    log.complete(keys, lambda a, b: list(range(a, b)))
    log.cleared()
    log.stored(0, b"nobody")  # never completed: not published
    events = DECODE.decode(msgspec.msgpack.encode(_batch(log.drain()))).events
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored", "BlockStored", "AllBlocksCleared"]
    assert events[0].block_hashes == [b"old"] and events[0].group_idx == 1
    assert [(e.group_idx, e.parent_block_hash, e.token_ids) for e in events[1:3]] == [
        (0, b"k0", [4, 5, 6, 7]), (1, b"k0", [4, 5, 6, 7])]
    assert log.drain() == []


def _batch(events):
    from int8kv.engine.kv_events import KVEventBatch

    return KVEventBatch(1.0, events)


@pytest.mark.parametrize(("config", "message"), [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka' is not supported"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be a bool"),
    ('{"hwm": 0}', "hwm must be a positive int"),
    ('{"endpoint": "tcp://*:1", "nope": 1}', "nope is not supported here"),
    ("[1]", "is a JSON object"),
    ("{", "is not JSON"),
])
def test_bad_configs_are_refused_by_name(config, message):
    with pytest.raises(InvalidEngineConfig, match=message):
        KvEventsConfig.parse(config)
