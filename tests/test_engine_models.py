"""The engine on many transformers architectures (the model's own forward over the paged cache).

Tiny random models (hidden 64, 2 layers, 4 query / 2 KV heads, vocab 128; biases and sink logits non-zero; the
output embedding scaled so greedy choices are clear). Each is compared on greedy tokens with continuous
batching and chunked prefill: F16 storage against transformers with its own DynamicCache, INT8 against a
DynamicCache whose K/V went through int8kv's codec (the values the INT8 pool holds), so rounding is not taken
for a bug.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from int8kv import KvStorageFormat, UnsupportedAttention, UnsupportedModel
from int8kv.engine import LLM, SamplingParams
from int8kv.engine.hf_model import TransformersModel
from int8kv.engine.model import DecoderModel

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=None, pad_token_id=0,
              bos_token_id=None)  # fmt: skip
# name -> (model_type, config fields). Windows of 8 tokens on prompts of 14 + 8 generated: the window matters.
ARCHS = {
    "llama": ("llama", {}),  # plain Llama and Qwen3 go through every test of tests/test_engine.py
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-gelu": ("llama", dict(hidden_act="gelu")),
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "gemma2": ("gemma2", dict(sliding_window=8)),  # softcaps, sliding + full layers
    "gemma3_text": ("gemma3_text", dict(sliding_window=8, sliding_window_pattern=2)),  # sliding + full
    "gpt_oss": ("gpt_oss", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),  # sinks
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "llama4_text": ("llama4_text", dict(attention_chunk_size=8)),  # chunked attention
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    model_type, fields = ARCHS[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **fields)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or pname.endswith("sinks"):
                p.copy_(0.5 * torch.randn_like(p))  # transformers initialises them to zero
        model.get_output_embeddings().weight.mul_(10)
    return model


def fake_quant_cache(model, fmt: KvStorageFormat) -> DynamicCache:
    """transformers' own cache for the model (sliding layers included), storing decode(encode(K/V))."""
    cache = DynamicCache(config=model.config)

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        return fmt.spec.decode(fmt.spec.encode(x)).to(x.dtype)

    for layer in cache.layers:
        def update(k, v, *args, _update=layer.update, **kwargs):
            return _update(roundtrip(k), roundtrip(v), *args, **kwargs)

        layer.update = update
    return cache


def hf_greedy(model, prompt: list[int], n: int, cache=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, cache=cache)
    return out[0, len(prompt):].tolist()


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def engine(model, fmt: KvStorageFormat, **kwargs) -> LLM:
    return LLM(model, kv_format=fmt, **{"memory": "1MiB", "block_size": 4, "max_num_batched_tokens": 7, **kwargs})


@pytest.mark.parametrize("name", [name for name in ARCHS if name != "llama"])
def test_engine_generates_like_transformers(name):
    model = build(name)
    batch = prompts(14, 6)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for fmt, cache in ((F16, lambda: None), (INT8, lambda: fake_quant_cache(model, INT8))):
        llm = engine(model, fmt)
        assert isinstance(llm.model, TransformersModel)
        # Blocks are released only when every layer slides; mixed models (Gemma 2/3, gpt-oss) keep them all.
        assert llm.model.window == (8 if name in ("mistral-window", "qwen3-sliding") else None)
        outs = llm.generate(batch, params)  # two sequences side by side, prefill in chunks of 7 tokens
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8, cache()) for p in batch], fmt
        assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert model.config._attn_implementation in ("sdpa", "eager")  # switched only during the engine's forwards


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")])
def test_fused_forward_refuses_what_it_does_not_implement(field, value):
    model = build("llama")
    setattr(model.config, field, value)  # the modules stay Llama's: only the refusal is under test
    with pytest.raises(UnsupportedModel, match=field):
        LLM(model, memory="1MiB", implementation="fused")


def test_fused_forward_refuses_windows_rope_and_foreign_modules():
    with pytest.raises(UnsupportedModel, match="sliding_attention"):
        DecoderModel(build("qwen3-sliding"))
    model = build("llama")
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(UnsupportedModel, match="rope type 'dynamic'"):
        DecoderModel(model)
    with pytest.raises(UnsupportedModel, match="architecture MistralForCausalLM"):
        DecoderModel(build("mistral-window"))


def test_training_mode_with_dropout_is_refused():
    model = build("phi3")  # Phi-3 has residual dropout modules
    model.config.resid_pdrop = 0.1
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    model.train()
    with pytest.raises(UnsupportedModel, match="training mode"):
        LLM(model, memory="1MiB")
    assert model.training


def test_architecture_decides_not_model_type():
    model = build("llama")
    model.config.model_type = "exaone"  # EXAONE checkpoints load as LlamaForCausalLM under their own model_type
    batch = prompts(12)
    want = hf_greedy(model, batch[0], 6)
    for implementation in ("transformers", "fused"):
        llm = LLM(model, kv_format=F16, memory="1MiB", implementation=implementation)
        assert llm.generate(batch, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == want


REFUSED = {
    # K/V changed after cache.update (V reshaped): caught by the probe forward at construction.
    "diffllama": ({}, UnsupportedAttention, "changes K/V after cache.update"),
    # Its own attention on whatever the cache returns.
    "xglm": (dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=2), UnsupportedModel, "attention interface"),
    "deepseek_v3": (dict(n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), UnsupportedAttention, "MLA"),
    "lfm2": (dict(layer_types=["conv", "full_attention"]), UnsupportedModel, "'conv'"),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_models_are_left_as_they_were(model_type):
    fields, error, message = REFUSED[model_type]
    common = {k: v for k, v in COMMON.items() if k != "head_dim"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**common, **fields})).eval()
    ids = torch.randint(1, VOCAB, (1, 10))
    attn = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(error, match=message):
        LLM(model, kv_format=F16, memory="1MiB", prefix_caching=False)
    assert model.config._attn_implementation == attn
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def _referenced_blocks(llm) -> int:
    return llm.cache.num_blocks - llm.cache.num_free_blocks  # cached (keyed, unreferenced) blocks count as free


@pytest.mark.parametrize("fmt", [F16, INT8])
def test_sliding_only_model_holds_blocks_for_its_window_only(fmt):
    name = "mistral-window"  # window 8, blocks of 4 tokens
    model = build(name, seed=3)
    prompt = prompts(10, seed=4)[0]
    want = hf_greedy(model, prompt, 40, None if fmt is F16 else fake_quant_cache(model, fmt))
    llm = engine(model, fmt, max_num_batched_tokens=64)
    used = []
    out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True),
                       on_step=lambda s: used.append(_referenced_blocks(llm)))  # fmt: skip
    assert out[0].token_ids == want
    # Query p sees keys p - 7 .. p: 8 positions, in at most 3 blocks of 4 tokens, held from the prefill on however
    # long the sequence runs (50 tokens without the release: 13 blocks).
    assert max(used) == 3
    assert llm.stats.peak_blocks_used == 3  # the step's peak, counted after its reservation
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_sliding_release_with_preemption_prefix_hits_and_forks():
    name = "mistral-window"
    model = build(name, seed=5)
    shared = prompts(22, seed=6)[0]
    batch = [shared, shared[:17] + [3, 4, 5], shared, prompts(13, seed=7)[0]]
    want = [hf_greedy(model, p, 14) for p in batch]
    per_block = 4 * F16.bytes_per_token(2, 2, 16)
    # 9 blocks (a request is admitted only if its whole length would fit: 9) for four sequences of 3-4 blocks each
    # at once: admission waits and a prefill chunk preempts.
    llm = engine(model, F16, memory=9 * per_block, max_num_seqs=4, max_num_batched_tokens=8)
    outs = llm.generate(batch, SamplingParams(max_tokens=14, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert llm.stats.preemptions > 0 and llm.stats.prefix_hit_tokens > 0
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    # In a pool with room to spare, a prompt's released head blocks stay cached: the same prompt again hits the
    # whole chain (5 full blocks of its 22 tokens, one token left to compute) and gives the same tokens.
    llm = engine(model, F16, memory=32 * per_block)
    for hits in (0, 20):
        assert llm.generate([shared], SamplingParams(max_tokens=14, ignore_eos=True))[0].token_ids == want[0]
        assert llm.stats.prefix_hit_tokens == hits
    # Forked choices share the prompt's blocks (refcounts) and release them as each moves on.
    ids = llm.add_forked_request(shared, SamplingParams(max_tokens=14, ignore_eos=True), n=3)
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while llm.has_unfinished():
        llm.step()
        for u in llm.pop_updates():
            tokens[u.request_id] += u.new_token_ids
    assert list(tokens.values()) == [want[0]] * 3  # greedy: every choice is the request's own output
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert all(llm.cache.allocator.refcount(b) == 0 for b in range(llm.cache.num_blocks))


def test_sliding_release_keeps_the_block_store_whole(tmp_path):
    """Blocks go to the store when they fill, before the window leaves them: a fresh engine loads them intact."""
    model = build("mistral-window", seed=8)
    prompt = prompts(26, seed=9)[0]
    want = hf_greedy(model, prompt, 6)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = []
    for _ in range(2):  # two engines, one store directory
        with engine(model, F16, kv_store=f"disk:{tmp_path}") as llm:
            outs.append(llm.generate([prompt], params)[0].token_ids)
            assert llm.flush_kv_store(5.0)
    assert outs == [want, want]
    assert llm.stats.store_hit_tokens == 24  # 6 full blocks of the 26-token prompt, one token left to compute
