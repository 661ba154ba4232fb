"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions (the fields int8kv serves).

Requests are strict: an unknown field is refused (400) rather than silently ignored, so a client never believes
a setting took effect when it did not. Fields OpenAI defines that change nothing here (`user`, penalties at
0, `logprobs` off) are accepted at their neutral values only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = True  # usage always rides in the last chunk; accepted for clients that ask for it


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default and range
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Literal[0, 0.0] = 0
    presence_penalty: Literal[0, 0.0] = 0
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a batch of either (one choice group per prompt).
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: Literal[False] = False
    logprobs: None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Literal[False] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, choices: list[dict], use: dict, chat: bool,
                    chunk: bool = False) -> dict[str, Any]:
    """A (chat) completion or one streamed chunk of it; `use` (usage) may be None in chunks."""
    kind = "chat.completion" if chat else "text_completion"
    body: dict[str, Any] = {"id": request_id, "object": kind + (".chunk" if chunk and chat else ""),
                            "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
