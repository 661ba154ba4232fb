"""`int8kv serve` with no --model serves the packaged SmolLM2: chat through its own template, streamed and not,
equal to the offline engine, with a byte-level BPE tokenizer (multi-byte characters split across tokens)."""

import openai
import pytest

from int8kv.engine import LLM, SamplingParams
from int8kv.server.app import chat_prompt_ids

pytestmark = pytest.mark.slow
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Écris trois mots en français avec des accents, et un emoji."}],
]


def test_packaged_model_chat_streamed_equals_plain_equals_offline(smollm2_server, smollm2):
    server = smollm2_server  # conftest.py: the session's one SmolLM2 server
    model, tokenizer = smollm2
    offline = LLM(model, memory="64MiB", tokenizer=tokenizer)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)
    (served,) = client.models.list().data
    assert served.id == "SmolLM2-135M-Instruct"
    for messages in MESSAGES:
        (want,) = offline.generate([chat_prompt_ids(tokenizer, messages)], SamplingParams(max_tokens=40))
        if messages is MESSAGES[1]:  # the point of this prompt: characters of several bytes in the answer
            assert any(ord(c) > 127 for c in want.text), want.text
        plain = client.chat.completions.create(model=served.id, messages=messages, max_tokens=40, temperature=0)
        assert plain.choices[0].message.content == want.text
        assert plain.usage.completion_tokens == len(want.token_ids)
        pieces = []
        for chunk in client.chat.completions.create(model=served.id, messages=messages, max_tokens=40,
                                                    temperature=0, stream=True):
            pieces += [c.delta.content or "" for c in chunk.choices]
            assert "\ufffd" not in "".join(pieces)  # no half character is ever handed out
        assert "".join(pieces) == want.text
