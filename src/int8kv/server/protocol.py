"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions (the fields int8kv serves),
and vLLM's for /tokenize and /detokenize.

Requests are strict: an unknown field is refused (400, "X is not supported by this server") rather than silently
ignored, so a client never believes a setting took effect when it did not, and no value is coerced (`stream:
"yes"`, `prompt: [true]`, `n: 2.0` are 400, as the engine would refuse them). Fields OpenAI defines that change
nothing here (`user`) are accepted. Text must be valid Unicode: a lone surrogate (JSON's `"\\ud800"`) is refused by
name, not handed to a tokenizer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.grammar import Guide
from ..engine.sequence import MAX_LOGPROBS, is_int
from ..errors import InvalidRequest

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate ({text[e.start]!r} at {e.start}), not Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with `choices: []` and the usage (OpenAI's opt-in)


def _guided(json_schema: dict | str | None, regex: str | None, choice: list[str] | None, grammar: str | None,
            json_object: bool = False) -> Guide | None:
    """The one Guide of vLLM's fields (ValueError when several are set)."""
    kinds = [g for g in (
        json_schema is not None and ("json", json_schema if isinstance(json_schema, str) else json.dumps(json_schema)),
        regex is not None and ("regex", regex), choice is not None and ("choice", choice),
        grammar is not None and ("grammar", grammar), json_object and ("json_object", "")) if g]
    if len(kinds) > 1:
        raise ValueError(f"give one of json, regex, choice, grammar and json_object, not {len(kinds)}")
    if not kinds:
        return None
    kind, spec = kinds[0]
    try:
        return Guide.choice(spec) if kind == "choice" else Guide(kind, spec)
    except InvalidRequest as e:
        raise ValueError(str(e)) from None


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        if self.json_schema is not None and self.json_schema.schema_ is None:
            raise ValueError("json_schema.schema is required")
        return self

    def guide(self) -> Guide | None:
        if self.type == "json_object":
            return Guide("json_object")
        if self.type == "json_schema":
            return Guide.json_schema(self.json_schema.schema_)
        return None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object: one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def guide(self) -> Guide | None:
        return _guided(self.json_, self.regex, self.choice, self.grammar, bool(self.json_object))


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default and range
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0  # ranges and meanings: engine.SamplingParams (checked there)
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> [-100, 100]
    # vLLM's extensions (`extra_body` in the openai client)
    top_k: int | None = None  # None, 0 or -1: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guide(self) -> Guide | None:
        """The structured output this request asks for (at most one of the fields), as the engine's Guide."""
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one structured output, not {' and '.join(given)}")
        if self.response_format is not None:
            return self.response_format.guide()
        if self.structured_outputs is not None:
            return self.structured_outputs.guide()
        return _guided(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)

    @model_validator(mode="after")
    def _one_guide(self) -> _Sampling:
        self.guide()
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id (a decimal integer)")
        return value

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets beyond temperature and top_p."""
        return {"frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                "top_k": 0 if self.top_k is None else self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}

    @model_validator(mode="after")
    def _options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A string, a list of token ids, or a batch of either; nothing coerced (`[true]` is not token 1)."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(is_int(t) for t in x)

    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list):
        if ids(value):
            return value
        if all(isinstance(x, str) for x in value):
            return [_unicode(x) for x in value]
        if all(ids(x) for x in value):
            return value
    raise ValueError("must be a string, a list of token ids (ints), a list of strings or a list of token-id lists")


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a batch of either (one choice group per prompt).
    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False  # the prompt's text (and with logprobs its tokens' log-probabilities) before the output
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return _prompt(value)

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing; it is allowed only with echo: true")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(is_int(x) for x in p):
            return [list(p)]
        return list(p)


def _content(value: Any) -> str:
    """A message's content, a string or a list of text parts (`{"type": "text", "text": ...}`), as one string:
    parts joined by newlines. Other part types (image_url, input_audio, ...) are refused by their name."""
    if isinstance(value, str):
        return _unicode(value)
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"part {i} is not a content part (an object with a 'type')")
        if kind != "text":
            raise ValueError(f"part {i} has type {kind!r}; this server takes text parts only")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError(f"part {i}: a text part is exactly {{'type': 'text', 'text': <string>}}")
        texts.append(_unicode(part["text"]))
    return "\n".join(texts)


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str | None:
        return None if value is None else _content(value)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's arguments as an object where they are JSON (the
        templates of Qwen, Hermes and Llama 3 write them with `tojson`), null content as ""."""
        out = self.model_dump(exclude_none=True)
        if self.content is None:  # an assistant's calls alone: "" for templates that join content as text
            out["content"] = ""
        for call in out.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass
        return out


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # calls the grammar makes (required, named) follow the schema either way


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        named = self.named_tool()
        if named is not None and named not in [t.function.name for t in self.tools or ()]:
            raise ValueError(f"tool_choice names the function {named!r}, which is not in tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named": how tools shape this request's output."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"  # OpenAI's default when tools are given


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(request_id: str, model: str, choices: list[dict], use: dict | None, chat: bool,
                    chunk: bool = False) -> dict[str, Any]:
    """A (chat) completion or one streamed chunk of it; chunks carry `usage` only when given one."""
    kind = "chat.completion" if chat else "text_completion"
    body: dict[str, Any] = {"id": request_id, "object": kind + (".chunk" if chunk and chat else ""),
                            "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
