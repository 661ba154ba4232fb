"""Tool calling: what a chat request's `tools` and `tool_choice` make of its output.

* "required" and a named function: the output is held by a grammar (engine/grammar.py), as vLLM does: a named
  function's output is its arguments (a JSON object following its `parameters` schema); "required" writes a
  JSON array of one or more calls, `{"name": ..., "parameters": {...}}` each, naming only the given functions.
* "auto": the model writes as it was trained to and the server's `--tool-call-parser` reads calls out of its
  text: `hermes` (Qwen 2.5 / 3, Hermes, SmolLM3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) or
  `llama3_json` (Llama 3.1+: `{"name": ..., "parameters": {...}}`, several separated by `;`). Text that does not
  parse as calls is the answer's content, unchanged.
* "none": tools are shown to the template and nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ..engine.grammar import Guide

PARSERS = ("hermes", "llama3_json")
HERMES_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape (`arguments` as JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def guide(tools: list[Any], mode: str, named: str | None, parallel: bool) -> Guide | None:
    """The grammar of a "required" or "named" request's output; None for "auto" and "none"."""
    if mode == "named":
        (tool,) = [t for t in tools if t.function.name == named]
        return Guide.json_schema(_parameters(tool))
    if mode != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return Guide.json_schema(schema)


def guided_calls(text: str, mode: str, named: str | None) -> list[dict[str, Any]] | None:
    """The calls of a grammar-held output; None when the text is not whole (cut by max_tokens or a stop
    string), so it stays content."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode == "named":
        return [call(named, text)]
    return [call(c["name"], c["parameters"]) for c in value]


def parse(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a model's free text under `parser`; (text, []) when it holds no whole call."""
    if parser == "hermes":
        found = _HERMES.findall(text)
        calls = []
        for body in found:
            try:
                value = json.loads(body)
            except ValueError:
                return text, []
            if not _is_call(value, "arguments"):
                return text, []
            calls.append(call(value["name"], value.get("arguments", {})))
        if not calls:
            return text, []
        head = text[: text.index(HERMES_START)]
        return (head if head.strip() else None), calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        if not _is_call(value, key):
            return text, []
        calls.append(call(value["name"], value.get(key, {})))
        at = end
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(body) - len(rest)
    return None, calls


def streamable(text: str, parser: str) -> int:
    """How much of a growing output (the text so far) is surely content under `parser`, to stream before the
    output ends: hermes, the text before a `<tool_call>` (or before an end that could begin one); llama3_json,
    everything once the output starts with something other than a call. Leading blanks wait: an answer that is
    calls alone has no content."""
    if parser == "hermes":
        at = text.find(HERMES_START)
        if at < 0:
            at = len(text)
            for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
                if text.endswith(HERMES_START[:n]):
                    at -= n
                    break
        return at if text[:at].strip() else 0
    head = text.lstrip()
    if not head or head.startswith("{") or head.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(head):
        return 0
    return len(text)


def _is_call(value: Any, key: str) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("name"), str)
            and isinstance(value.get(key, {}), dict) and set(value) <= {"name", key})
