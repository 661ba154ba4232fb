"""The engine on many transformers architectures (the model's own forward over the paged cache), hybrids with
linear-attention / Mamba / conv layers included (one forward per sequence, each through its own state).

Tiny random models (hidden 64, 2 layers, 4 query / 2 KV heads, vocab 128; biases and sink logits non-zero; the
output embedding scaled so greedy choices are clear). Each is compared on greedy tokens with continuous
batching and chunked prefill: F16 storage against transformers with its own DynamicCache, INT8 against a
DynamicCache whose K/V went through int8kv's codec (the values the INT8 pool holds), so rounding is not taken
for a bug.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from int8kv import KvCacheError, KvStorageFormat, ShapeMismatch, UnsupportedAttention, UnsupportedModel
from int8kv.cache.state import KvLayout
from int8kv.engine import LLM, SamplingParams
from int8kv.engine.hf_model import TransformersModel
from int8kv.engine.model import DecoderModel

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=None, pad_token_id=0,
              bos_token_id=None)  # fmt: skip
GEMMA4 = dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8, global_head_dim=32,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)  # fmt: skip
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
    # Chunked attention on three layers of four (a table each: a chunk bounds storage like a window), one full.
    "llama4_text": ("llama4_text", dict(attention_chunk_size=8, num_hidden_layers=4)),
    # Without transformers' _supports_attention_backend flag: the probe's packed step shows they serve packed rows
    # (StableLM: partial rotary, per-head QK layer norms; BioGPT: learned absolute positions, 4 KV heads).
    "stablelm": ("stablelm", dict(qk_layernorm=True, use_qkv_bias=True)),
    "biogpt": ("biogpt", {}),
    # Per-layer K/V shapes: head_dim 16 on the sliding layers, 32 on the full ones (one pool each), interleaved.
    "gemma4_text": ("gemma4_text", dict(GEMMA4, num_hidden_layers=4)),
}
# Falcon's attention goes through transformers' attention interface from transformers 5.25 on (K/V from
# cache.update, the mask from masking_utils); before, its own attention code adds the mask itself, and the engine
# refuses it by name (REFUSED). Untied embeddings: tied, the output scaling below scales the input embeddings too
# and every step repeated the prompt's last token (both layouts, F16 and INT8), which would prove nothing.
FALCON_THROUGH_INTERFACE = Version(transformers.__version__).release >= (5, 25)
if FALCON_THROUGH_INTERFACE:
    ARCHS["falcon"] = ("falcon", dict(tie_word_embeddings=False))  # multi-query (Falcon-7B): one K/V head
    ARCHS["falcon-gqa"] = ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False))

# Block tables per model (one window per table group; None: full attention). Gemma 2 and gpt-oss alternate sliding and
# full layers, Gemma 3's pattern 2 does too; Gemma 4's two K/V shapes stay on one table.
WINDOWS = {"qwen3-sliding": (8,), "mistral-window": (8,), "gemma2": (8, None), "gemma3_text": (8, None),
           "gpt_oss": (8, None), "llama4_text": (8, 8, 8, None)}  # fmt: skip


def build(name: str, seed: int = 0, arch: tuple[str, dict] | None = None) -> torch.nn.Module:
    """The tiny model of ``ARCHS[name]`` (or of ``arch``: model_type and config fields)."""
    model_type, fields = ARCHS[name] if arch is None else arch
    common = COMMON
    if isinstance(getattr(CONFIG_MAPPING[model_type], "head_dim", None), property):
        common = {k: v for k, v in COMMON.items() if k != "head_dim"}  # derived (Falcon: hidden / heads, 16 here)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**common, **fields})).eval()
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
        if not hasattr(layer, "update"):
            continue  # a linear-attention / Mamba / conv state layer: no K/V
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
        # A block table per table group: sliding tables give blocks back past the window, full ones keep them all.
        assert llm.model.windows == WINDOWS.get(name, (None,))
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


def test_the_default_path_is_the_fused_forward_only_where_it_runs_the_model_exactly():
    assert isinstance(LLM(build("llama"), memory="1MiB").model, DecoderModel)
    assert isinstance(LLM(build("llama"), memory="1MiB", implementation="transformers").model, TransformersModel)
    assert isinstance(LLM(build("phi3"), memory="1MiB").model, TransformersModel)  # not an architecture it runs
    # A forward replaced on an instance or a class is code the fused forward would not run: the model's own path
    # serves it, and asking for the fused forward is refused by name.
    model = build("llama")
    rotary = model.model.rotary_emb
    rotary.forward = rotary.forward
    assert isinstance(LLM(model, memory="1MiB").model, TransformersModel)
    with pytest.raises(UnsupportedModel, match="model.rotary_emb has a forward of its own instance"):
        LLM(model, memory="1MiB", implementation="fused")
    model = build("llama")
    patched = type("PatchedMLP", (type(model.model.layers[0].mlp),), {"forward": lambda self, x: x})
    patched.__name__ = type(model.model.layers[0].mlp).__name__  # the class name check alone would pass it
    model.model.layers[1].mlp.__class__ = patched
    with pytest.raises(UnsupportedModel, match="model.layers.1.mlp's forward comes from test_engine_models"):
        LLM(model, memory="1MiB", implementation="fused")
    assert isinstance(LLM(model, memory="1MiB").model, TransformersModel)


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


# name -> (model_type, config fields, error, message).
REFUSED = {
    # K/V changed after cache.update (V reshaped): caught by the probe forward at construction.
    "diffllama": ("diffllama", {}, UnsupportedAttention, "changes K/V after cache.update"),
    # Its own attention on whatever the cache returns: the probe forward sees no call of the attention interface.
    "xglm": ("xglm", dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=2), UnsupportedAttention,
             "called transformers' attention interface 0 time"),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
                    UnsupportedAttention, "MLA"),
    # ALiBi: from transformers 5.25 on Falcon adds the biases to the mask it passes the attention interface, which
    # the engine's attention does not read; refused from the config before any forward, on every version.
    "falcon-alibi": ("falcon", dict(alibi=True), UnsupportedAttention, "ALiBi"),
}  # fmt: skip
if not FALCON_THROUGH_INTERFACE:
    # Its attention code adds the mask itself, which the interface does not give: its forward fails in the probe.
    REFUSED["falcon"] = ("falcon", {}, UnsupportedModel,
                         "fails when its attention goes through transformers' attention interface")  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_models_are_left_as_they_were(name):
    model_type, fields, error, message = REFUSED[name]
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


def forked_tokens(llm, prompt: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    """The tokens of each of `n` forked choices of `prompt`, stepped to the end."""
    ids = llm.add_forked_request(prompt, params, n=n)
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while llm.has_unfinished():
        llm.step()
        for u in llm.pop_updates():
            tokens[u.request_id] += u.new_token_ids
    return list(tokens.values())


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


# Hybrids: attention layers beside linear-attention (Qwen3-Next), Mamba (Bamba, Jamba, Nemotron-H with an MLP-only
# layer, Zamba2 with a "hybrid" layer holding both), conv (LFM3) or RG-LRU layers (RecurrentGemma, whose state lives
# on its modules). Jamba's and RecurrentGemma's multi-token forwards cannot continue a state: their later chunks
# go one token per forward.
HYBRIDS = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, mamba_d_state=8),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8,
                   chunk_size=8),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3, mamba_num_heads=4,
                       mamba_head_dim=32, ssm_state_size=16, chunk_size=8, n_groups=1),
}  # fmt: skip


def build_hybrid(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **HYBRIDS[model_type]})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # transformers' init (std 0.02) leaves the state layers' contribution near zero; at std 1.5 / sqrt(fan_in)
        # a wrong state changes the tokens (checked: a fresh state per forward, or a fork sharing its parent's
        # state, fails these tests).
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Conv1d):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn_like(module.weight) * 1.5 / fan_in**0.5)
        model.get_output_embeddings().weight.mul_(10)
    return model


def assert_idle(llm) -> None:
    """Nothing left behind: every block back in the pool, no sequence's state kept."""
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert len(llm.model.states) == 0


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_hybrid_engine_generates_like_transformers(model_type):
    model = build_hybrid(model_type)
    batch = prompts(12, 5)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for fmt, cache in ((F16, lambda: None), (INT8, lambda: fake_quant_cache(model, INT8))):
        llm = engine(model, fmt)  # two sequences side by side, prefill in chunks of 7 tokens
        assert llm.scheduler.hasher is None  # prefix caching is off for a model with state layers
        assert llm.model.num_layers == len(llm.model.kv_layers) < model.config.num_hidden_layers  # K/V layers only
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 5, cache()) for p in batch], fmt
        assert_idle(llm)
    assert model.config._attn_implementation in ("sdpa", "eager")  # switched only during the engine's forwards


@pytest.mark.parametrize("model_type", ["lfm3", "recurrent_gemma"])
def test_hybrid_forks_and_preemption(model_type):
    """Forked choices continue from copies of the prompt's state; a preempted sequence rebuilds its state from its
    first token (cache-held conv state, and RecurrentGemma's module-held state)."""
    model = build_hybrid(model_type, seed=2)
    shared = prompts(10, seed=3)[0]
    batch = [shared, prompts(13, seed=4)[0], shared[:6]]
    want = [hf_greedy(model, p, 10) for p in batch]
    per_block = 4 * F16.bytes_per_token(1, 2, 16)  # one K/V layer
    # 8 blocks for three sequences of 4-6 blocks each at once: admission waits and growth preempts.
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    llm = engine(model, F16, memory=8 * per_block, max_num_seqs=3)
    outs = llm.generate(batch, params)
    assert [o.token_ids for o in outs] == want
    assert llm.stats.preemptions > 0
    assert_idle(llm)
    llm = engine(model, F16, memory=32 * per_block)
    ids = llm.add_forked_request(shared, params, n=3)
    logprobs: dict[int, list[float]] = {i: [] for i in ids}
    while llm.has_unfinished():
        llm.step()
        assert len(llm.model.states) <= 3
        for u in llm.pop_updates():
            logprobs[u.request_id] += [lp.top[1][1] for lp in u.new_logprobs]
    # Each choice's runner-up log-probabilities (the chosen tokens' are ~0: peaked logits) are those of the prompt
    # run alone (a fork sharing its parent's state, not a copy, would advance it three times a step and move them).
    alone = torch.tensor([lp.top[1][1] for lp in outs[0].logprobs])
    for got in logprobs.values():
        assert torch.allclose(torch.tensor(got), alone, rtol=1e-4)
    assert_idle(llm)


def test_hybrid_score_continues_the_state_across_chunks():
    model = build_hybrid("recurrent_gemma", seed=5)
    ids = prompts(13, seed=6)[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    llm = engine(model, F16)
    got = llm.score(ids, chunk_size=5)  # chunks after the first run one token per forward
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-2 * want.abs().max()
    assert_idle(llm)


def test_hybrid_prefix_caching_is_off_by_default_and_refused_when_asked(tmp_path, caplog):
    model = build_hybrid("qwen3_next")
    with caplog.at_level("INFO", logger="int8kv.engine"):
        llm = LLM(model, memory="1MiB")
    assert llm.scheduler.hasher is None and llm.kv_store is None
    assert "prefix caching is off" in caplog.text and "linear_attention" in caplog.text
    for kwargs, what in ((dict(prefix_caching=True), "prefix_caching=True"),
                         (dict(kv_store=f"disk:{tmp_path}"), "kv_store")):  # fmt: skip
        with pytest.raises(UnsupportedModel, match=what):
            LLM(model, memory="1MiB", **kwargs)
    assert list(tmp_path.iterdir()) == []  # refused before the store was opened
    assert model.config._attn_implementation in ("sdpa", "eager")


def test_model_state_outside_the_cache_is_refused(monkeypatch):
    """A model whose state layers keep nothing in the cache (state on modules the engine does not know of) would
    share one state between all sequences: refused by the probe forward."""
    import int8kv.engine.hf_model as hf_model

    monkeypatch.setattr(hf_model, "STATE_MODULES", {})
    with pytest.raises(UnsupportedModel, match="kept no state in the cache"):
        LLM(build_hybrid("recurrent_gemma"), memory="1MiB")


@pytest.mark.parametrize("model_type", ["jamba", "recurrent_gemma"])
def test_chunks_that_restart_the_state_are_found_by_the_probe(monkeypatch, model_type):
    """With STATE_MODULES claiming their multi-token forwards continue a state, the probe still finds that a
    later 3-token chunk differs from its tokens fed one per forward, and later chunks run one token per forward:
    greedy tokens with chunked prefill equal to transformers'. Models whose chunks do continue keep them whole."""
    import int8kv.engine.hf_model as hf_model

    for name, (paths, _) in list(hf_model.STATE_MODULES.items()):
        monkeypatch.setitem(hf_model.STATE_MODULES, name, (paths, True))
    model = build_hybrid(model_type)
    llm = engine(model, F16)  # prefill in chunks of 7 tokens
    assert llm.model.states.continues_chunks is False
    batch = prompts(12, 5)
    outs = llm.generate(batch, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 5) for p in batch]
    assert_idle(llm)
    assert engine(build_hybrid("lfm3"), F16).model.states.continues_chunks is True


def test_kv_sharing_is_refused():
    from int8kv.engine.hf_model import engine_layer_specs

    config = AutoConfig.for_model("gemma3n_text", **{**COMMON, "num_hidden_layers": 4, "num_kv_shared_layers": 2})
    with pytest.raises(UnsupportedModel, match="layer 2 reuses another layer's K/V"):
        engine_layer_specs(config)  # what TransformersModel checks first, before the model is touched


def test_hybrid_model_behind_the_server(tmp_path):
    """The OpenAI-compatible server on a hybrid (the real `openai` client, two requests at once): the engine
    thread drives the per-sequence path."""
    import concurrent.futures

    import openai
    from server_helpers import in_process, make_tiny_model

    from int8kv.models import load_model
    from int8kv.server import build_app

    _, tokenizer = load_model(str(make_tiny_model(tmp_path / "tiny")), quiet=True)
    torch.manual_seed(0)
    config = AutoConfig.for_model("lfm3", **{**COMMON, **HYBRIDS["lfm3"], "vocab_size": len(tokenizer)})
    model = AutoModelForCausalLM.from_config(config).eval()
    texts = ["the water of the day", "a man"]
    want = [tokenizer.decode(hf_greedy(model, tokenizer(t)["input_ids"], 4)) for t in texts]
    with in_process(build_app(LLM(model, memory="1MiB", tokenizer=tokenizer), "hybrid")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

        def complete(text: str) -> str:
            reply = client.completions.create(model="hybrid", prompt=text, max_tokens=4, temperature=0)
            return reply.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(complete, texts)) == want


def test_hybrid_failure_fails_only_its_sequence(monkeypatch):
    """A sequence whose forward raises mid-prefill fails alone (its blocks and state freed); the other, run in the
    same steps, gives transformers' tokens (it is never rerun: a rerun would advance its state twice)."""
    from int8kv import NonFiniteError

    model = build_hybrid("lfm3", seed=7)
    batch = prompts(12, 5, seed=8)
    want = hf_greedy(model, batch[1], 5)
    llm = engine(model, F16)
    forward, doomed = llm.model.forward_sequence, []

    def failing(cache, step_batch, seq_id, start, all_logits=False):
        if seq_id in doomed and start > 0:  # the second prefill chunk: its state has advanced once
            raise NonFiniteError("injected")
        return forward(cache, step_batch, seq_id, start, all_logits)

    monkeypatch.setattr(llm.model, "forward_sequence", failing)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in batch]
    doomed.append(ids[0])
    done, tokens = {}, {i: [] for i in ids}
    while llm.has_unfinished():
        llm.step()
        for u in llm.pop_updates():
            tokens[u.request_id] += u.new_token_ids
            if u.finished:
                done[u.request_id] = u
    assert done[ids[0]].finish_reason == "error" and "injected" in done[ids[0]].error
    assert done[ids[1]].finish_reason == "length" and tokens[ids[1]] == want
    assert llm.stats.failed_requests == 1
    assert_idle(llm)
    outs = llm.generate([batch[1]], params)  # the engine goes on as a fresh one would
    assert outs[0].token_ids == want



# Sliding and full layers of one K/V shape (a Gemma-3-like pattern, 5 sliding : 2 full): table groups of 2 layers
# (the fewest layers any span has), the sliding layers in three (the last padded), the full ones in one; each
# group has its own block table, the sliding ones give blocks back past the window.
MIXED = dict(layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
             + ["full_attention"], num_hidden_layers=7, sliding_window=8)  # fmt: skip


def build_mixed(seed: int = 0) -> torch.nn.Module:
    return build("gemma3-mixed", seed, ("gemma3_text", MIXED))


def _page_bytes(fmt: KvStorageFormat) -> int:
    return 4 * fmt.bytes_per_token(2, 2, 16)  # a block of 4 tokens of one table group's 2 layers


def test_mixed_spans_get_a_table_per_group_and_match_transformers():
    model = build_mixed(seed=2)
    batch = prompts(19, 6, seed=3)  # the first prompt is longer than the window
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for fmt, cache in ((F16, lambda: None), (INT8, lambda: fake_quant_cache(model, INT8))):
        llm = engine(model, fmt)  # prefill in chunks of 7 tokens, two sequences side by side
        assert llm.model.windows == (8, 8, 8, None) and llm.cache.windows == (8, 8, 8, None)
        assert [(la.group, la.table, la.kv) for la in llm.model.step_layers] == [
            (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 3, 0), (0, 1, 1), (0, 2, 0), (0, 3, 1)]  # fmt: skip
        # A page holds one table group's 2 layers; the budget counts pages, and every page is in one pool.
        assert [la.dims for la in llm.cache.layouts] == [(2, 2, 16)]
        assert llm.cache.num_blocks == 2**20 // _page_bytes(fmt)
        assert llm.cache.memory_bytes() == llm.cache.num_blocks * _page_bytes(fmt)
        assert llm.kv_bytes_per_token() * 4 == 4 * _page_bytes(fmt)  # a token held by all four tables
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8, cache()) for p in batch], fmt
        assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_mixed_spans_sliding_tables_stop_growing_past_the_window():
    model = build_mixed(seed=3)
    prompt = prompts(10, seed=4)[0]
    want = hf_greedy(model, prompt, 40)
    llm = engine(model, F16, max_num_batched_tokens=64)
    alloc = llm.cache.allocator
    seen = []

    def record(stats) -> None:
        for seq in llm.scheduler.running:
            seen.append((alloc.context_len(seq.seq_id), [alloc.blocks_in_use(g) for g in range(4)]))

    out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True), on_step=record)
    assert out[0].token_ids == want
    assert [n for n, _ in seen] == list(range(10, 49))  # the prefill, then a token a step
    for n, pages in seen:
        # After a step of length n the next query (position n) sees n - 7 .. n: a sliding table keeps the blocks
        # from (n - 7) // 4 on, at most 3; the full table keeps every block.
        held = alloc.blocks_for_tokens(n) - min(n // 4, max(0, n - 7) // 4)
        assert pages == [held, held, held, alloc.blocks_for_tokens(n)], n
    assert max(max(pages[:3]) for _, pages in seen) == 3 and seen[-1][1][3] == 12  # 48 tokens
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_mixed_spans_with_prefix_hits_preemption_and_forks(tmp_path):
    model = build_mixed(seed=5)
    shared = prompts(22, seed=6)[0]
    batch = [shared, shared[:17] + [3, 4, 5], shared, prompts(13, seed=7)[0]]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want = [hf_greedy(model, p, 14) for p in batch]
    # A request of 36 tokens fits in 9 pages of the full table and at most 5 per sliding table (its window and a
    # chunk of 8): 24; the pool of 30 holds one such sequence and a part: admission waits and growth preempts.
    llm = engine(model, F16, memory=30 * _page_bytes(F16), max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.cache.num_blocks == 30
    outs = llm.generate(batch, params)
    assert [o.token_ids for o in outs] == want
    assert llm.stats.preemptions > 0 and llm.stats.prefix_hit_tokens > 0
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    # With room to spare, a prompt's released sliding blocks stay cached: the same prompt again hits the whole
    # chain in every table (5 full blocks of its 22 tokens, one token left to compute).
    llm = engine(model, F16, memory=128 * _page_bytes(F16))
    for hits in (0, 20):
        assert llm.generate([shared], params)[0].token_ids == want[0]
        assert llm.stats.prefix_hit_tokens == hits
    # Forked choices share the prompt's blocks in every table; the partial last block is copied in each.
    assert forked_tokens(llm, shared, params, 3) == [want[0]] * 3
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert all(llm.cache.allocator.refcount(b) == 0 for b in range(llm.cache.num_blocks))


def share_prefix_through_a_disk_store(model, fmt: KvStorageFormat, store: str):
    """Two engines on one disk store: the second loads the first's prefix blocks and generates the cold run's greedy
    tokens. Then a cold engine's pool holds the prompt's first block under the same key, with the rows the store
    holds, bit for bit. Returns that engine (its sequence "probe" holding the block), the store's value and the
    block's state."""
    from int8kv.blockstore import BlockSpec, decode_block

    prompt = prompts(26, seed=9)[0]
    want = hf_greedy(model, prompt, 6, None if fmt is F16 else fake_quant_cache(model, fmt))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs, hits = [], []
    for _ in range(2):  # two engines, one store directory
        with engine(model, fmt, kv_store=f"disk:{store}") as llm:
            outs.append(llm.generate([prompt], params)[0].token_ids)
            assert llm.flush_kv_store(5.0)
            hits.append(llm.stats.store_hit_tokens)
            key = llm.scheduler.hasher.block_keys(prompt)[0]
            value = llm.kv_store.get([key])[0]
    assert outs == [want, want]
    assert hits == [0, 24]  # 6 full blocks of the 26-token prompt, 2 tokens left to compute
    cold = engine(model, fmt)  # a cold engine's pool holds the same block under the same key
    cold.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    assert cold.scheduler.hasher.block_keys(prompt)[0] == key
    hit, _ = cold.cache.add_sequence_with_prefix("probe", 5, [key])  # a hit leaves a token to compute
    assert hit == 4
    state = cold.cache.export_state("probe", 0, 4)
    assert decode_block(BlockSpec(cold.cache.state_layouts, 4, cold.fingerprint), value, key).equal(state)
    return cold, value, state


@pytest.mark.parametrize("fmt", [F16, INT8])
def test_mixed_spans_share_prefix_blocks_through_the_block_store(tmp_path, fmt):
    """Block values with one section per block table, each its group's written layers (the padded third sliding
    group holds one); a state exported from one cache imports into another bit for bit."""
    from int8kv.blockstore.codec import read_header

    model = build_mixed(seed=8)  # the 26-token prompt is longer than the window: sliding tables give blocks back
    cold, value, state = share_prefix_through_a_disk_store(model, fmt, tmp_path)
    assert cold.cache.state_layouts == tuple(KvLayout(n, 2, 16, fmt) for n in (2, 2, 1, 2))
    assert read_header(value).version == 3 and len(read_header(value).groups) == 4
    other = engine(model, fmt).cache
    other.import_state("copy", state)
    assert other.export_state("copy").equal(state)
    with pytest.raises(ShapeMismatch):  # a one-layout state does not fit a cache of four sections
        other.import_state("bad", state.sections[0])
    assert "bad" not in other.allocator
    cold.cache.free("probe")

# Per-layer K/V shapes (Gemma 4: a larger head_dim on the full layers than on the sliding ones): one pool per group of
# layers with the same (kv_heads, head_dim), every pool indexed by the same block ids of one allocator.
def _gemma4_block_bytes(fmt: KvStorageFormat) -> int:
    return 4 * (fmt.bytes_per_token(2, 2, 16) + fmt.bytes_per_token(2, 2, 32))  # blocks of 4 tokens, two groups


def test_per_layer_shapes_get_a_pool_per_group_sized_for_its_shape():
    llm = engine(build("gemma4_text"), INT8)
    cache = llm.cache
    assert [la.dims for la in cache.layouts] == [(2, 2, 16), (2, 2, 32)]  # (layers, kv_heads, head_dim)
    assert all(pool.num_blocks == cache.num_blocks for pool in cache.pools)
    per_block = _gemma4_block_bytes(INT8)
    # The budget buys blocks of both shapes; no layer is padded to the larger head_dim.
    assert cache.num_blocks == 2**20 // per_block and cache.memory_bytes() == cache.num_blocks * per_block
    assert llm.kv_bytes_per_token() * 4 == per_block
    # Sliding layers 0 and 2 in the first pool, full layers 1 and 3 in the second.
    assert [(layer.group, layer.table, layer.kv) for layer in llm.model.step_layers] == [(0, 0, 0), (1, 0, 0),
                                                                                         (0, 0, 1), (1, 0, 1)]


def test_per_layer_shapes_with_prefix_caching_preemption_and_forks():
    model = build("gemma4_text", seed=5)
    shared = prompts(22, seed=6)[0]
    batch = [shared, shared[:17] + [3, 4, 5], shared, prompts(13, seed=7)[0]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [hf_greedy(model, p, 10) for p in batch]
    # 9 blocks for four sequences of 6-8 blocks each: admission waits and growth preempts.
    llm = engine(model, F16, memory=9 * _gemma4_block_bytes(F16), max_num_seqs=4, max_num_batched_tokens=8)
    outs = llm.generate(batch, params)
    assert [o.token_ids for o in outs] == want
    assert llm.stats.preemptions > 0 and llm.stats.prefix_hit_tokens > 0
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    # Forked choices share the prompt's blocks; the partial last block is copied on write in both pools (a copy
    # in one pool only would leave the other's rows of the prompt unwritten in the copy and change the tokens).
    llm = engine(model, F16, memory=32 * _gemma4_block_bytes(F16))
    assert forked_tokens(llm, shared, params, 3) == [want[0]] * 3
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert all(llm.cache.allocator.refcount(b) == 0 for b in range(llm.cache.num_blocks))


@pytest.mark.parametrize("fmt", [F16, INT8])
def test_per_layer_shapes_share_prefix_blocks_through_the_block_store(tmp_path, fmt):
    """Version-3 block values, one section per K/V shape: the store holds the first engine's rows of both pools."""
    from int8kv.blockstore.codec import read_header

    cold, value, _ = share_prefix_through_a_disk_store(build("gemma4_text", seed=8), fmt, tmp_path)
    assert read_header(value).version == 3 and read_header(value).groups == ((2, 0, 2, 16), (2, 0, 2, 32))
    cold.cache.free("probe")


def test_per_layer_shapes_share_prefix_blocks_through_the_embedded_valkey():
    model = build("gemma4_text", seed=8)
    prompt = prompts(26, seed=9)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with engine(model, F16, kv_store="embedded") as a:
        cold = a.generate([prompt], params)[0].token_ids
        assert a.flush_kv_store(30.0)
        with engine(model, F16, kv_store=a.kv_store) as b:  # an open store: shared, not owned
            assert b.generate([prompt], params)[0].token_ids == cold == hf_greedy(model, prompt, 6)
            assert b.stats.store_hit_tokens == 24 and b.stats.store_faults == 0


def test_per_layer_shapes_state_round_trips_bit_exact_per_group():
    from int8kv.cache.paged import PagedKvCache
    from int8kv.cache.state import GroupedKvState, KvLayout

    layouts = [KvLayout(2, 2, 16, INT8), KvLayout(1, 1, 32, INT8), KvLayout(3, 2, 8, INT8)]
    cache = PagedKvCache.with_groups(8, 4, layouts)
    cache.add_sequence(0, 7)
    slots = cache.slots(0)
    gen = torch.Generator().manual_seed(3)
    for pool in cache.pools:
        for layer in range(pool.layout.num_layers):
            k, v = (torch.randn(7, pool.num_kv_heads, pool.head_dim, generator=gen) for _ in range(2))
            pool.write_rows(layer, slots, *(INT8.spec.encode(x) for x in (k, v)))
    state = cache.export_state(0)
    assert isinstance(state, GroupedKvState) and state.layouts == cache.layouts and state.layers is None
    for section, pool in zip(state.sections, cache.pools, strict=True):
        for layer in range(pool.layout.num_layers):
            k, v = pool.export_rows(layer, slots)
            assert all(torch.equal(a[0], b) for a, b in zip(section.layer(layer)[0], k, strict=True))
            assert all(torch.equal(a[0], b) for a, b in zip(section.layer(layer)[1], v, strict=True))
    cache.import_state(1, state)
    assert cache.export_state(1).equal(state)
    cache.add_sequence(2, 9)
    cache.write_state(2, 2, state)  # positions 2..8 of a sequence that holds them
    assert cache.export_state(2, 2, 9).equal(state)
    # Refused before anything changes: a one-shape state, another group order, a batch of two, a taken id.
    free = cache.num_free_blocks
    one = state.sections[0]
    swapped = GroupedKvState.of([state.sections[1], state.sections[0], state.sections[2]])
    for bad, match in ((one, "holds 3 groups"), (swapped, "differ from the cache's"), (state, "already")):
        with pytest.raises(KvCacheError, match=match):
            cache.import_state(1 if bad is state else 3, bad)
    assert cache.num_free_blocks == free and 3 not in cache.allocator
    plain = PagedKvCache(8, 4, 2, 2, 16, INT8)
    with pytest.raises(ShapeMismatch, match="expected a KvState"):
        plain.import_state(0, state)
    with pytest.raises(ShapeMismatch, match="two or more"):
        GroupedKvState.of([one])
    assert GroupedKvState.of([one, one]).layouts == (one.layout, one.layout)  # sections of one shape: block tables
    with pytest.raises(ShapeMismatch, match="share format, batch and length"):
        GroupedKvState.of([one, cache.export_state(2, 2, 5).sections[1]])  # 3 positions beside 7
    with pytest.raises(ShapeMismatch, match="layers must give"):
        GroupedKvState.of(state.sections, [[0, 1], [2], [3, 4]])  # 3 layers in the last section
    with pytest.raises(ShapeMismatch, match="layers must give"):
        GroupedKvState.of(state.sections, [[2, 3], [0], [1, 4, 5]])  # not in order of first use


def test_per_layer_shapes_refuse_what_is_not_implemented():
    from int8kv.cache.paged import PagedKvCache
    from int8kv.cache.state import KvLayout

    for layouts in ([], [KvLayout(1, 2, 16, F16), KvLayout(1, 2, 32, INT8)], [(1, 2, 16)]):
        with pytest.raises(ShapeMismatch, match="layouts must be a non-empty list of KvLayouts of one format"):
            PagedKvCache.with_groups(4, 4, layouts)


def test_a_model_whose_packed_steps_differ_from_each_sequence_alone_is_refused():
    """The probe's packed step in place of transformers' _supports_attention_backend flag: a model whose RoPE takes
    the packed row's token index instead of position_ids gives its decode token of one sequence, packed beside
    another's prompt, other logits than that sequence alone. Refused by name; the model is left as it was."""
    model = build("llama")
    with torch.no_grad():  # peaked attention, so that positions move the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    rotary = model.model.rotary_emb
    rope = rotary.forward
    rotary.forward = lambda x, position_ids: rope(x, torch.arange(position_ids.shape[-1])[None])
    ids = torch.tensor([prompts(10)[0]])
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(UnsupportedModel, match="packed into one step than for each alone"):
        LLM(model, memory="1MiB")
    assert model.config._attn_implementation in ("sdpa", "eager")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_a_model_whose_own_mask_the_plan_does_not_follow_is_refused():
    """A model that builds its own mask (here each token sees only itself: a 4-D mask, which masking_utils passes
    through) attends differently from the engine's causal plan: the probe's comparison with the model's own
    forward refuses it by name."""
    model = build("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    inner = model.model.forward

    def own_mask(*args, **kwargs):
        n = kwargs["input_ids"].shape[1]
        kwargs["attention_mask"] = torch.eye(n, dtype=torch.bool)[None, None]
        return inner(*args, **kwargs)

    model.model.forward = own_mask
    with pytest.raises(UnsupportedModel, match="differ from its own forward's"):
        LLM(model, memory="1MiB")
    assert model.config._attn_implementation in ("sdpa", "eager")
