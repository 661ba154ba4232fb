"""`int8kv serve` as a vLLM user runs it (`INT8KV_API_KEY=... int8kv serve MODEL --max-model-len ...`), driven by the
real `openai` client: API keys, /tokenize and /detokenize, content parts, log-probabilities and echo (what
evaluation harnesses send), cached-token usage, stop strings, strict request types, hostile bodies, and the
per-request log line. One server for the module (the tiny random Llama of server_helpers)."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from server_helpers import ServerProcess, get, in_process, make_tiny_model, metric, read_reply

from int8kv.engine import LLM, SamplingParams
from int8kv.models import load_model
from int8kv.server import build_app
from int8kv.server.app import chat_prompt_ids

KEY = "sk-test-0123456789"
MEMORY = "160KiB"  # 64 blocks of 16 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("api") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(str(model_dir), "--memory", MEMORY, "--max-model-len", "2048",
                         log_path=model_dir.parent / "server.log", env={"INT8KV_API_KEY": KEY})
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(model_dir):
    model, tokenizer = load_model(str(model_dir), quiet=True)
    return LLM(model, memory=MEMORY, tokenizer=tokenizer)


def post(base: str, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, data, headers), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_positional_model_startup_line_and_max_model_len(server, client):
    assert (f"serving tiny on {server.base}/v1 (KV int8_per_token_head_f32_scale_v1, 64 blocks of 16 tokens, "
            "no KV store, context 2048 tokens, API key required)") in server.output()
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.max_model_len == 2048
    with pytest.raises(openai.BadRequestError) as caught:  # fits the model's 4,096 positions, not --max-model-len
        client.completions.create(model="tiny", prompt=" ".join(["the"] * 2040), max_tokens=10)
    assert "2040 prompt + 10 new tokens exceed the model's 2048 positions (--max-model-len)" in caught.value.message


def test_api_key_guards_v1_and_tokenize_but_not_health(server):
    wrong = openai.OpenAI(base_url=server.base + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model="tiny", prompt="the", max_tokens=1)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        status, body = post(server.base, path, {"prompt": "the"}, key=None)
        assert status == 401 and body["error"]["type"] == "invalid_request_error", (path, body)
    assert get(server.base + "/v1/models")[0] == 401
    assert get(server.base + "/health")[0] == 200 and get(server.base + "/metrics")[0] == 200


def get_with(url: str, authorization: str | None) -> tuple[int, str]:
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_api_docs_and_unknown_paths_need_the_key_too(server):
    # Only /health and /metrics are open: the OpenAPI schema and its pages describe every guarded route.
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/no-such-route"):
        status, body = get_with(server.base + path, None)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (path, body)
    status, body = get_with(server.base + "/openapi.json", f"Bearer {KEY}")
    assert status == 200 and "/v1/completions" in json.loads(body)["paths"]
    assert get_with(server.base + "/docs", f"Bearer {KEY}")[0] == 200


def test_the_bearer_scheme_is_matched_in_any_case_and_the_key_exactly(server):
    for scheme in ("bearer", "BEARER", "bEaReR", "Bearer  "):  # RFC 7235: the scheme is case-insensitive
        assert get_with(server.base + "/v1/models", f"{scheme} {KEY}")[0] == 200, scheme
    for header in (f"Bearer {KEY.upper()}", f"Basic {KEY}", f"Bearer{KEY}", KEY, f"Bearer {KEY}x", "Bearer"):
        assert get_with(server.base + "/v1/models", header)[0] == 401, header


def test_tokenize_and_detokenize_in_vllms_shapes(server, offline):
    tok = offline.tokenizer
    status, body = post(server.base, "/tokenize", {"prompt": "the water of people", "return_token_strs": True})
    ids = tok("the water of people")["input_ids"]
    assert status == 200 and body == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                                      "token_strs": tok.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "what is the water"}]
    status, body = post(server.base, "/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == chat_prompt_ids(tok, messages) and body["token_strs"] is None
    assert post(server.base, "/detokenize", {"tokens": ids}) == (200, {"prompt": tok.decode(ids)})
    status, body = post(server.base, "/detokenize", {"tokens": [3, 10**6]})
    assert status == 400 and "token id 1000000 is not in [0, " in body["error"]["message"]
    status, body = post(server.base, "/tokenize", {"prompt": "the", "messages": messages})
    assert status == 400 and "exactly one of prompt and messages" in body["error"]["message"]


def test_content_as_text_parts_equals_the_joined_string_and_other_parts_are_refused_by_name(client):
    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "the water"}]
    ask = dict(model="tiny", max_tokens=6, temperature=0)
    as_parts = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **ask)
    as_text = client.chat.completions.create(messages=[{"role": "user", "content": "what is\nthe water"}], **ask)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(messages=[{"role": "user", "content": [parts[0], image]}], **ask)
    assert "part 1 has type 'image_url'; this server takes text parts only" in caught.value.message


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "the \ud800 water"}, "prompt: Value error, holds a lone surrogate"),
        ("/v1/completions", {"prompt": ["the", "\udfff"]}, "holds a lone surrogate"),
        ("/v1/completions", {"prompt": "the", "stop": "\ud800"}, "lone surrogate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a \ud800"}]}, "lone surrogate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "lone surrogate"),
        ("/v1/completions", {"prompt": [True]}, "prompt: Value error, must be a string, a list of token ids"),
        ("/v1/completions", {"prompt": "the", "stream": "yes"}, "stream: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "the", "max_tokens": 3.0}, "max_tokens: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "the", "n": "2"}, "n: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "the", "temperature": "0.5"}, "temperature: Input should be a valid number"),
        ("/v1/completions", {"prompt": "the", "ignore_eos": 1}, "ignore_eos: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "the", "seed": True}, "seed: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "the", "logprobs": True}, "logprobs: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "the", "logprobs": 6}, "logprobs: Input should be less than or equal to 5"),
        ("/v1/completions", {"prompt": "the", "max_tokens": 0}, "max_tokens 0 generates nothing"),
        ("/v1/completions", {"prompt": "the", "stream_options": {"include_usage": True}}, "only allowed with stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}], "top_logprobs": 2},
         "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
    ],
)
def test_non_unicode_text_and_wrong_types_get_400_naming_the_field(server, client, path, body, message):
    status, reply = post(server.base, path, {"model": "tiny", "max_tokens": 2, **body})
    assert status == 400, reply
    assert message in reply["error"]["message"] and "Traceback" not in reply["error"]["message"], reply
    assert client.completions.create(model="tiny", prompt="the", max_tokens=1).usage.prompt_tokens == 1


def test_a_76_mb_prompt_is_refused_from_a_prefix_and_health_answers_meanwhile(server):
    prompt = "the water " * 760_000  # 7.6 MB, under the 8 MiB body limit
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=post(server.base, "/v1/completions",
                                                                  {"model": "tiny", "prompt": prompt})))
    worker.start()
    health = get(server.base + "/health", timeout=60)
    worker.join(120)
    status, body = result["r"]
    assert health[0] == 200
    message = body["error"]["message"]
    assert status == 400 and "exceeds the model's 2048 positions: its first " in message, message
    assert int(message.split("its first ")[1].split()[0].replace(",", "")) < 100_000  # of 7,600,000


class GatedTokenizer:
    """The model's tokenizer, whose encode waits until the test opens the gate (and says when it is waiting)."""

    def __init__(self, inner) -> None:
        self.inner, self.entered, self.gate = inner, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tokenizing_runs_off_the_event_loop(model_dir):
    """While a prompt is being tokenized, the loop serves /health (before: the handler tokenized on the loop, so
    /health waited for the tokenizer)."""
    model, tokenizer = load_model(str(model_dir), quiet=True)
    gated = GatedTokenizer(tokenizer)
    with in_process(build_app(LLM(model, memory=MEMORY, tokenizer=gated), "tiny")) as base:
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=post(base, "/v1/completions", {
            "prompt": "the water", "max_tokens": 2, "temperature": 0})))
        worker.start()
        assert gated.entered.wait(60)
        try:
            assert get(base + "/health", timeout=20)[0] == 200  # the tokenizer is still waiting
        finally:
            gated.gate.set()
        worker.join(60)
    assert result["r"][0] == 200 and result["r"][1]["usage"]["completion_tokens"] == 2


def test_a_chunked_body_over_the_limit_gets_413(server, client):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b" " * (1 << 20)
        try:
            for _ in range(9):  # 9 MiB, no Content-Length: only counting the chunks finds the excess
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before the end
            pass
        status, body = read_reply(sock)
    assert status.startswith("HTTP/1.1 413"), (status, body)
    assert "larger than this server reads (8,388,608 bytes)" in body["error"]["message"]
    assert client.completions.create(model="tiny", prompt="the", max_tokens=1).usage.prompt_tokens == 1


def settled(server, name: str, value: float, limit: float = 60.0) -> bool:
    """Whether the metric reaches `value` within `limit` seconds (a bounded wait, no timing asserted)."""
    deadline = time.monotonic() + limit
    while metric(server.base, name) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return metric(server.base, name) == value


def _greedy_words(client, prompt: str, n: int) -> list[str]:
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    return text.split()


def test_a_stop_string_in_the_last_token_is_a_stop_and_no_stop_counts_as_aborted(server, client):
    words = _greedy_words(client, "water is", 30)
    j = next(j for j in range(2, 30) if words[j] not in words[:j])  # its first occurrence is token j
    ask = dict(model="tiny", prompt="water is", max_tokens=j + 1, temperature=0, stop=[" " + words[j]],
               extra_body={"ignore_eos": True})
    aborted = metric(server.base, "int8kv_requests_aborted_total")
    finished = metric(server.base, "int8kv_requests_finished_total")
    r = client.completions.create(**ask)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" ".join(words[:j]), "stop")
    reasons = [c.choices[0].finish_reason for c in client.completions.create(**ask, stream=True)
               if c.choices[0].finish_reason]
    assert reasons == ["stop"]
    early = client.completions.create(**(ask | {"max_tokens": 30}))  # stopped before max_tokens: aborted early
    assert early.choices[0].finish_reason == "stop"
    # The early one leaves the engine between two steps, after its response.
    assert settled(server, "int8kv_requests_finished_total", finished + 3)
    assert metric(server.base, "int8kv_requests_aborted_total") == aborted


def test_streamed_choices_that_stop_end_once(server, client):
    stops = [" the", " of", " water", " people"]
    for _ in range(2):
        stream = client.completions.create(model="tiny", prompt="the people", max_tokens=60, temperature=1.0, n=10,
                                           seed=5, stop=stops, stream=True, extra_body={"ignore_eos": True})
        ends = [(c.index, c.finish_reason) for chunk in stream for c in chunk.choices if c.finish_reason]
        assert sorted(i for i, _ in ends) == list(range(10)), ends  # each choice once
    assert settled(server, "int8kv_kv_blocks_used", 0)  # stopped choices leave between steps, after their end


def test_cached_tokens_in_usage_and_prefix_metrics(server, client):
    prompt = " ".join(["people who write the water"] * 8)  # 40 tokens: two full blocks
    queried = metric(server.base, "int8kv_prefix_cache_queried_tokens_total")
    hits = metric(server.base, "int8kv_prefix_cache_hit_tokens_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert metric(server.base, "int8kv_prefix_cache_queried_tokens_total") - queried == 64
    assert metric(server.base, "int8kv_prefix_cache_hit_tokens_total") - hits == 32
    assert 0 < metric(server.base, "int8kv_prefix_cache_hit_rate") <= 1
    assert metric(server.base, "int8kv_kv_store_hit_tokens_total") == 0  # no store


def test_chat_logprobs_equal_the_offline_engine_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "tell me about the water"}]
    (want,) = offline.generate([chat_prompt_ids(offline.tokenizer, messages)],
                               SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))
    ask = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
               extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        [lp for e in want.logprobs for _, lp in e.top], abs=1e-4)
    assert all(c.token == c.top_logprobs[0].token and bytes(c.bytes) == c.token.encode() for c in content)
    assert len(content) == r.usage.completion_tokens == 6
    streamed = [c for chunk in client.chat.completions.create(**ask, stream=True) for ch in chunk.choices
                if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_harnesses_ask(client, offline):
    """What lm-eval's completions backend sends for loglikelihood: echo, logprobs, max_tokens 0 (or 1), token ids."""
    text = "the water of people who write"
    ids = offline.tokenizer(text)["input_ids"]
    want = offline.prompt_logprobs(ids, 1)
    r = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=1, max_tokens=0)
    (c,) = r.choices
    lp = c.logprobs
    assert c.text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
    assert [text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens, strict=True)] == lp.tokens
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    # Two token-id prompts, one new token each: the prompts' entries, then the generated one's.
    other = offline.tokenizer("make the good")["input_ids"]
    r = client.completions.create(model="tiny", prompt=[ids, other], echo=True, logprobs=2, max_tokens=1,
                                  temperature=0)
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(ids) + 1, len(other) + 1]
    (gen,) = offline.generate([other], SamplingParams(max_tokens=1, logprobs=2))
    assert r.choices[1].logprobs.token_logprobs[-1] == pytest.approx(gen.logprobs[0].logprob, abs=1e-4)
    assert r.choices[1].text.startswith(offline.tokenizer.decode(other))
    streamed = "".join(ch.text for chunk in client.completions.create(model="tiny", prompt=text, echo=True,
                                                                       max_tokens=0, stream=True)
                       for ch in chunk.choices)
    assert streamed == text
    # Streamed with generated tokens: the chunks' logprobs add up to the non-streamed object.
    ask = dict(model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=4, temperature=0,
               extra_body={"ignore_eos": True})
    whole = client.completions.create(**ask).choices[0]
    chunks = [ch for chunk in client.completions.create(**ask, stream=True) for ch in chunk.choices]
    assert "".join(ch.text for ch in chunks) == whole.text
    pieces = [ch for ch in chunks if ch.logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(ch.logprobs, field) for ch in pieces), []) == getattr(whole.logprobs, field), field


def test_each_request_gets_one_log_line(server, client):
    r = client.completions.create(model="tiny", prompt="the a of", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    lines = [line for line in server.output().splitlines() if line.startswith(f"int8kv: {r.id}: ")]
    assert len(lines) == 1
    assert "3 prompt tokens (0 cached), 3 completion tokens, finish length, " in lines[0] and lines[0].endswith(" s")


def test_a_minus_inf_logprob_is_reported_as_json_can_carry_it(offline):
    from int8kv.engine.sampler import TokenLogprob
    from int8kv.server.app import chat_logprobs, completion_logprobs

    masked = TokenLogprob(5, float("-inf"), ((5, float("-inf")),))
    for body in (completion_logprobs(offline.tokenizer, [3, 5], [None, masked], [], 0),
                 chat_logprobs(offline.tokenizer, [masked], [3])):
        text = json.dumps(body, allow_nan=False)  # strict JSON: no -Infinity
        assert "-9999.0" in text
