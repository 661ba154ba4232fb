import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from int8kv import KvPoolExhausted, KvStorageFormat
from int8kv.engine import LLM, SamplingParams, parse_bytes

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=0,
)


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_theta=10000.0, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, rope_theta=10000.0, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights, so QK-norm and the RMSNorms are really exercised
                p.copy_(1 + 0.3 * torch.randn_like(p))
        # Sharp output distributions: greedy choices then do not hinge on float rounding.
        model.lm_head.weight.mul_(30)
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk, implementation", [(256, "transformers"), (50, "transformers"), (7, "transformers"),
                                                   (50, "fused")])
def test_teacher_forced_logits_match_transformers(kind, chunk, implementation):
    model = tiny(kind)
    ids = torch.randint(1, SMALL["vocab_size"], (256,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(model, ids)
    scale = ref.abs().max()
    for fmt, tol in ((F16, 2e-3), (INT8, 3e-2)):
        llm = LLM(model, kv_format=fmt, memory="4MiB", block_size=16, implementation=implementation)
        got = llm.score(ids, chunk_size=chunk).double()
        err = (got - ref).abs().max() / scale
        # F16 K/V storage adds ~2^-11 relative error per element; INT8 up to 1/254 of each row's max.
        assert err < tol, f"{fmt}: relative logit error {err:.2e}"
        assert llm.cache.num_free_blocks == llm.cache.num_blocks  # score frees its sequence


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("implementation", ["transformers", "fused"])
def test_continuous_batching_matches_one_by_one_generation(kind, implementation):
    model = tiny(kind, seed=1)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (3, 40, 17, 90, 1, 33)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [hf_greedy(model, p, 12) for p in prompts]
    # 48 blocks of 4 tokens cannot hold all six requests at once: admission waits and decode preempts.
    llm = LLM(model, kv_format=F16, memory=48 * LLM_block_bytes(model, 4, F16), block_size=4,
              max_num_seqs=4, max_num_batched_tokens=32, implementation=implementation)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert llm.stats.preemptions > 0
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def LLM_block_bytes(model, block_size, fmt):
    c = model.config
    return block_size * fmt.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)


def test_int8_engine_generates_like_transformers_on_sharp_model():
    model = tiny("llama", seed=2)
    prompts = [[5, 9, 11, 2], list(range(1, 60))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = LLM(model, kv_format=INT8, memory="2MiB").generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 10)


def test_sampling_is_seeded_and_respects_top_p():
    model = tiny("llama", seed=3)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    a = LLM(model, kv_format=INT8, memory="2MiB").generate([[1, 2, 3]], params)[0].token_ids
    b = LLM(model, kv_format=INT8, memory="2MiB").generate([[1, 2, 3]], params)[0].token_ids
    assert a == b and len(a) == 8


def test_eos_stops_generation():
    model = tiny("llama", seed=4)
    first = hf_greedy(model, [7, 8, 9], 1)[0]
    llm = LLM(model, kv_format=F16, memory="2MiB")
    llm.eos_token_id = first
    assert llm.generate([[7, 8, 9]], SamplingParams(max_tokens=5))[0].token_ids == [first]


def test_budget_errors():
    model = tiny("llama")
    with pytest.raises(KvPoolExhausted, match="holds no block"):
        LLM(model, memory="1KiB")
    llm = LLM(model, memory=LLM_block_bytes(model, 16, INT8) * 2)
    with pytest.raises(KvPoolExhausted, match="needs 3 blocks"):
        llm.generate([[1, 2, 3], list(range(1, 40))], SamplingParams(max_tokens=4))
    assert not llm.scheduler.has_work()  # the request that fits was not queued either
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("8GiB") == 8 << 30


@pytest.mark.slow
def test_smollm2_engine_logits_and_text(smollm2):
    model, tokenizer = smollm2
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = tokenizer(text)["input_ids"][:256]
    ref = hf_logits(model, ids)
    llm = LLM(model, kv_format=F16, memory="64MiB", tokenizer=tokenizer)
    got = llm.score(ids, chunk_size=64).double()
    # F16 storage rounds every K/V element to 11 significant bits; over 30 layers that moves the logits by
    # ~1e-3 of their range (measured 1.3e-3, max abs 0.05), and the argmax token essentially never.
    assert (got - ref).abs().max() / ref.abs().max() < 5e-3
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.99
    prompt = tokenizer("The capital of France is")["input_ids"]
    want = hf_greedy(model, prompt, 8)
    for fmt, implementation in ((F16, "transformers"), (INT8, "transformers"), (INT8, "fused")):
        out = LLM(model, kv_format=fmt, memory="64MiB", tokenizer=tokenizer, implementation=implementation).generate(
            [prompt], SamplingParams(max_tokens=8)
        )[0]
        assert out.token_ids == want and "Paris" in out.text


# Counters of four runs whose schedules are derived by hand (block size 4, prompts of known length, greedy,
# ignore_eos). "phase" = steps that decode the whole batch (Scheduler.in_decode_phase).
COUNTER_RUNS = {
    # One step prefills all 17 prompt tokens and samples 3 tokens; 3 decode steps of 3 tokens follow.
    "unchunked": (dict(max_num_batched_tokens=512), [5, 9, 3], 4,
                  dict(steps=4, prefill_tokens=17, decode_tokens=9, generated_tokens=12, preemptions=0,
                       decode_phase_steps=3, decode_phase_tokens=9, peak_blocks_used=7)),
    # 8-token budget: A5+B3 | A1 B6 C1 | A1 B1 C2 | A1 B1 C1 (the whole batch decodes; A done) | B1 C1 | C1.
    "chunked": (dict(max_num_batched_tokens=8), [5, 9, 3], 4,
                dict(steps=6, prefill_tokens=17, decode_tokens=9, generated_tokens=12, preemptions=0,
                     decode_phase_steps=1, decode_phase_tokens=3, peak_blocks_used=6)),
    # Two seats: A and B run 4 steps while C waits, then C prefills and decodes 3 times alone: the whole
    # batch of three never decodes together.
    "seats": (dict(max_num_seqs=2), [5, 9, 3], 4,
              dict(steps=8, prefill_tokens=17, decode_tokens=9, generated_tokens=12, preemptions=0,
                   decode_phase_steps=0, decode_phase_tokens=0, peak_blocks_used=5)),
    # A pool of 3 blocks: step 2 preempts B; A decodes alone (B waits) until done at step 8; step 9
    # recomputes B's 4 prompt + 1 generated tokens; B then decodes 6 times alone.
    # (Without prefix caching: B recomputes its blocks.)
    "preempted": (dict(blocks=3, prefix_caching=False), [4, 4], 8,
                  dict(steps=15, prefill_tokens=13, decode_tokens=13, generated_tokens=16, preemptions=1,
                       decode_phase_steps=0, decode_phase_tokens=0, peak_blocks_used=3)),
    # The same with prefix caching (A's and B's tokens are equal: same prompt, greedy): step 2 preempts B and
    # readmits it at once on A's first block, so it recomputes only its generated token (a decode); A and B
    # decode together through step 5; step 6 preempts B again; A finishes at step 8; step 9 readmits B on A's
    # first two blocks, 1 token computed; B decodes alone to step 11.
    "preempted, prefix cached": (dict(blocks=3), [4, 4], 8,
                                 dict(steps=11, prefill_tokens=8, decode_tokens=14, generated_tokens=16,
                                      preemptions=2, decode_phase_steps=4, decode_phase_tokens=8,
                                      peak_blocks_used=3, prefix_hit_tokens=12)),
}


@pytest.mark.parametrize("name", list(COUNTER_RUNS))
def test_engine_stats_count_exactly_the_tokens_of_a_known_schedule(name):
    opts, lengths, max_tokens, want = COUNTER_RUNS[name]
    opts = dict(opts)
    model = tiny("llama", seed=6)
    blocks = opts.pop("blocks", 64)
    llm = LLM(model, kv_format=F16, memory=blocks * LLM_block_bytes(model, 4, F16), block_size=4, **opts)
    prompts = [list(range(1, n + 1)) for n in lengths]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [max_tokens] * len(prompts)
    s = llm.stats
    assert {k: getattr(s, k) for k in want} == want
    assert s.failed_requests == 0 and 0 <= s.decode_phase_seconds <= s.seconds
    assert (s.decode_phase_seconds > 0) == (s.decode_phase_steps > 0)
    if s.decode_phase_steps:
        assert s.decode_tokens_per_s == s.decode_phase_tokens / s.decode_phase_seconds
    else:
        assert s.decode_tokens_per_s == 0.0
    # The engine's own run equals what it hands back: every generated token reached a request.
    assert s.generated_tokens == sum(len(o.token_ids) for o in outs)


def test_runner_block_tables_follow_the_allocator_through_preemption():
    model = tiny("llama", seed=1)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (30, 7, 45, 12, 26)]
    llm = LLM(model, kv_format=F16, memory=30 * LLM_block_bytes(model, 4, F16), block_size=4,
              max_num_seqs=4, max_num_batched_tokens=20)
    checked = []

    def compare(stats):
        for seq in llm.scheduler.running:  # every running sequence was in the step just run
            assert seq.block_table[: seq.num_table_blocks].tolist() == llm.cache.block_table(seq.seq_id)
            checked.append(seq.seq_id)

    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), on_step=compare)
    assert llm.stats.preemptions > 0 and len(checked) > 20
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 10) for p in prompts]
