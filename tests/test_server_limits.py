"""`int8kv serve` under its limits: a full queue answers 429 with Retry-After, and SIGTERM ends it with status 0
while a request runs. One live server (one running slot, a queue of one) for the module."""

import threading
import time

import openai
import pytest
from server_helpers import ServerProcess, make_tiny_model, metric


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_limits")
    # A stream that cannot end by itself within the tests (15,000 tokens: the tiny model decodes 1,000 in under
    # the 2 s of --shutdown-timeout on an idle core), in a pool that holds it in F16 or INT8 (256 B a token).
    model_dir = make_tiny_model(root / "tiny", max_positions=16384)
    proc = ServerProcess("--model", str(model_dir), "--memory", "4MiB", "--max-num-seqs", "1", "--max-queue", "1",
                         "--max-tokens", "15000", "--shutdown-timeout", "2", log_path=root / "server.log")
    try:
        yield proc
    finally:
        proc.kill()  # only if a test failed before its SIGTERM


def wait_for(predicate, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def long_stream(client: openai.OpenAI):
    return client.completions.create(model="tiny", prompt="the a of", max_tokens=15000, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def test_a_full_queue_gets_429_with_retry_after_then_requests_succeed_again(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    running = long_stream(client)
    assert next(iter(running)).choices[0].text  # holds the one running slot
    waiting = long_stream(client)  # takes the one queue place
    wait_for(lambda: metric(server.base, "int8kv_requests_waiting") == 1, "the second request to queue")
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="tiny", prompt="the", max_tokens=2)
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "1"
    assert "the queue holds 1" in caught.value.body["message"]
    wait_for(lambda: metric(server.base, "int8kv_requests_rejected_total") == 1, "the refusal to be counted")
    running.close()
    waiting.close()
    wait_for(lambda: metric(server.base, "int8kv_kv_blocks_used") == 0
             and metric(server.base, "int8kv_requests_waiting") == 0, "the aborted requests to leave")
    r = client.completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_sigterm_ends_the_running_stream_cleanly_after_the_timeout_and_exits_0(server):
    """--shutdown-timeout 2: SIGTERM lets the running stream go on for 2 s, then ends it with a last chunk
    (finish_reason "abort") and [DONE]; nothing is cancelled, so the log holds no traceback."""
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = long_stream(client)
    assert next(iter(stream)).choices[0].text
    ends: list = []
    problems: list = []

    def consume() -> None:
        try:
            ends.extend(c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason)
        except Exception as e:  # noqa: BLE001 - a stream cut off mid-way is what this test refuses
            problems.append(e)

    reader = threading.Thread(target=consume)
    reader.start()
    assert server.stop() == 0, server.output()
    reader.join(60)
    assert not reader.is_alive() and not problems, problems  # the openai client saw [DONE], not a cut
    assert ends == ["abort"]
    assert "Traceback" not in server.output() and "CancelledError" not in server.output(), server.output()
    with pytest.raises(openai.APIConnectionError):  # nothing listens any more
        client.completions.create(model="tiny", prompt="the", max_tokens=2)
