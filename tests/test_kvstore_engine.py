"""The engine on a shared KV block store, against real servers (tests/valkey_servers.py) and the disk store.

Engine processes share prefixes through Valkey (one node and a 3-node cluster) and `disk:`; a damaged,
foreign, copied, forged, oversized or evicted block, a key of the wrong type, a FIFO or link on disk, a full
server and a killed or paused one are misses: the engine recomputes, its greedy output never changes, and a
stuck store costs an admission a bounded stall. A tiny random Llama saved with `save_pretrained` gives every
process the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import redis
import torch
import valkey_servers
from blockstore_helpers import header_fields, reframe
from engine_store_child import MAX_TOKENS
from test_engine import SMALL, tiny
from valkey_servers import StoreFault, assert_gone, node

from int8kv.blockstore import BlockSpec, BlockStore, encode_block, verify_block
from int8kv.blockstore.codec import assemble_blocks
from int8kv.blockstore.factory import SECRET_ENV
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


def run_child(model_dir: str, stores: list[list[str]], prompts: list[list[int]]) -> list[dict]:
    """One engine process (tests/engine_store_child.py) generating from ``prompts`` on each ``[url, namespace]``
    of ``stores`` in turn; its results in the same order."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, CHILD, model_dir, json.dumps(stores), json.dumps(prompts)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_first_ones_prefix(model_dir, model, prompts, valkey_node, valkey_cluster,
                                                      tmp_path):
    """For a Valkey node, a 3-node cluster and `disk:`, one process computes a prompt and a second process finds
    its shared blocks in the store: two processes serve the three stores, each store in a namespace of its own."""
    urls = {"valkey": valkey_node.url, "cluster": valkey_cluster.url, "disk": f"disk:{tmp_path}"}
    stores = [[url, namespace()] for url in urls.values()]
    first = run_child(model_dir, stores, prompts[:1])
    second = run_child(model_dir, stores, prompts[1:])
    want = recompute(model, prompts)
    for backend, a, b in zip(urls, first, second, strict=True):
        assert a["flushed"] and a["stats"]["store_hit_tokens"] == 0, backend
        assert a["store"]["puts"] == (len(prompts[0]) + MAX_TOKENS - 1) // BS, backend  # every full block computed
        assert a["outputs"] == want[:1] and b["outputs"] == want[1:], backend
        assert b["stats"]["store_hit_tokens"] == SHARED_BLOCKS * BS, backend
        assert b["stats"]["prefill_tokens"] == len(prompts[1]) - SHARED_BLOCKS * BS, backend
        assert b["stats"]["store_faults"] == 0 and b["store"]["errors"] == 0, backend


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
    "newer-version": lambda v: reframe(v, version=4),
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


# ------------------------------------------------------------------------------------------ hostile stores
#: The stall one admission may take from a stuck or dead store. The design bound is the store's read deadline
#: (0.1 s per read, docs/block_store.md "Faults"); this is 10x that, so a loaded machine never flakes, and
#: far below what the faults cost before the deadline (4.1 s per fault on redis://, 26 s on embedded).
STALL_BOUND_S = 1.0
HANG_BOUND_S = 120.0  # a call still running after this is a hang (the FIFO bug never returned)


def bounded(fn, timeout: float = HANG_BOUND_S):
    """``fn()`` on a daemon thread; its result, or a test failure if it is still running after ``timeout``."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout:.0f} s: the engine is blocked"
    if "error" in box:
        raise box["error"]
    return box["result"]


def block_keys(llm, prompt) -> list[bytes]:
    return PrefixHasher(llm.cache.layout, llm.fingerprint, BS).block_keys(prompt)


def generate(llm, prompts) -> list[list[int]]:
    return [o.token_ids for o in bounded(lambda: llm.generate(prompts, PARAMS))]


def written(model, url: str, ns: str, prompt: list[int], secret: str | None = None):
    """An engine computes ``prompt`` and writes its blocks: (its block keys, its store (closed: for names),
    the block spec)."""
    with LLM(model, memory="1MiB", kv_store=url, kv_namespace=ns, kv_store_secret=secret) as a:
        assert generate(a, [prompt]) == recompute(model, [prompt])
        assert a.flush_kv_store(timeout=30)
        return block_keys(a, prompt), a.kv_store, BlockSpec(a.cache.layout, BS, a.fingerprint)


@pytest.mark.parametrize("fault", ["valkey-paused", "embedded-paused", "embedded-killed", "cluster-node-paused"])
def test_a_stuck_or_dead_store_costs_each_admission_a_bounded_stall(fault, model, prompts):
    g = torch.Generator().manual_seed(13)
    fresh = [torch.randint(1, SMALL["vocab_size"], (2 * BS + 3,), generator=g).tolist() for _ in range(4)]
    want = recompute(model, prompts[:1] + fresh)
    broken = StoreFault(fault)
    llm = LLM(model, memory="1MiB", kv_store=broken.url, kv_namespace=namespace())
    try:
        assert generate(llm, prompts[:1]) == want[:1]
        assert llm.flush_kv_store(timeout=30)
        llm.kv_store.retry_after = 0.0  # no back-off window: every admission asks the stuck store
        llm.kv_store.read_deadline = BlockStore.read_deadline  # the design's, not the suite's 5 s (conftest)
        broken.make(llm.kv_store)
        tier = llm.scheduler.tier
        tier.slowest_fetch_s, before = 0.0, tier.fetches
        # One admission per generate call, each of a prompt the pool does not hold: each asks the store.
        assert [generate(llm, [p])[0] for p in fresh] == want[1:]
        assert tier.fetches - before == 4
        assert tier.slowest_fetch_s < STALL_BOUND_S, f"{fault}: an admission waited {tier.slowest_fetch_s:.2f} s"
        stats = llm.kv_store.stats()
        assert stats.errors >= 1 and (fault.endswith("killed") or stats.timeouts >= 1)
    finally:
        broken.resume()
        llm.close()
        broken.stop()


def test_a_fifo_or_a_link_in_a_disk_store_never_blocks_the_engine(model, prompts, tmp_path):
    url, ns = f"disk:{tmp_path / 'store'}", namespace()
    want = recompute(model, prompts[1:])
    keys, store, _ = written(model, url, ns, prompts[0])
    paths = [store.path_of(k) for k in keys]
    outside = tmp_path / "outside"
    outside.write_bytes(paths[2].read_bytes())  # a valid block of another key, outside the store
    paths[0].unlink()
    os.mkfifo(paths[0])  # opened plainly, this blocked the engine forever
    with LLM(model, memory="1MiB", kv_store=url, kv_namespace=ns) as b:
        assert generate(b, prompts[1:]) == want
        assert b.stats.store_hit_tokens == 0
        assert b.flush_kv_store(timeout=30)
    assert paths[0].is_file() and not paths[0].is_symlink()  # the FIFO was removed and b's block written
    paths[1].unlink()
    paths[1].symlink_to(outside)
    with LLM(model, memory="1MiB", kv_store=url, kv_namespace=ns) as c:
        assert generate(c, prompts[1:]) == want
        assert c.stats.store_hit_tokens == BS  # block 0 only: the link is a miss, never followed
        assert c.flush_kv_store(timeout=30)
    assert not paths[1].is_symlink() and outside.read_bytes() == paths[2].read_bytes()  # the target untouched


def test_a_full_server_refuses_writes_and_still_serves_reads(model, prompts, valkey_node):
    ns = namespace()
    written(model, valkey_node.url, ns, prompts[0])
    client = _raw_client(valkey_node)
    saved = {**client.config_get("maxmemory-policy"), **client.config_get("maxmemory")}
    client.config_set("maxmemory-policy", "noeviction")  # the server's default policy
    client.config_set("maxmemory", "1")  # every write is refused with OOM
    try:
        with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
            want = recompute(model, prompts[1:])
            assert generate(b, prompts[1:]) == want
            assert b.flush_kv_store(timeout=30)  # its new blocks were refused
            stats = b.kv_store.stats()
            assert stats.errors >= 1 and stats.dropped_writes >= 1 and stats.puts == 0
            c = LLM(model, memory="1MiB", kv_store=b.kv_store)  # right after the refused writes
            assert generate(c, prompts[1:]) == want
            assert b.stats.store_hit_tokens == c.stats.store_hit_tokens == SHARED_BLOCKS * BS
    finally:
        for option, value in saved.items():
            client.config_set(option, value)
        client.close()


def test_a_key_of_the_wrong_type_is_one_miss_and_is_removed(model, prompts, valkey_node):
    ns = namespace()
    keys, store, spec = written(model, valkey_node.url, ns, prompts[0])
    name = store.key_name(keys[1])
    client = _raw_client(valkey_node)
    client.delete(name)
    client.rpush(name, b"not a block")
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
        assert generate(b, prompts[1:]) == recompute(model, prompts[1:])
        assert b.stats.store_hit_tokens == BS  # block 0; blocks 2 and 3 were fetched and verified too
        assert b.kv_store.stats().invalid == 1 and b.kv_store.stats().errors == 0
        assert b.flush_kv_store(timeout=30)
    assert client.type(name) == b"string"  # the list was removed and b's block 1 written
    verify_block(spec, client.get(name), keys[1])
    client.close()


def test_oversized_junk_values_are_fetched_bounded_and_all_dropped(model, valkey_node):
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(1, SMALL["vocab_size"], (8 * BS + 3,), generator=g).tolist()
    ns = namespace()
    client = _raw_client(valkey_node)
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
        keys = block_keys(b, prompt)
        names = [b.kv_store.key_name(k) for k in keys]
        junk = os.urandom(3 << 20)  # 3 MiB under each of the 8 block keys (24 MiB in all)
        for name in names:
            client.set(name, junk)
        expected = b.kv_store.value_bytes(BlockSpec(b.cache.layout, BS, b.fingerprint), keys[0])
        sent = client.info("stats")["total_net_output_bytes"]
        assert generate(b, [prompt]) == recompute(model, [prompt])
        fetched = client.info("stats")["total_net_output_bytes"] - sent
        assert b.stats.store_hit_tokens == 0 and b.kv_store.stats().invalid == 8
        assert fetched < 8 * (expected + 1) + (64 << 10)  # never more than a block + 1 byte per key
        assert b.flush_kv_store(timeout=30)
    assert all(v is None or len(v) == expected for v in client.mget(names))  # every junk value dropped
    client.close()


def test_a_block_copied_under_another_key_is_refused(model, prompts, valkey_node):
    ns = namespace()
    keys, store, _ = written(model, valkey_node.url, ns, prompts[0])
    names = [store.key_name(k) for k in keys]
    client = _raw_client(valkey_node)
    copied = client.get(names[2])
    client.set(names[1], copied)  # well-formed, valid digest, another position's K/V
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
        assert generate(b, prompts[1:]) == recompute(model, prompts[1:])
        assert b.stats.store_hit_tokens == BS and b.kv_store.stats().invalid == 1
        assert b.flush_kv_store(timeout=30)
    assert client.get(names[1]) != copied  # deleted and replaced by b's own block 1
    client.close()


SECRET = "a shared secret of the deployment"


def _max_scales(value: bytes) -> bytes:
    """A forged block: the same key and shape, every K and V scale the largest the encoder can produce."""
    fields = header_fields(value)
    rows = fields["num_layers"] * fields["tokens"] * (fields["head_end"] - fields["head_start"])

    def patch(buf: bytearray, header_len: int) -> None:
        buf[header_len : header_len + 8 * rows] = torch.full((2 * rows,), 65504 / 127).numpy().tobytes()

    return reframe(value, patch)


def test_a_shared_secret_authenticates_blocks_and_separates_deployments(model, prompts, valkey_node, monkeypatch):
    url, ns = valkey_node.url, namespace()
    want = recompute(model, prompts[1:])
    client = _raw_client(valkey_node)

    def run(secret):
        with LLM(model, memory="1MiB", kv_store=url, kv_namespace=ns, kv_store_secret=secret) as llm:
            out = generate(llm, prompts[1:])
            assert llm.flush_kv_store(timeout=30)
            return out, llm.stats.store_hit_tokens, llm.kv_store.stats()

    keys, store, spec = written(model, url, ns, prompts[0], SECRET)
    assert store.authenticated
    names = [store.key_name(k) for k in keys]
    assert all(keys[1].hex() not in n.decode() for n in names)  # names do not reveal the prefix
    out, hit, _ = run(SECRET)
    assert out == want and hit == SHARED_BLOCKS * BS  # the same secret shares blocks
    for other in ("another deployment's secret", None):
        out, hit, stats = run(other)  # another secret, or none: nothing shared
        assert out == want and hit == 0 and stats.invalid == 0
    monkeypatch.setenv(SECRET_ENV, SECRET)
    out, hit, _ = run(None)  # the secret from the environment: a's blocks and those the second run wrote
    assert out == want and hit == (len(prompts[1]) - 1) // BS * BS
    monkeypatch.delenv(SECRET_ENV)

    # Forgeries by someone who can write to the server but has not the secret: each is one refused block.
    valid = client.get(names[1])
    state = assemble_blocks(spec, [valid], header_len=header_fields(valid)["header_len"])
    forgeries = {
        "untagged": encode_block(spec, state, keys[1]),
        "other secret": encode_block(spec, state, keys[1], b"a guessed secret!"),
        "copied": client.get(names[2]),
        "old tag": _max_scales(valid),
    }
    for name, forged in forgeries.items():
        client.set(names[1], forged)
        out, hit, stats = run(SECRET)
        assert out == want, name
        assert hit == BS and stats.invalid == 1, name
        assert stats.unauthenticated == (0 if name == "copied" else 1), name
        stored = client.get(names[1])
        assert stored != forged and verify_block(spec, stored, keys[1], secret=SECRET.encode())  # replaced
    client.close()


def test_without_a_secret_a_well_formed_forgery_is_accepted(model, prompts, valkey_node):
    """The threat model's other half (docs/block_store.md): without a secret, whoever can write to the store
    can make an engine attend over K/V it did not compute, as long as the block is well formed."""
    ns = namespace()
    keys, store, _ = written(model, valkey_node.url, ns, prompts[0])
    name = store.key_name(keys[1])
    client = _raw_client(valkey_node)
    client.set(name, _max_scales(client.get(name)))
    with LLM(model, memory="1MiB", kv_store=valkey_node.url, kv_namespace=ns) as b:
        generate(b, prompts[1:])
        assert b.stats.store_hit_tokens == SHARED_BLOCKS * BS and b.kv_store.stats().invalid == 0
    client.close()


def test_a_bad_secret_or_a_secret_for_an_open_store_is_refused_before_anything_starts(model, tmp_path):
    from int8kv.blockstore import InvalidStoreSecret, open_block_store
    from int8kv.errors import InvalidEngineConfig

    with pytest.raises(InvalidStoreSecret):
        LLM(model, memory="1MiB", kv_store=f"disk:{tmp_path}", kv_store_secret="too short")
    assert not any(tmp_path.iterdir())  # no store directory was made
    with open_block_store(f"disk:{tmp_path}", secret=SECRET) as store:
        with pytest.raises(InvalidEngineConfig, match="own secret"):
            LLM(model, memory="1MiB", kv_store=store, kv_store_secret=SECRET)
        assert LLM(model, memory="1MiB", kv_store=store).kv_store.authenticated  # the store's secret applies
