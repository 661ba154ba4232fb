"""The engine's error contract: refused up front (nothing queued), isolated mid-step (only the failing request),
never poisoned (later calls equal a fresh engine's, no block leaked), and safe from several threads."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import LLM_block_bytes, tiny

from int8kv import KvPoolExhausted, KvStorageFormat
from int8kv.engine import LLM, InvalidEngineConfig, InvalidRequest, SamplingParams, parse_bytes

VOCAB = 96  # tests/test_engine.py SMALL
MAX_POS = 512
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
POISON = 5  # token whose embedding row is NaN in the poisoned model: any step that runs it fails


def poisoned(seed=7):
    model = tiny("llama", seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return model


@pytest.fixture(scope="module")
def model():
    return poisoned()


def engine(model, **kw):
    kw.setdefault("memory", 64 * LLM_block_bytes(model, 4, INT8))
    return LLM(model, kv_format=INT8, block_size=4, **kw)


def assert_idle(llm):
    assert not llm.scheduler.has_work()
    assert llm.cache.num_free_blocks == llm.cache.num_blocks and len(llm.cache.allocator) == 0


def outputs(outs):
    return [(o.token_ids, o.finish_reason, o.error) for o in outs]


GOOD = [[1, 2, 3, 4], list(range(10, 40)), [7]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def fresh_good(model):
    outs = engine(model).generate(GOOD, GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    return outputs(outs)


# -- refused up front -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [[3, 4, 500], [3, VOCAB], [-1], [3.7], [True, 2], ["7"], [], "text without a tokenizer", 17, None,
     [[1, 2]], torch.tensor([1.0, 2.0]), list(range(1, MAX_POS))],
    ids=["500", "vocab", "neg", "float", "bool", "str-id", "empty", "text", "int", "none", "nested",
         "float-tensor", "too-long"],
)
def test_a_bad_prompt_refuses_the_whole_call_and_changes_nothing(model, fresh_good, bad):
    llm = engine(model)
    with pytest.raises(InvalidRequest):
        llm.generate([*GOOD, bad], GREEDY)
    assert_idle(llm)
    assert llm.stats.steps == 0
    assert outputs(llm.generate(GOOD, GREEDY)) == fresh_good


def test_prompt_plus_max_tokens_past_the_positions_is_refused(model):
    llm = engine(model, memory=200 * LLM_block_bytes(model, 4, INT8))
    prompt = list(range(6, 66)) * 8  # 480 tokens: 480 + 32 = 512 fits exactly, 480 + 33 does not
    with pytest.raises(InvalidRequest, match="positions"):
        llm.generate([prompt], SamplingParams(max_tokens=33))
    assert_idle(llm)
    assert len(llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids) == 32


def test_a_pool_too_small_for_a_request_refuses_the_call(model):
    llm = engine(model, memory=2 * LLM_block_bytes(model, 4, INT8))
    with pytest.raises(KvPoolExhausted):
        llm.generate([[1, 2], list(range(1, 10))], SamplingParams(max_tokens=2))
    assert_idle(llm)


class EmptyTokenizer:
    def __call__(self, text):
        return {"input_ids": []}

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_a_tokenizer_returning_nothing_is_refused(model):
    llm = LLM(model, memory="1MiB", tokenizer=EmptyTokenizer())
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate(["hello"])
    assert_idle(llm)


def test_params_must_be_one_or_one_per_prompt(model):
    llm = engine(model)
    with pytest.raises(InvalidRequest):
        llm.generate(GOOD, [GREEDY])
    with pytest.raises(InvalidRequest):
        llm.generate(GOOD, {"max_tokens": 3})
    assert_idle(llm)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(block_size=0), dict(block_size=-4),
     dict(block_size=2.5), dict(max_num_seqs=True), dict(memory="1e400"), dict(memory="-5GiB"), dict(memory="nan"),
     dict(memory="inf"), dict(memory=-1), dict(memory=10**400), dict(memory=float("inf")), dict(memory="lots"),
     dict(memory="1e30"), dict(kv_format="bogus")],
)
def test_bad_engine_settings_are_typed_errors_in_the_constructor(model, kwargs):
    with pytest.raises(InvalidEngineConfig):
        LLM(model, **kwargs)


def test_parse_bytes():
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("8GiB") == 8 << 30 and parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(0) == 0 and parse_bytes("7") == 7 and parse_bytes(2.5e3) == 2500
    for bad in ("1e400", "1e300GiB", "-1", "nan", "inf", "", "5XB", "GiB", float("nan"), -2.0, True, None, [1]):
        with pytest.raises(InvalidEngineConfig):
            parse_bytes(bad)


# -- isolated mid-step --------------------------------------------------------------------------------------
def test_a_request_failing_mid_step_fails_alone(model, fresh_good):
    llm = engine(model, max_num_batched_tokens=16)  # chunked: the bad request shares steps with the good ones
    bad = [9, 8, POISON, 7]
    outs = llm.generate([GOOD[0], bad, GOOD[1], GOOD[2]], GREEDY)
    assert outputs([outs[0], outs[2], outs[3]]) == fresh_good
    assert outs[1].finish_reason == "error" and "NonFiniteError" in outs[1].error and outs[1].token_ids == []
    assert llm.stats.failed_requests == 1
    assert_idle(llm)
    assert outputs(llm.generate(GOOD, GREEDY)) == fresh_good  # never poisoned


def test_rows_written_by_a_failed_step_are_harmless(model, fresh_good):
    """The forward runs to the end (every layer writes its K/V for every item) and only then raises: the
    survivors' retry rewrites their rows, and the culprit's blocks are reused by the next request."""
    llm = engine(model, max_num_batched_tokens=16)
    real = llm.model.forward
    culprit = 61

    def forward_then_fail(cache, batch, all_logits=False):
        logits = real(cache, batch, all_logits=all_logits)
        if bool((batch.input_ids == culprit).any()):
            raise RuntimeError("injected failure after every layer wrote its K/V")
        return logits

    llm.model.forward = forward_then_fail
    outs = llm.generate([GOOD[0], [1, 2, culprit, 3, 4, 6, 7, 8, 9], GOOD[1], GOOD[2]], GREEDY)
    assert outputs([outs[0], outs[2], outs[3]]) == fresh_good
    assert outs[1].finish_reason == "error" and "injected failure" in outs[1].error
    assert_idle(llm)
    assert outputs(llm.generate(GOOD, GREEDY)) == fresh_good


def test_non_finite_logits_fail_only_their_request(model, fresh_good):
    llm = engine(model)
    real = llm.model.forward
    marker = 62  # the last prompt token of the request whose logits are spoiled

    def nan_logits(cache, batch, all_logits=False):
        logits = real(cache, batch, all_logits=all_logits).clone()
        last = batch.input_ids[batch.cu_seqlens_q[1:].long() - 1]
        logits[last == marker] = float("nan")
        return logits

    llm.model.forward = nan_logits
    outs = llm.generate([GOOD[0], [3, 4, marker], GOOD[1], GOOD[2]], [GREEDY, SamplingParams(temperature=1.0, seed=1),
                                                                       GREEDY, GREEDY])
    assert outputs([outs[0], outs[2], outs[3]]) == fresh_good
    assert outs[1].finish_reason == "error" and "NonFiniteError" in outs[1].error
    assert_idle(llm)


def test_an_escaping_exception_leaves_the_engine_usable(model, fresh_good):
    llm = engine(model)

    def interrupt(stats):
        if stats.steps == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD, GREEDY, on_step=interrupt)
    assert_idle(llm)
    assert outputs(llm.generate(GOOD, GREEDY)) == fresh_good


# -- threads ------------------------------------------------------------------------------------------------
def test_two_threads_calling_generate_get_their_own_correct_tokens(model):
    gen = torch.Generator().manual_seed(11)
    work = [[torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)] for _ in range(2)]
    work = [[[t for t in p if t != POISON] for p in prompts] for prompts in work]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [outputs(engine(model).generate(prompts, params)) for prompts in work]
    llm = engine(model, max_num_batched_tokens=32)
    for _ in range(3):
        got: list = [None, None]
        errors: list = []
        barrier = threading.Barrier(2)

        def call(i, got=got, errors=errors, barrier=barrier):
            try:
                barrier.wait()
                got[i] = outputs(llm.generate(work[i], params))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and got == want
        assert_idle(llm)


# -- random mixes -------------------------------------------------------------------------------------------
valid_ids = st.lists(st.integers(1, VOCAB - 1).filter(lambda t: t != POISON), min_size=1, max_size=24)
invalid_ids = st.one_of(
    st.just([]),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5).map(lambda p: [*p, VOCAB + 3]),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5).map(lambda p: [-1, *p]),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5).map(lambda p: [*p, 2.0]),
    st.just(list(range(1, 60)) * 9),  # 531 tokens: past the 512 positions
)
params_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 6),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    top_p=st.sampled_from([1.0, 0.9]),
    ignore_eos=st.booleans(),
    seed=st.integers(0, 2**32),  # always seeded: the same request must sample the same tokens on any engine
)
bad_params = st.sampled_from([
    {"temperature": float("nan")}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 2.0}, {"max_tokens": 0},
    {"max_tokens": 2.5}, {"seed": 2**64}, {"seed": 0.5},
])
request = st.tuples(
    st.sampled_from(["valid", "valid", "poison", "invalid", "bad-params"]), valid_ids, invalid_ids, params_st,
    bad_params,
)

SHARED: dict = {}


@settings(max_examples=12, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=5))
def test_random_request_mixes_never_leak_or_change_valid_outputs(model, requests):
    llm = SHARED.setdefault("llm", engine(model, max_num_seqs=3, max_num_batched_tokens=24))
    prompts, params, kinds = [], [], []
    for kind, ids, bad, p, bad_kwargs in requests:
        if kind == "bad-params":  # refused where it is built, before an engine ever sees it
            with pytest.raises(InvalidRequest):
                SamplingParams(**bad_kwargs)
            continue
        prompts.append(bad if kind == "invalid" else [*ids, POISON] if kind == "poison" else ids)
        params.append(p)
        kinds.append(kind)
    if not prompts:
        return
    if "invalid" in kinds:
        with pytest.raises(InvalidRequest):
            llm.generate(prompts, params)
        assert_idle(llm)
        keep = [i for i, k in enumerate(kinds) if k != "invalid"]
        prompts, params, kinds = [prompts[i] for i in keep], [params[i] for i in keep], [kinds[i] for i in keep]
        if not prompts:
            return
    got = llm.generate(prompts, params)
    assert_idle(llm)
    valid = [i for i, k in enumerate(kinds) if k == "valid"]
    want = engine(model).generate([prompts[i] for i in valid], [params[i] for i in valid])
    assert outputs([got[i] for i in valid]) == outputs(want)
    for out, kind in zip(got, kinds, strict=True):
        assert out.finish_reason == "error" if kind == "poison" else out.finish_reason in ("stop", "length", "error")


def test_integer_tensors_and_numpy_ints_are_accepted_as_token_ids(model, fresh_good):
    import numpy as np

    llm = engine(model)
    prompts = [torch.tensor(GOOD[0]), [np.int64(t) for t in GOOD[1]], tuple(GOOD[2])]
    assert outputs(llm.generate(prompts, GREEDY)) == fresh_good
    assert llm.generate([], GREEDY) == []
    assert_idle(llm)
