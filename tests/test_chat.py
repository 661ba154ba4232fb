"""LLM.chat and the one chat-template function it shares with the server and the demo."""

import pytest
from server_helpers import make_tiny_model

from int8kv.engine import LLM, InvalidRequest, SamplingParams
from int8kv.engine.chat import chat_prompt_ids
from int8kv.models import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tokenizer = load_model(make_tiny_model(tmp_path_factory.mktemp("chat") / "m"), quiet=True)
    return model, tokenizer


def test_chat_applies_the_template_and_matches_generate(tiny):
    model, tokenizer = tiny
    llm = LLM(model, memory="8MiB", tokenizer=tokenizer)
    talk = [{"role": "system", "content": "the good water"}, {"role": "user", "content": "what is hot"}]
    ids = chat_prompt_ids(tokenizer, talk)
    # the template's own rendering, tokenized: roles as markers, then the assistant's turn opened
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|system|>", "the", "good", "water", "<|user|>", "what", "is", "hot", "<|assistant|>"]
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=7)
    (one,) = llm.chat(talk, params)
    (want,) = llm.generate([ids], params)
    assert one.prompt_token_ids == ids and one.token_ids == want.token_ids and len(one.token_ids) == 5
    other = [{"role": "user", "content": "make the water"}]
    both = llm.chat([talk, other], SamplingParams(max_tokens=3))
    assert [o.prompt_token_ids for o in both] == [ids, chat_prompt_ids(tokenizer, other)]


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ({"role": "user", "content": "x"}, "non-empty list"),
    ([{"role": "user"}], "message 0"),
    ([{"role": "user", "content": 3}], "message 0"),
    ([[{"role": "user", "content": "x"}], ["not a message"]], "message 0"),
])
def test_bad_conversations_are_refused_and_nothing_is_queued(tiny, messages, message):
    model, tokenizer = tiny
    llm = LLM(model, memory="8MiB", tokenizer=tokenizer)
    with pytest.raises(InvalidRequest, match=message):
        llm.chat(messages, SamplingParams(max_tokens=2))
    assert not llm.has_unfinished() and llm.stats.steps == 0


def test_a_tokenizer_without_a_chat_template_is_refused(tiny):
    model, tokenizer = tiny
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(InvalidRequest, match="no chat template"):
            LLM(model, memory="8MiB", tokenizer=tokenizer).chat([{"role": "user", "content": "hi"}])
    finally:
        tokenizer.chat_template = template
