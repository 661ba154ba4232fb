"""Structured outputs in the engine, on the packaged SmolLM2: every sampled output follows its JSON schema, regex or
choices, through forked choices (n), preemption and prefix-cache hits; a bad spec is refused before anything is
queued; the mask is the grammar's own."""

import json
import re

import jsonschema
import pytest
import torch

from int8kv.engine import LLM, Guide, InvalidRequest, SamplingParams
from int8kv.engine.chat import chat_prompt_ids

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo"]}}}


@pytest.fixture(scope="module")
def ask(smollm2):
    _, tokenizer = smollm2
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": "Describe a person as JSON: name, age, city."}])


def test_sampled_json_follows_its_schema_through_forks_preemption_and_prefix_hits(smollm2, ask):
    model, tokenizer = smollm2
    # 4 MiB (20 blocks): 8 sequences of ~90 tokens (6 blocks each) do not all fit, so some are preempted and
    # recomputed mid-output; the group of 4 forks (18 blocks) fits alone
    llm = LLM(model, memory="4MiB", tokenizer=tokenizer, max_num_seqs=8)
    guide = Guide.json_schema(PERSON)
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, guide=guide) for s in range(8)]
    first = llm.generate([ask] * 8, params)
    forks = llm.add_forked_request(ask, SamplingParams(max_tokens=48, temperature=1.0, seed=100, guide=guide), n=4)
    while llm.has_unfinished():
        llm.step()
    forked = {u.request_id: u for u in llm.pop_updates()}
    texts = [o.text for o in first] + [tokenizer.decode(forked[i].new_token_ids, skip_special_tokens=True)
                                       for i in forks]
    assert llm.stats.preemptions > 0 and llm.stats.prefix_hit_tokens > 0
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 3  # sampled, not one answer
    assert all(o.finish_reason == "stop" for o in first)
    # the same seeds on a roomy pool (no preemption): the same outputs
    again = LLM(model, memory="64MiB", tokenizer=tokenizer, max_num_seqs=8).generate([ask] * 8, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_regex_choice_grammar_and_json_object(smollm2, ask):
    model, tokenizer = smollm2
    llm = LLM(model, memory="16MiB", tokenizer=tokenizer)
    cases = [
        (Guide("regex", r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (Guide.choice(["yes", "no", 'maybe "so"\\ é']), lambda t: t in ("yes", "no", 'maybe "so"\\ é')),
        (Guide("grammar", 'root ::= "The answer is " [0-9]+ "."'), lambda t: re.fullmatch(r"The answer is \d+\.", t)),
    ]
    for guide, holds in cases:
        outs = llm.generate([ask] * 4, [SamplingParams(max_tokens=40, temperature=1.0, seed=s, guide=guide)
                                        for s in range(4)])
        for o in outs:
            assert o.finish_reason == "stop" and holds(o.text), (guide, o.text)
    # any JSON object: sampled keys and strings may run past max_tokens; those that end are objects
    outs = llm.generate([ask] * 4, [SamplingParams(max_tokens=60, temperature=0.5, seed=s, guide=Guide("json_object"))
                                    for s in range(4)])
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(o.text), dict) for o in ended)
    assert all(o.text.startswith("{") for o in outs)


@pytest.mark.parametrize(("guide", "message"), [
    (Guide("json", '{"type": "nonsense"}'), "invalid JSON schema: Unsupported type"),
    (Guide("json", "[1, 2]"), "invalid JSON schema: a JSON schema is an object"),
    (Guide("json", "{not json"), "invalid JSON schema"),
    (Guide("regex", "(unclosed"), "invalid regular expression"),
    (Guide("grammar", "root ::= "), "invalid grammar"),
])
def test_a_bad_spec_is_refused_before_anything_is_queued(smollm2, ask, guide, message):
    model, tokenizer = smollm2
    llm = LLM(model, memory="16MiB", tokenizer=tokenizer)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        llm.add_request(ask, SamplingParams(max_tokens=4, guide=guide))
    assert not llm.has_unfinished() and llm.cache.num_free_blocks == llm.cache.num_blocks


def test_the_mask_is_the_grammars_own_next_tokens(smollm2):
    """Grammars.mask keeps a token exactly when the grammar accepts it next (checked one token at a time on a
    fresh matcher), leaves an unconstrained row alone, and reports a row no token can continue."""
    model, tokenizer = smollm2
    llm = LLM(model, memory="16MiB", tokenizer=tokenizer)
    grammars = llm.grammars
    matcher = grammars.matcher(Guide.choice(["yes", "no"]))
    logits = torch.randn(2, llm.vocab_size, generator=torch.Generator().manual_seed(0))
    masked, dead = grammars.mask(logits, [matcher, None])
    assert dead == [] and torch.equal(masked[1], logits[1])
    kept = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert kept and torch.equal(masked[0, kept], logits[0, kept])
    sample = set(torch.randperm(llm.vocab_size, generator=torch.Generator().manual_seed(1))[:3000].tolist())
    for token in sorted(sample | set(kept)):  # every kept token, and a random 3,000 of the rest
        probe = grammars.matcher(Guide.choice(["yes", "no"]))
        assert probe.accept_token(token) == (token in kept), token
    # a grammar ending in a character this vocabulary cannot write: no token continues it
    finished = grammars.matcher(Guide("regex", "yes"))
    for token in tokenizer("yes", add_special_tokens=False)["input_ids"]:
        assert finished.accept_token(token)
    assert finished.accept_token(llm.eos_ids[0]) and finished.is_terminated()
