"""The engine on a shared KV block store, against real servers (tests/valkey_servers.py) and the disk store.

Engine processes share prefixes through Valkey (one node and a 3-node cluster) and `disk:`; a damaged,
foreign or evicted block and a killed server are misses: the engine recomputes and its greedy output never
changes. A tiny random Llama saved with `save_pretrained` gives every process the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
import torch
import valkey_servers
from blockstore_helpers import reframe
from engine_store_child import MAX_TOKENS
from test_engine import SMALL, tiny
from valkey_servers import assert_gone, node

from int8kv.blockstore import BlockSpec, verify_block
from int8kv.cache.prefix import PrefixHasher
from int8kv.engine import LLM, SamplingParams

valkey_node = valkey_servers.valkey_node  # the module's fixtures
valkey_cluster = valkey_servers.valkey_cluster

BS = 16
SHARED_BLOCKS = 4
SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)
CHILD = str(Path(__file__).resolve().parent / "engine_store_child.py")
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny("llama", seed=4).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def prompts():
    """Two prompts sharing SHARED_BLOCKS full blocks and 5 more tokens, then different."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(1, SMALL["vocab_size"], (SHARED_BLOCKS * BS + 5,), generator=g).tolist()
    return [shared + torch.randint(1, SMALL["vocab_size"], (n,), generator=g).tolist() for n in (9, 14)]


def recompute(model, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model, memory="1MiB", prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def namespace() -> str:
    return f"e-{uuid.uuid4().hex[:12]}"


def run_child(model_dir: str, url: str, ns: str, prompts: list[list[int]]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, CHILD, model_dir, url, ns, json.dumps(prompts)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["valkey", "cluster", "disk"])
def test_a_second_process_loads_the_first_ones_prefix(backend, model_dir, model, prompts, request, tmp_path):
    url = {
        "valkey": lambda: request.getfixturevalue("valkey_node").url,
        "cluster": lambda: request.getfixturevalue("valkey_cluster").url,
        "disk": lambda: f"disk:{tmp_path}",
    }[backend]()
    ns = namespace()
    a = run_child(model_dir, url, ns, prompts[:1])
    assert a["flushed"] and a["stats"]["store_hit_tokens"] == 0
    assert a["store"]["puts"] == (len(prompts[0]) + MAX_TOKENS - 1) // BS  # every full block computed
    b = run_child(model_dir, url, ns, prompts[1:])
    want = recompute(model, prompts)
    assert a["outputs"] == want[:1] and b["outputs"] == want[1:]
    assert b["stats"]["store_hit_tokens"] == SHARED_BLOCKS * BS
    assert b["stats"]["prefill_tokens"] == len(prompts[1]) - SHARED_BLOCKS * BS
    assert b["stats"]["store_faults"] == 0 and b["store"]["errors"] == 0


def _raw_client(server) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port, socket_timeout=5)


def _flip(value: bytes) -> bytes:
    buf = bytearray(value)
    buf[len(buf) // 2] ^= 0x01
    return bytes(buf)


def _other_fingerprint(value: bytes) -> bytes:
    name_len, fp_len = value[14], value[15]

    def patch(buf: bytearray, _header_len: int) -> None:
        start = 56 + name_len
        buf[start : start + fp_len] = b"f" * fp_len

    return reframe(value, payload_patch=patch)


MUTATIONS = {
    "flipped-byte": _flip,
    "newer-version": lambda v: reframe(v, version=3),
    "older-version": lambda v: reframe(v, version=1),
    "wrong-storage-version": lambda v: reframe(v, storage_version=9),
    "wrong-fingerprint": _other_fingerprint,
    "evicted": None,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_bad_or_missing_middle_block_stops_reuse_at_it(mutation, model, prompts, valkey_node):
    ns = namespace()
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as a:
        a.generate(prompts[:1], PARAMS)
        assert a.flush_kv_store(timeout=30)
        keys = PrefixHasher(a.cache.layout, a.fingerprint, BS).block_keys(prompts[0])
    client = _raw_client(valkey_node)
    name = f"{ns}:{keys[1].hex()}"
    mutated = None
    if MUTATIONS[mutation] is None:
        client.delete(name)
    else:
        mutated = MUTATIONS[mutation](client.get(name))
        client.set(name, mutated)
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
        got = [o.token_ids for o in b.generate(prompts[1:], PARAMS)]
        assert got == recompute(model, prompts[1:])
        assert b.stats.store_hit_tokens == BS  # block 0 only
        assert b.stats.prefill_tokens == len(prompts[1]) - BS
        assert b.stats.store_faults == (0 if mutation == "evicted" else 1)  # the lookup saw block 1 there
        assert b.kv_store.stats().invalid == (0 if mutation == "evicted" else 1)
    # A refused value is deleted, so the next writer replaces it (b recomputed block 1 and pushed it); a value
    # of a newer format version is left alone for newer readers (b's put found the key taken).
    stored = client.get(name)
    if mutation == "newer-version":
        assert stored == mutated
    else:
        assert stored is not None and stored != mutated
        verify_block(BlockSpec(b.cache.layout, BS, b.fingerprint), stored, keys[1])
    client.close()


def test_a_server_killed_mid_run_leaves_the_engine_serving(model, prompts):
    server = node()
    pid = server.pid
    try:
        llm = LLM(model, memory="1MiB", kv_store=server.url, kv_namespace=namespace())
        llm.kv_store.retry_after = 0.0  # contact the dead server on every admission
        first = [o.token_ids for o in llm.generate(prompts[:1], PARAMS)]
        assert llm.flush_kv_store(timeout=30)
        server.kill()
        assert_gone(pid)
        second = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert first + second == recompute(model, prompts[:1]) + recompute(model, prompts)
        assert llm.kv_store.stats().errors >= 1  # the lookups and pushes after the kill failed quietly
        fresh = LLM(model, memory="1MiB", kv_store=llm.kv_store, kv_namespace="x")
        assert [o.token_ids for o in fresh.generate(prompts[1:], PARAMS)] == recompute(model, prompts[1:])
        assert fresh.stats.store_hit_tokens == 0 and fresh.stats.prefill_tokens == len(prompts[1])
        llm.close()
        llm.close()  # idempotent
        assert [o.token_ids for o in llm.generate(prompts[1:], PARAMS)] == recompute(model, prompts[1:])
    finally:
        server.stop()
    assert_gone(pid)


def test_the_embedded_store_serves_a_fresh_engine_and_stops_with_close(model, prompts):
    a = LLM(model, memory="1MiB", kv_store="embedded")
    pid = a.kv_store.server.pid
    a.generate(prompts[:1], PARAMS)
    assert a.flush_kv_store(timeout=30)
    b = LLM(model, memory="1MiB", kv_store=a.kv_store)  # an open store: shared, not owned
    assert [o.token_ids for o in b.generate(prompts[1:], PARAMS)] == recompute(model, prompts[1:])
    assert b.stats.store_hit_tokens == SHARED_BLOCKS * BS
    b.close()
    assert a.kv_store.server.running
    a.close()
    assert_gone(pid)


def test_bench_store_runs_on_a_small_model(model):
    from int8kv.bench import store as bench_store

    result = bench_store.run(tokens=48, suffix=3, repeat=1, backends=("none", "disk"), io_repeat=1, model=model)
    none, disk = result["backends"]["none"], result["backends"]["disk"]
    assert none["store_hit_tokens"] == 0 and none["prefill_tokens"] == 51
    assert disk["store_hit_tokens"] == 48 and disk["prefill_tokens"] == 3 and disk["store_faults"] == 0
    assert disk["same_first_token"]
    assert 0.52 < result["io"]["bytes_ratio_int8_f16"] < 0.54
    assert "speedup" in bench_store.report(result)
