"""Structured outputs and tool calls through `int8kv serve` and the real `openai` client, on the session's packaged
SmolLM2 server (conftest.py: started with `--tool-call-parser hermes --enable-auto-tool-choice`). SmolLM2's own
template shows no tools to the model; "required" and named tool choices hold its output to the calls anyway."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.base + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_fifty_sampled_json_answers_follow_their_schema(client):
    def one(seed: int) -> str:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "A person as JSON, please."}],
            temperature=1.0, seed=seed, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                     "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(50)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 10


def test_vllm_fields_and_streaming(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Is the sky blue? Answer:", max_tokens=8,
                                  temperature=1.0, seed=1, n=3, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A code:", max_tokens=12, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=64, temperature=1.0, seed=5, n=2, stream=True,
        extra_body={"guided_json": PERSON})
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid JSON schema: Unsupported type"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "invalid regular expression"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot also follow response_format"),
    ({"extra_body": {"guided_decoding_backend": "outlines"}},
     "guided_decoding_backend is not supported by this server"),
])
def test_bad_structured_requests_are_400s_naming_the_problem(client, fields, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=4, **fields)
    assert message in caught.value.body["message"]


def _call_args(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    return json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(client, stream):
    """required: the model must call one of the tools (the grammar holds it to their schemas); the call goes back
    as an assistant message and a tool message, and the model answers in text."""
    kwargs = {"model": "SmolLM2-135M-Instruct", "tools": TOOLS, "max_tokens": 60, "temperature": 0}
    if stream:
        calls, reason = {}, None
        for chunk in client.chat.completions.create(messages=ASK, tool_choice="required", stream=True,
                                                    parallel_tool_calls=False, **kwargs):
            for c in chunk.choices:
                for d in c.delta.tool_calls or ():
                    calls.setdefault(d.index, d)  # each call comes whole in one delta
                reason = c.finish_reason or reason
        calls = [calls[k] for k in sorted(calls)]
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice="required", **kwargs)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert r.choices[0].message.content is None
    assert reason == "tool_calls" and calls and (len(calls) == 1 or not stream)  # parallel_tool_calls false: one
    for call in calls:
        args = _call_args(call)
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(args, WEATHER)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"} for c in calls]
    answer = client.chat.completions.create(messages=history, tool_choice="none", **{**kwargs, "max_tokens": 16})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_and_auto(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice=named,
                                       max_tokens=60, temperature=1.0, seed=3)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(_call_args(call), WEATHER)
    # auto: the model decides; a 135M model answers in text here, and the answer's shape says which it did
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, max_tokens=40,
                                       temperature=0)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    assert (reason == "tool_calls") == bool(message.tool_calls)
    assert message.tool_calls or isinstance(message.content, str)
    # streamed, its text comes piece by piece (the parser holds back only what could begin a call)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, stream=True)
        if c.choices]
    if not message.tool_calls:
        assert "".join(pieces) == message.content and sum(bool(p) for p in pieces) > 5
