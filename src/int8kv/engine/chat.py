"""A conversation's prompt: its messages through the tokenizer's chat template, ready for the assistant's
turn. One place for `LLM.chat`, the server's chat completions and the demo."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequest


def chat_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
              tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text of ``messages`` (``[{"role": "user", "content": "..."}, ...]``, contents as text) through
    ``tokenizer``'s chat template, with the assistant's turn opened unless ``add_generation_prompt`` is False.
    ``tools``: OpenAI-style function definitions the template renders (``apply_chat_template(tools=...)``); an
    assistant message may carry ``tool_calls`` instead of text. InvalidRequest for a tokenizer without a chat
    template or messages that are not a non-empty list of such mappings."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model's tokenizer has no chat template; send a plain prompt instead")
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequest("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
    for i, m in enumerate(messages):
        calls = isinstance(m, Mapping) and m.get("role") == "assistant" and m.get("tool_calls")
        text = isinstance(m, Mapping) and (isinstance(m.get("content"), str) or (calls and m.get("content") is None))
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not text:
            raise InvalidRequest(f"message {i} must be a mapping with a str 'role' and a str 'content', got {m!r}")
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except (TemplateError, TypeError) as e:  # its own refusal (raise_exception), or e.g. text + a missing value
        raise InvalidRequest(f"the chat template refused the conversation: {e}") from None


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The token ids of :func:`chat_text` (what ``apply_chat_template(..., tokenize=True)`` gives: the template
    writes its special tokens itself, so none are added)."""
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"])
