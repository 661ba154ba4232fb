"""`int8kv serve` as a live process on a loopback port, driven by the real `openai` client.

One server for the module (a tiny random Llama with a word-level tokenizer, built offline); its answers are
checked against the offline engine (`LLM.generate`) on the same model, format and pool size.
"""

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from server_helpers import ServerProcess, get, make_tiny_model, metric, read_reply

from int8kv.engine import LLM, SamplingParams
from int8kv.models import load_model
from int8kv.server.app import chat_prompt_ids

MEMORY = "160KiB"  # 64 blocks of 16 tokens (2,560 INT8 bytes each): 1,024 tokens; the model's context is 4,096
PROMPTS = ["the a of hot", "water is", "people who write", "make the good", "find any new work"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    model_dir = make_tiny_model(root / "tiny")
    server = ServerProcess("--model", str(model_dir), "--memory", MEMORY, "--max-num-seqs", "8", "--max-queue",
                           "64", "--max-tokens", "1000", log_path=root / "server.log")
    try:
        yield server, model_dir
    finally:
        assert server.stop() == 0, server.output()  # SIGTERM: graceful, exit status 0


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(served):
    model, tokenizer = load_model(str(served[1]), quiet=True)
    return LLM(model, memory=MEMORY, tokenizer=tokenizer)


def blocks_in_use(served) -> float:
    return metric(served[0].base, "int8kv_kv_blocks_used")


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert get(served[0].base + "/health")[0] == 200


def test_completions_match_the_offline_engine(client, offline):
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        (choice,) = r.choices
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_chat_matches_the_offline_engine_on_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "you are good"}, {"role": "user", "content": "what is the water"}]
    ids = chat_prompt_ids(offline.tokenizer, messages)
    assert ids[-1] == offline.tokenizer.convert_tokens_to_ids("<|assistant|>")
    (want,) = offline.generate([ids], SamplingParams(max_tokens=10))
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)


USAGE = {"include_usage": True}  # stream_options asking for the usage chunk


def _streamed(stream, chat: bool) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons by choice index, and the usage (None unless asked for); each choice ends once."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    use = None
    for chunk in stream:
        assert use is None, "usage comes in the last chunk"
        use = chunk.usage
        assert (use is None) == bool(chunk.choices), "the usage chunk (only) has choices: []"
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                assert c.index not in reasons, f"choice {c.index} ended twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, use


def test_streaming_equals_non_streaming_under_greedy(client):
    for prompt in PROMPTS[:3]:
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=15, temperature=0)
        texts, reasons, use = _streamed(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=15, temperature=0, stream=True,
                                      stream_options=USAGE), False
        )
        assert texts == {0: plain.choices[0].text} and reasons == {0: plain.choices[0].finish_reason}
        assert use.completion_tokens == plain.usage.completion_tokens
    messages = [{"role": "user", "content": "tell me about the people"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    texts, reasons, use = _streamed(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
                                       stream_options=USAGE),
        True,
    )
    assert texts == {0: plain.choices[0].message.content}
    assert use.total_tokens == plain.usage.total_tokens


def _sse(base: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_sse_wire_format_ends_with_done_and_usage_only_when_asked(served):
    ask = {"model": "tiny", "prompt": "the a", "max_tokens": 3, "temperature": 0, "stream": True}
    for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "the a"}]})):
        if extra:
            ask = {k: v for k, v in ask.items() if k != "prompt"} | extra
        plain = _sse(served[0].base, path, ask)  # what a client reading chunk.choices[0] relies on
        assert all(chunk["choices"] and "usage" not in chunk for chunk in plain)
        asked = _sse(served[0].base, path, ask | {"stream_options": {"include_usage": True}})
        assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 3
        assert asked[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert all(chunk["choices"] for chunk in asked[:-1])


def test_n_seeded_samples_are_the_offline_engine_with_seed_plus_index(client, offline):
    prompt = "the people"
    want = offline.generate([prompt] * 3, [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j)
                                           for j in range(3)])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in want]
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    texts, _, _ = _streamed(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0,
                                                      seed=7, n=3, stream=True), False)
    assert [texts[i] for i in range(3)] == [o.text for o in want]


def test_penalties_cuts_and_logit_bias_are_the_offline_engine(client, offline):
    """Every sampling field reaches the engine: the server's output equals the offline engine's with the same
    SamplingParams, greedy and seeded; a +100 bias on one word makes it the whole output."""
    prompt = "the people of the water"
    water = offline.tokenizer.convert_tokens_to_ids("water")
    cases = [
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {}),
        ({"logit_bias": {str(water): 100}}, {}),
        ({"temperature": 1.0, "seed": 3}, {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.8}),
    ]
    for fields, extra in cases:
        args = {"temperature": 0, **fields}
        bias = {int(k): v for k, v in args.pop("logit_bias", {}).items()} or None
        (want,) = offline.generate([prompt], SamplingParams(max_tokens=10, logit_bias=bias, **args, **extra))
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body=extra,
                                      **fields, **({"temperature": 0} if "temperature" not in fields else {}))
        assert r.choices[0].text == want.text, fields
    assert want.token_ids != offline.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=3)
                                              )[0].token_ids  # the cuts changed the draw
    (biased,) = offline.generate([prompt], SamplingParams(max_tokens=10, logit_bias={water: 100}))
    assert biased.token_ids == [water] * 10


def test_n_choices_are_forks_of_one_prefill_streamed_or_not(served, client, offline):
    """n=3 is one forked group (LLM.add_forked_request): the prompt runs through the model once (the server's
    prompt-token counter moves by its length, not 3x), and choice j equals the offline engine's independent
    request with seed + j; completions and chat, streamed and not."""
    base = served[0].base
    messages = [{"role": "user", "content": "tell me about the water"}]
    # Both prompts are shorter than a block (16 tokens), so no prefix-cache hit can shorten their prefill.
    for chat, prompt in ((False, "make the good water"), (True, chat_prompt_ids(offline.tokenizer, messages))):
        want = offline.generate([prompt] * 3, [SamplingParams(max_tokens=7, temperature=1.0, seed=31 + j)
                                               for j in range(3)])
        assert len({o.text for o in want}) == 3  # the choices diverge: each must read its own blocks
        n_prompt = len(want[0].prompt_token_ids)
        assert n_prompt < 16
        kwargs = dict(model="tiny", max_tokens=7, temperature=1.0, seed=31, n=3)
        create = client.chat.completions.create if chat else client.completions.create
        if chat:
            kwargs["messages"] = messages
        else:
            kwargs["prompt"] = prompt
        for stream in (False, True):
            before = metric(base, "int8kv_prompt_tokens_total")
            if stream:
                texts, reasons, use = _streamed(create(**kwargs, stream=True, stream_options=USAGE), chat)
            else:
                r = create(**kwargs)
                assert [c.index for c in r.choices] == [0, 1, 2]
                texts = {c.index: c.message.content if chat else c.text for c in r.choices}
                reasons, use = {c.index: c.finish_reason for c in r.choices}, r.usage
            assert texts == {j: o.text for j, o in enumerate(want)}
            assert reasons == {j: o.finish_reason for j, o in enumerate(want)}
            assert use.prompt_tokens == n_prompt  # counted once, as OpenAI does
            assert use.completion_tokens == sum(len(o.token_ids) for o in want)
            assert metric(base, "int8kv_prompt_tokens_total") - before == n_prompt
    # n=10 on a server running at most 8 sequences: two forked groups (8 + 2), so two prefills.
    before = metric(base, "int8kv_prompt_tokens_total")
    r = client.completions.create(model="tiny", prompt="the a of", n=10, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(10)) and len({c.text for c in r.choices}) == 1
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 30)
    assert metric(base, "int8kv_prompt_tokens_total") - before == 2 * 3
    assert blocks_in_use(served) == 0


def test_stop_string_cuts_the_text_streamed_or_not(client):
    full = client.completions.create(model="tiny", prompt="water is", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    stop = " " + words[4]  # a word the greedy text reaches, cut before its first occurrence
    cut = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt="water is", max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    texts, reasons, _ = _streamed(client.completions.create(
        model="tiny", prompt="water is", max_tokens=20, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}), False)
    assert (texts[0], reasons[0]) == (cut, "stop")


def test_16_concurrent_streaming_clients_complete_and_free_every_block(served, client, offline):
    prompts = [f"{PROMPTS[i % 5]} {'the ' * (i % 4)}people" for i in range(16)]
    want = offline.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, temperature=0,
                                           stream=True, stream_options=USAGE, extra_body={"ignore_eos": True})
        results[i] = _streamed(stream, False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(16))
    for i in range(16):
        texts, reasons, use = results[i]
        assert texts == {0: want[i].text} and reasons == {0: "length"} and use.completion_tokens == 24
    assert blocks_in_use(served) == 0
    assert metric(served[0].base, "int8kv_requests_running") == 0
    assert metric(served[0].base, "int8kv_kv_blocks_free") == 64


def _raw_post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


LONG_FOR_POOL = " ".join(["the"] * 1100)  # fits the 4,096-token context, not the 1,024-token pool
LONG_FOR_CONTEXT = " ".join(["the"] * 5000)


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate is not supported by this server"),
        ({"frequency_penalty": 2.5}, 400, "frequency_penalty must lie in [-2, 2]"),
        ({"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty must lie in (0, 2]"),
        ({"extra_body": {"top_k": -2}}, 400, "top_k must be an int >= 1"),
        ({"logit_bias": {"100000": 5}}, 400, "logit_bias: token id 100000 is not in [0, "),
        ({"logit_bias": {"the": 5}}, 400, "is not a token id"),
        ({"logit_bias": {"3": 101}}, 400, "logit_bias[3] must lie in [-100, 100]"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 1001}, 400, "max_tokens 1001 is more than this server allows (1000)"),
        # Refused from a prefix: tokenizing stops once the prompt is known to exceed the context.
        ({"prompt": LONG_FOR_CONTEXT}, 400, "exceeds the model's 4096 positions: its first 16,447 characters are"),
        ({"prompt": [3] * 5000}, 400, "the prompt's 5,000 tokens exceed the model's 4096 positions"),
        ({"prompt": " ".join(["the"] * 4090), "max_tokens": 10}, 400, "4090 prompt + 10 new tokens exceed the model"),
        ({"prompt": LONG_FOR_POOL}, 400, "does not fit in the whole KV cache pool"),
        ({"prompt": [3, 100000]}, 400, "token id 100000 is not an int in [0, "),
        ({"prompt": []}, 400, "empty"),
        ({"seed": 2**70}, 400, "seed"),
        ({"n": 100}, 400, "n:"),
        ({"model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, client, kwargs, status, message):
    args = {"model": "tiny", "prompt": "the a", "max_tokens": 4, "temperature": 0, **kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**args)
    err = caught.value
    assert err.status_code == status
    assert message in err.body["message"], err.body
    assert err.body["type"] in ("invalid_request_error", "not_found_error")
    r = client.completions.create(model="tiny", prompt="the a", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert blocks_in_use(served) == 0


@pytest.mark.parametrize(
    ("data", "message"),
    [(b'{"model": "tiny", "prompt": ', "JSON decode error"), (b'{"model": "tiny"}', "prompt: Field required"),
     (b"[1, 2]", "Input should be a valid dictionary")],
)
def test_malformed_json_gets_400_in_openai_shape(served, client, data, message):
    status, body = _raw_post(served[0].base, "/v1/completions", data)
    assert status == 400 and message in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0).usage.prompt_tokens == 1


def test_chat_errors(served, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert "messages" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}], max_tokens=2)
    assert "role" in caught.value.body["message"]
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the"}], max_tokens=2,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(served, client):
    aborted = metric(served[0].base, "int8kv_requests_aborted_total")
    generated = metric(served[0].base, "int8kv_generated_tokens_total")
    stream = client.completions.create(model="tiny", prompt="the a of", max_tokens=1000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    for _ in range(300):  # the abort lands between two engine steps; bounded wait, no timing asserted
        if metric(served[0].base, "int8kv_requests_aborted_total") == aborted + 1:
            break
        threading.Event().wait(0.1)
    assert metric(served[0].base, "int8kv_requests_aborted_total") == aborted + 1
    assert blocks_in_use(served) == 0
    assert metric(served[0].base, "int8kv_generated_tokens_total") - generated < 1000  # it did not run to the end
    assert client.completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0).usage.prompt_tokens == 1


def test_a_body_over_the_limit_gets_413_unread_and_the_server_goes_on(served, client):
    import socket

    port = served[0].port
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # headers only: the body never comes
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {12 << 20}\r\n\r\n".encode())
        status, body = read_reply(sock)
    assert status.startswith("HTTP/1.1 413")
    assert "larger than this server reads (8,388,608 bytes)" in body["error"]["message"]
    assert client.completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0).usage.prompt_tokens == 1


def test_more_completions_than_the_server_ever_holds_is_a_400_not_a_429(served, client):
    with pytest.raises(openai.BadRequestError) as caught:  # 8 prompts x n=16 = 128 > 64 queued + 8 running
        client.completions.create(model="tiny", prompt=["the a"] * 8, n=16, max_tokens=2)
    assert "asks for 128 completions (prompts x n); the server holds at most 72 at once" in caught.value.body["message"]
    r = client.completions.create(model="tiny", prompt=["the a", "water is"], n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text == r.choices[3].text  # greedy: n copies
    assert r.usage.prompt_tokens == 2 + 2 and r.usage.completion_tokens == 12


# The series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries, each
# with {model_name="$model_name"}, and the ones vLLM's metrics docs name beside them.
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
VLLM_DOCS = (
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_preemptions_total", "vllm:request_inference_time_seconds_count", "vllm:request_params_max_tokens_sum",
)


def _scrape(base: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample /metrics shows."""
    from prometheus_client.parser import text_string_to_metric_families

    text = get(base + "/metrics")[1]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _vllm(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples labelled model_name="tiny" and `labels` (a histogram's buckets: each `le`)."""
    want = {"model_name": "tiny", **labels}
    return sum(v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items())


def test_vllm_metric_names_and_labels_for_its_dashboard(served, client):
    base = served[0].base
    before = _scrape(base)
    names = {n for n, _ in before}
    assert set(DASHBOARD + VLLM_DOCS) <= names, sorted(set(DASHBOARD + VLLM_DOCS) - names)
    for name in DASHBOARD + VLLM_DOCS:  # every series carries the served model's name
        assert all(dict(ls).get("model_name") == "tiny" for n, ls in before if n == name), name
    prompt = "the people of the water"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    after = _scrape(base)

    def delta(name: str, **labels: str) -> float:
        return _vllm(after, name, **labels) - _vllm(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_generation_tokens_sum") == 5 and delta("vllm:request_prompt_tokens_sum") == 5
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 1 and delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4 == delta("vllm:time_per_output_token_seconds_count")
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert delta(name + "_count") == 1 and delta(name + "_sum") >= 0, name
    # the parts add up: queue + prefill + decode within the whole request
    parts = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert parts <= delta("vllm:e2e_request_latency_seconds_sum") + 1e-6
    assert delta("vllm:prefix_cache_queries_total") >= delta("vllm:prefix_cache_hits_total") >= 0
    assert _vllm(after, "vllm:kv_cache_usage_perc") == _vllm(after, "vllm:gpu_cache_usage_perc") == 0  # all freed
    assert _vllm(after, "vllm:num_requests_running") == 0
