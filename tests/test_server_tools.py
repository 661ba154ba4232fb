"""Tool calls read from a model's text (hermes, llama3_json) and the grammars of "required" and named tool choices,
without a server; the request shapes' checks."""

import json

import pytest
from pydantic import ValidationError

from int8kv import cli
from int8kv.server import tools
from int8kv.server.protocol import ChatCompletionRequest

# ChatML with tools in the system turn and calls as <tool_call> JSON, as Hermes-style templates write them
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
To call one, write <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def names_and_args(calls):
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_and_the_text_before_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = tools.parse(text, "hermes")
    assert content == "Let me look.\n"  # the text before the first call, as it was streamed
    assert names_and_args(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, calls = tools.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "hermes")
    assert content is None and names_and_args(calls) == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "no calls here", '<tool_call>{"name": "get_time", "arguments": {}}',  # not closed
    '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # not JSON
    '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>["get_time"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '<tool_call>{"name": "f", "extra": 1}</tool_call>',
])
def test_hermes_text_without_whole_calls_is_content_unchanged(text):
    assert tools.parse(text, "hermes") == (text, [])


@pytest.mark.parametrize(("parser", "text", "ready"), [
    ("hermes", "It is sunny", 11),
    ("hermes", "It is sunny <tool", 12),  # " <tool" could begin a call: held back
    ("hermes", "It is sunny <tool_call>{", 12),
    ("hermes", "It <b>", 6),  # "<b" cannot begin "<tool_call>"
    ("hermes", "  \n", 0), ("hermes", "<tool_call>{", 0), ("hermes", " <too", 0),
    ("llama3_json", "It is sunny", 11), ("llama3_json", " {", 0), ("llama3_json", "<|python", 0),
    ("llama3_json", "<|python_tag|>{", 0), ("llama3_json", "", 0), ("llama3_json", "  ", 0),
])
def test_what_can_stream_before_the_output_ends(parser, text, ready):
    assert tools.streamable(text, parser) == ready
    # whatever streams is content in the whole answer, however it goes on
    for tail in ("", "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", " and more."):
        content, calls = tools.parse(text + tail, parser)
        assert (content or "")[:ready] == text[:ready]


def test_llama3_json_calls():
    content, calls = tools.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                 '{"name": "get_time", "parameters": {}}', "llama3_json")
    assert content is None
    assert names_and_args(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert names_and_args(tools.parse('{"name": "get_time", "arguments": {}}', "llama3_json")[1]) == [("get_time", {})]
    for text in ("It is sunny.", '{"name": "get_time", "parameters": {}} and more', '{"city": "Rome"}'):
        assert tools.parse(text, "llama3_json") == (text, [])


def test_required_and_named_grammars_and_their_calls():
    body = request(tools=[WEATHER, TIME], tool_choice="required")
    guide = tools.guide(body.tools, body.tool_mode(), None, parallel=True)
    schema = json.loads(guide.spec)
    assert guide.kind == "json" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert json.loads(tools.guide(body.tools, "required", None, parallel=False).spec)["maxItems"] == 1
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert names_and_args(tools.guided_calls(text, "required", None)) == [("get_weather", {"city": "Oslo"}),
                                                                         ("get_time", {})]
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode() == "named" and named.named_tool() == "get_weather"
    guide = tools.guide(named.tools, "named", "get_weather", parallel=True)
    assert json.loads(guide.spec) == WEATHER["function"]["parameters"]
    assert names_and_args(tools.guided_calls('{"city": "Oslo"}', "named", "get_weather")) == [
        ("get_weather", {"city": "Oslo"})]
    assert tools.guided_calls('{"city": "Os', "named", "get_weather") is None  # cut short: stays content


def test_tool_modes_and_request_refusals():
    assert request().tool_mode() == "none" and request(tools=[TIME]).tool_mode() == "auto"
    assert request(tools=[TIME], tool_choice="none").tool_mode() == "none"
    for fields, message in [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "pattern"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "content is required"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls belong to assistant"),
        ({"response_format": {"type": "json_schema"}}, "json_schema is given with type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "give one structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give one of json, regex"),
        ({"guided_choice": []}, "choice needs a non-empty list"),
    ]:
        with pytest.raises(ValidationError, match=message):
            request(**fields)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    convo = request(messages=[{"role": "user", "content": "time?"},
                              {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assistant = convo.messages[1].template_dict()
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # as templates read it
    assert convo.messages[2].template_dict() == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    assert assistant["content"] == ""  # templates that join content as text get text


def test_a_hermes_template_shows_the_tools_the_calls_and_their_results(tmp_path):
    """What a tool conversation becomes through a tool-capable template: the tools' definitions, the assistant's
    calls with their arguments as objects, the tool's answer; and the parser reads back the calls it wrote."""
    from server_helpers import make_tiny_model
    from transformers import AutoTokenizer

    from int8kv.server.app import chat_text

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "tiny"))
    tokenizer.chat_template = TEMPLATE
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = request(messages=[{"role": "user", "content": "weather?"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[WEATHER, TIME])
    text = chat_text(tokenizer, [m.template_dict() for m in body.messages],
                     tools=[t.model_dump(exclude_none=True) for t in body.tools])
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text  # the definitions
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    written = text[text.rindex("<tool_call>"):text.rindex("</tool_call>") + len("</tool_call>")]
    assert names_and_args(tools.parse(written, "hermes")[1]) == [("get_weather", {"city": "Oslo"})]


def test_the_cli_offers_the_parsers_the_server_has():
    assert cli.TOOL_PARSERS == tools.PARSERS
