"""Every decoder-only architecture of the installed transformers, built tiny, through Int8KvCache.

    python tests/models_coverage.py            # classify them all and write docs/models.md

Each model type of transformers' causal-LM mapping (the text config of a multimodal family where transformers
has a ``*ForCausalLM`` for it; encoder-decoder, encoder-only and multimodal-only types skipped) is built with
hidden 64, 2 layers (hybrids: up to 8, until an attention layer exists), vocab 256, 4 heads / 2 KV heads, its
linear weights rescaled so attention is peaked and its biases non-zero. One left-padded batch of two prompts
(16 tokens, and 12 after 4 padding) is generated greedily for 8 tokens:

* with F16 storage against ``DynamicCache``: tokens equal (a divergence only where the reference's top-2
  gap is within the logit perturbation) and every step's logits within 1 % of their range;
* with INT8 storage against a ``DynamicCache`` whose K/V went through int8kv's own codec (fake-quantized),
  so rounding is not mistaken for a bug: the same criteria;
* the int8kv kernels really called: every int8kv layer read once per forward;
* for a type that works, the engine (``int8kv.engine.LLM`` on the same model object) on the two prompts
  without their padding, side by side with chunked prefill: greedy tokens and top log-probabilities following
  the F16 reference at F16 and the fake-quantized one at INT8, or a typed refusal (``UnsupportedModel`` /
  ``UnsupportedAttention``) after which the model gives its original output.

Outcomes: ``works`` (with the engine's result: ``works`` or its refusal); ``refused`` (an
``UnsupportedAttention`` naming what is missing, after which the model run with its default cache gives its
original logits: no side effects); ``crash`` (any other error); ``wrong`` (no error, wrong output, kernels not
called, or a refusal that changed the model), in the drop-in or the engine. Configs get only the K/V head
count their class knows (GPT-2 has none), hybrids' Mamba-2 layers small sizes (:data:`MAMBA`); the kernels run
on one thread (the serial kernel). The test (tests/test_models_coverage.py) fails on any crash or wrong and, on
the transformers version the page names (:func:`page_version`), checks that docs/models.md is what this finds.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numba
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import int8kv.errors
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import UnsupportedAttention, UnsupportedModel
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache, disable_int8kv_attention, layer_specs

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
VOCAB = 256
PROMPT, PAD, NEW = 16, 4, 8
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
    eos_token_id=None, initializer_range=0.02,
)  # fmt: skip
# Mixture-of-experts sizes, for the configs that have these fields (defaults of up to 512 experts make a tiny
# model slow to build).
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, n_shared_experts=1)  # fmt: skip
# Mamba-2 sizes, for the hybrids' state layers (kept as transformers' own modules: only the attention layers are
# int8kv's). Their defaults (chunks of 256 tokens, 128 heads, state 256) made bamba's and falcon_h1's runs 9-12 s
# of CPU each, 54 of bamba's 59 s (profiled) in transformers' chunked scan padding 16 tokens to 256.
MAMBA = dict(chunk_size=8, mamba_chunk_size=8, mamba_d_state=16, ssm_state_size=16, mamba_n_heads=4,
             mamba_num_heads=8, mamba_head_dim=16, mamba_d_ssm=128, n_mamba_heads=4)  # fmt: skip
# Other modules whose defaults are full size (none of them holds K/V for int8kv, except cpmant's head size, a model
# refused for computing attention itself): linear-attention heads (Qwen3-Next, Qwen3.5, LARA), per-layer input
# embeddings (Gemma 3n / 4: 262,144 x 256 per layer), DeepSeek V4's indexer and low ranks, MiniMax M3's dense MLP,
# CPM-Ant's MLP, and Inkling 2's unpadded vocabulary (200,058, past the 256 built: it failed to build). gemma3n_text,
# deepseek_v4 and the Qwen3-Next family took 32-39 s each at load 21 with the defaults (0.3-1.1 s of CPU without).
SIDE = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8,
            index_n_heads=4, o_lora_rank=16, q_lora_rank=16, dense_intermediate_size=128, shared_intermediate_size=32,
            dim_ff=128, dim_head=16, unpadded_vocab_size=VOCAB)  # fmt: skip
DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


@dataclass
class Outcome:
    model_type: str
    kind: str  # works | refused | crash | wrong | skipped
    detail: str = ""
    engine: str = ""  # works: "works" or the engine's refusal


# Variants of one model type whose attention differs (name -> (model type, config overrides)), and settings a
# model type needs to be built this small.
VARIANTS = {"falcon (alibi)": ("falcon", {"alibi": True})}
NEEDS = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "zaya": {"num_experts_per_tok": 1},
    "bamba": {"num_hidden_layers": 4, "attn_layer_indices": [1, 3]},
    "granitemoehybrid": {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"]},
    "dots3_note_text": {"num_key_value_heads": 4},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "deepseek_v4": {"index_head_dim": 16},  # its indexer (see SIDE); other configs check it against qk_rope_head_dim
}


def candidate_types() -> list[str]:
    """Model types of the causal-LM mapping, minus composite (multimodal) configs and encoder-decoders, plus
    :data:`VARIANTS`."""
    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        cls = CONFIG_MAPPING[mt] if mt in CONFIG_MAPPING else None
        if cls is None or cls.sub_configs:
            continue  # multimodal families: their text configs are mapping entries of their own where they exist
        out.append(mt)
    return sorted(out + list(VARIANTS))


class _Timeout(BaseException):  # not an Exception: classify() must not take it for the model's error
    pass


def _alarm(*_):
    raise _Timeout("too slow to build")


def _attempts(model_type: str) -> Iterator[dict]:
    """Tiny settings to try, in order: as is; without ``head_dim`` (configs that derive it); with MLA's
    dimensions (DeepSeek-like configs); more layers (hybrids whose first layers hold no attention)."""
    cls = CONFIG_MAPPING[VARIANTS.get(model_type, (model_type,))[0]]
    moe = {k: v for k, v in {**MOE, **MAMBA, **SIDE}.items() if hasattr(cls, k)}
    base = {**TINY, **moe, **VARIANTS.get(model_type, ("", {}))[1], **NEEDS.get(model_type, {})}
    if not hasattr(cls, "num_key_value_heads") and "num_key_value_heads" not in cls.attribute_map:
        del base["num_key_value_heads"]  # a config its users have: no K/V head count its attention ignores (GPT-2)
    yield base
    yield {k: v for k, v in base.items() if k != "head_dim"}
    if hasattr(cls, "kv_lora_rank"):
        yield {**base, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
               "v_head_dim": 16, "head_dim": 8}  # fmt: skip
    for layers in (4, 8):
        yield {**base, "num_hidden_layers": layers}


def _build_one(model_type: str, kwargs: dict) -> torch.nn.Module | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[model_type](**kwargs)
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_decoder", True):
        return None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    _rescale(model)
    if not any(spec.has_kv for spec in layer_specs_or_empty(config)) and kwargs["num_hidden_layers"] < 8:
        raise ValueError("only contain LinearAttention layers at this size")  # a hybrid: try more layers
    model.reference = reference(model)  # also proves the model runs with DynamicCache at this size
    return model


def layer_specs_or_empty(config) -> list:
    try:
        return layer_specs(config)
    except UnsupportedAttention:
        return []


def build(name: str) -> torch.nn.Module | None:
    """The tiny model of model type (or variant) ``name`` (None where transformers cannot build or run one
    this small)."""
    model_type = VARIANTS.get(name, (name,))[0]
    hybrid = False  # two layers held no attention layer: only the larger sizes can work
    for kwargs in _attempts(name):
        if hybrid and kwargs["num_hidden_layers"] == 2:
            continue
        try:
            return _build_one(model_type, kwargs)
        except Exception as e:  # noqa: BLE001 - this size does not build or run: try the next
            hybrid = hybrid or "only contain LinearAttention layers" in str(e)
    return None


@torch.no_grad()
def _rescale(model: torch.nn.Module) -> None:
    """Peaked attention and non-zero biases: linear weights with std 1.5 / sqrt(fan_in), biases ~ N(0, 0.1),
    norms' weights 1 +- 0.1, sink logits ~ N(0, 1)."""
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 1.5 / math.sqrt(module.in_features))
            if module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.1)
        elif "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), torch.Tensor):
            w = module.weight
            if w.dim() == 1:
                w.copy_(w + torch.randn(w.shape, generator=g) * 0.1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=g))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=g)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids * mask, mask


def _fake_quant(cache: DynamicCache, fmt: KvStorageFormat) -> DynamicCache:
    """``cache`` storing decode(encode(x)) in every K/V layer: the values Int8KvCache holds, in float32."""

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        return fmt.spec.decode(fmt.spec.encode(x)).to(x.dtype)

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            original = layer.update
            layer.update = lambda k, v, *a, _orig=original, **kw: _orig(roundtrip(k), roundtrip(v), *a, **kw)
    return cache


def generate(model: torch.nn.Module, cache) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids, mask = inputs()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )  # fmt: skip
    return out.sequences[:, PROMPT:], [t.float() for t in out.logits]


def reference(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return generate(model, DynamicCache(config=model.config))


def compare(ref, got) -> str:
    """'' when ``got`` matches ``ref`` (tokens, logits within 1 % of their range), else what differs."""
    (rt, rl), (gt, gl) = ref, got
    if rt.shape != gt.shape:
        return f"{gt.shape[1]} tokens instead of {rt.shape[1]}"
    worst = 0.0
    for step, (r, g) in enumerate(zip(rl, gl, strict=True)):
        scale = float(r.abs().max()) or 1.0
        dev = float((r - g).abs().max()) / scale
        worst = max(worst, dev)
        for row in range(rt.shape[0]):
            if int(rt[row, step]) != int(gt[row, step]):
                top2 = r[row].topk(2).values
                if float(top2[0] - top2[1]) > 2 * float((r[row] - g[row]).abs().max()):
                    return f"row {row} diverged at step {step} (a clear winner), logits off by {dev:.3g} of the range"
        if dev > 0.01:
            return f"logits off by {dev:.3g} of their range at step {step}"
        if bool((rt[:, step] != gt[:, step]).any()):
            break  # a near-tie flipped: later steps condition on other tokens
    return ""


# The engine on the batch's two prompts without their padding (16 and 12 tokens) side by side: prefill in chunks
# of at most 10 tokens, the second prompt's chunks beside the first one's decode (continuous batching), blocks of
# 4 tokens. TOP: log-probabilities reported per generated token (the chosen one and the runner-up).
ENGINE = dict(memory="1MiB", block_size=4, max_num_batched_tokens=10)
TOP = 2


def engine_generate(model: torch.nn.Module, fmt: KvStorageFormat) -> list:
    """The engine's outputs (tokens and their log-probabilities) for the unpadded prompts of :func:`inputs`;
    a request that failed mid-step raises its error again."""
    ids, mask = inputs()
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    llm = LLM(model, kv_format=fmt, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=TOP))
    for out in outs:
        if out.finish_reason == "error":
            name, _, message = out.error.partition(": ")
            error = getattr(int8kv.errors, name, None)
            raise (error if isinstance(error, type) and issubclass(error, Exception) else RuntimeError)(out.error)
    return outs


def compare_engine(ref, outs) -> str:
    """'' when each engine output follows the reference's row: every top log-probability within 2 % of the
    logits' range (what logits within 1 % allow), the same tokens until a divergence the logits explain (the
    reference's top-2 gap within the two tokens' deviations), else what differs."""
    rt, rl = ref
    for row, out in enumerate(outs):
        if len(out.token_ids) != rt.shape[1]:
            return f"row {row}: {len(out.token_ids)} tokens instead of {rt.shape[1]}"
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            logits = rl[step][row]
            want = torch.log_softmax(logits.double(), -1)
            dev = {t: abs(v - float(want[t])) for t, v in lp.top}
            worst = max(dev.values()) / (float(logits.abs().max()) or 1.0)
            if worst > 0.02:
                return f"row {row}: log-probabilities off by {worst:.3g} of the logits' range at step {step}"
            expected = int(rt[row, step])
            if token != expected:
                gap = float(want[expected] - want[token])
                if expected not in dev or gap > dev[expected] + dev[token]:
                    return f"row {row} diverged at step {step} (a clear winner, gap {gap:.3g})"
                break  # a near-tie flipped: later steps condition on other tokens
    return ""


def unpadded(model: torch.nn.Module, make_cache) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`generate`'s result with each prompt run alone, without padding. The engine's reference for models
    with state layers: a recurrence need not skip left padding (RecurrentGemma's RG-LRU does not: its padded row
    moves the logits by 6-8 % of their range against the same prompt alone), attention masks it exactly."""
    ids, mask = inputs()
    runs = []
    for row, m in zip(ids, mask, strict=True):
        prompt = row[m.bool()][None]
        with torch.no_grad():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), cache=make_cache(), max_new_tokens=NEW,
                do_sample=False, min_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
            )  # fmt: skip
        runs.append((out.sequences[:, prompt.shape[1]:], [t.float() for t in out.logits]))
    tokens = torch.cat([t for t, _ in runs])
    return tokens, [torch.cat(step) for step in zip(*(logits for _, logits in runs), strict=True)]


def engine_outcome(model_type: str, model: torch.nn.Module, fake, stateful: bool = False) -> Outcome | None:
    """None when the engine generates like the references (F16: transformers', INT8: the fake-quantized
    one; each prompt alone where the model has state layers); its typed refusal as the engine column (the model
    left as it was); crash or wrong otherwise."""
    ref = model.reference
    if stateful:
        ref = unpadded(model, lambda: DynamicCache(config=model.config))
        fake = unpadded(model, lambda: _fake_quant(DynamicCache(config=model.config), INT8))
    impl = model.config._attn_implementation
    for fmt, want in ((F16, ref), (INT8, fake)):
        try:
            outs = engine_generate(model, fmt)
        except (UnsupportedModel, UnsupportedAttention) as e:
            if model.config._attn_implementation != impl or not same_output(model):
                return Outcome(model_type, "wrong", f"engine refused ({e}) but the model's output changed afterwards")
            return Outcome(model_type, "works", "", str(e).split("\n")[0])
        except Exception as e:  # noqa: BLE001 - the point is to classify whatever happens
            return Outcome(model_type, "crash", f"engine: {describe(e)}")
        diff = compare_engine(want, outs)
        if diff:
            return Outcome(model_type, "wrong", f"engine {fmt.value}: {diff}")
    if model.config._attn_implementation != impl:
        return Outcome(model_type, "wrong", "the engine left the model's attention implementation changed")
    return None


def describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def same_output(model: torch.nn.Module) -> bool:
    """Whether the model run with its default cache gives its original tokens and logits (no side effects)."""
    after, ref = reference(model), model.reference
    return torch.equal(after[0], ref[0]) and all(map(torch.equal, after[1], ref[1]))


def classify(model_type: str, model: torch.nn.Module) -> Outcome:
    ref = model.reference
    fake = generate(model, _fake_quant(DynamicCache(config=model.config), INT8))
    for fmt, want in ((F16, ref), (INT8, fake)):
        try:
            cache = Int8KvCache(model.config, format=fmt)
            got = generate(model, cache)
        except UnsupportedAttention as e:
            if not same_output(model):  # the same model with its default cache, after the refusal
                return Outcome(model_type, "wrong", f"refused ({e}) but the model's output changed afterwards")
            return Outcome(model_type, "refused", str(e).split("\n")[0])
        except Exception as e:  # noqa: BLE001 - the point is to classify whatever happens
            return Outcome(model_type, "crash", describe(e))
        diff = compare(want, got)
        if diff:
            return Outcome(model_type, "wrong", f"{fmt.value}: {diff}")
        layers = cache.kv_layers()
        if layers and all(la.get_seq_length() == 0 for la in layers):
            return Outcome(model_type, "no attention", "the model keeps a recurrent state of its own, no KV cache")
        if not layers:
            return Outcome(model_type, "no attention", "only " + ", ".join(sorted({s.layer_type for s in cache.specs})))
        if any(la.attention_calls != NEW for la in layers):
            calls = [la.attention_calls for la in layers]
            return Outcome(model_type, "wrong", f"int8kv kernels not called once per forward: {calls}")
    kinds = ", ".join(sorted({spec.kind for spec in cache.specs or []}))
    disable_int8kv_attention(model)  # the engine gets the model as its user has it
    engine = engine_outcome(model_type, model, fake, any(spec.state for spec in cache.specs or []))
    if engine is not None and engine.kind != "works":
        return engine
    return Outcome(model_type, "works", kinds, "works" if engine is None else engine.engine)


def refused_by_config(name: str) -> Outcome | None:
    """The refusal ``Int8KvCache(config)`` gives before any model exists (MLA, ALiBi, ... named from the
    config alone, without building the model), or None; the config must be left as it was. Encoder-decoder
    configs are "skipped" (not decoder-only architectures)."""
    model_type = VARIANTS.get(name, (name,))[0]
    config = None
    for kwargs in _attempts(name):  # the first settings its config accepts (Falcon's derived head_dim: the second)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = CONFIG_MAPPING[model_type](**kwargs)
            break
        except Exception:  # noqa: BLE001 - not these settings: try the next
            continue
    if config is None:
        return None  # no config at this size: build() decides
    if getattr(config, "is_encoder_decoder", False):
        return Outcome(name, "skipped", "encoder-decoder")
    try:
        DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - transformers itself cannot build a cache for this config
        return None
    impl = config._attn_implementation
    try:
        Int8KvCache(config)
    except UnsupportedAttention as e:
        if config._attn_implementation != impl:
            return Outcome(name, "wrong", f"refused ({e}) but the config's attention implementation changed")
        return Outcome(name, "refused", str(e).split("\n")[0])
    except Exception:  # noqa: BLE001 - classify() reports it on the built model
        return None
    return None


# Models whose runs compile (or load from numba's cache) every kernel specialisation the page needs: plain,
# softcap, sinks, window and chunk bounds, F16 and INT8. A cold compile is 25-35 s of CPU per specialisation at
# load 13 (gemma2's four took 158 s of wall time at load 16): inside a model's time limit it would skip the model.
WARM = ("llama", "gemma2", "gpt_oss", "llama4_text")


def warm_up(reverse: bool = False) -> None:
    """Compile the kernels (or load them from numba's cache) outside any model's time limit. Processes that warm
    up at once share the compiles (int8kv.numba_cache: one compiles a specialisation, the others wait for it and
    load it); ``reverse`` (every second test worker) takes the models the other way round, so two workers compile
    different specialisations first instead of one waiting on the other."""
    transformers.logging.set_verbosity_error()
    for mt in reversed(WARM) if reverse else WARM:
        outcome(mt, seconds=0)


def outcome(mt: str, seconds: int = 120) -> Outcome | None:
    """``mt``'s outcome, or None for a type that cannot be built this small or is not decoder-only (not on the
    page); "skipped" when it runs over ``seconds`` on this machine (0: no limit)."""
    threads, kernel_threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: waking a second thread costs more than the work (2-4x measured)
    # The kernels' serial variant only (the same work items and numerics as the parallel one): one compile or
    # cache load per specialisation instead of two, and no pool to wake for a few keys.
    numba.set_num_threads(1)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        early = refused_by_config(mt)
        if early is not None:
            return None if early.kind == "skipped" else early
        model = build(mt)
        return None if model is None else classify(mt, model)
    except _Timeout:
        return Outcome(mt, "skipped", f"over {seconds} s on this machine")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)
        numba.set_num_threads(kernel_threads)


def run_all(seconds_per_model: int = 120, start: str = "") -> Iterator[Outcome]:
    warm_up()
    for mt in (t for t in candidate_types() if t >= start):
        found = outcome(mt, seconds_per_model)
        if found is not None:
            yield found


def page_rows(text: str) -> dict[str, tuple[str, str]]:
    """``{model type: (outcome, detail)}`` as a page written by :func:`render` lists them."""
    titles = {"Works": "works", "Refused": "refused", "Crash": "crash", "Wrong": "wrong", "Skipped": "skipped",
              "No attention layers at this size (nothing for int8kv to store)": "no attention"}  # fmt: skip
    rows, kind = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            kind = titles[line[3:]]
        elif kind and line.startswith("| `"):
            name, detail = line[3:].split("` | ", 1)
            rows[name] = (kind, detail[:-2])
    return rows


def page_version(text: str) -> str:
    """The transformers version a page written by :func:`render` was measured on."""
    found = re.search(r"^Generated by .*?\(transformers ([^)]+)\)", text, re.M)
    if found is None:
        raise ValueError("the page does not say which transformers version it was measured on")
    return found.group(1)


def render(outcomes: list[Outcome]) -> str:
    kinds = ("works", "refused", "no attention", "crash", "wrong", "skipped")
    by = {k: [o for o in outcomes if o.kind == k] for k in kinds}
    lines = [
        "# Models: Int8KvCache across transformers' decoder architectures",
        "",
        f"Generated by `python tests/models_coverage.py` (transformers {transformers.__version__}); "
        "tests/test_models_coverage.py checks that this page is what it finds on that version, and on another "
        "version only that no model type crashes or gives wrong output and that each refusal names what is "
        "missing (rows not compared). Each decoder-only model type is "
        "built tiny (hidden 64, 2 layers or more until a hybrid has an attention layer, vocab 256, 4 heads / 2 "
        f"KV heads where the config has a K/V head count, peaked attention, non-zero biases) and generates {NEW} "
        f"greedy tokens for a left-padded batch of two {PROMPT}-token prompts: F16 storage against "
        "`DynamicCache`, INT8 against a `DynamicCache` holding the same rounded K/V, the int8kv kernels called "
        "for every layer and step. A refused model gets a typed `UnsupportedAttention` naming what is missing and "
        "is left exactly as it was. Where the drop-in works, the engine runs the same model (the Works table's "
        "last column); a crash or wrong output there is the model type's outcome.",
        "",
        "| outcome | model types |",
        "|---|---|",
    ]
    lines += [f"| {k} | {len(v)} |" for k, v in by.items() if v]
    lines += [
        "",
        "## Works",
        "",
        "Layer kinds: `full`, `sliding` (window), `chunked` attention layers hold their K/V in int8kv; `state`: "
        "linear-attention, Mamba or conv layers kept as transformers' own layer classes; `shared`: layers without "
        "K/V of their own.",
        "",
        "The engine column: `int8kv.engine.LLM` on the same model object, the batch's two prompts unpadded (16 and "
        "12 tokens) side by side with chunked prefill; `works` when its greedy tokens and top log-probabilities "
        "follow transformers' at F16 and the fake-quantized reference at INT8, else the engine's typed refusal "
        "(after which the model gives its original output).",
        "",
        "| model type | layer kinds | engine |",
        "|---|---|---|",
    ]
    lines += [f"| `{o.model_type}` | {o.detail} | {o.engine.replace('|', '/')} |" for o in by["works"]]
    titles = (
        ("refused", "Refused"), ("no attention", "No attention layers at this size (nothing for int8kv to store)"),
        ("crash", "Crash"), ("wrong", "Wrong"), ("skipped", "Skipped"),
    )  # fmt: skip
    for kind, title in titles:
        if by[kind]:
            lines += ["", f"## {title}", "", "| model type | why |", "|---|---|"]
            lines += [f"| `{o.model_type}` | {o.detail.replace('|', '/')} |" for o in by[kind]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    found = []
    start = sys.argv[sys.argv.index("--from") + 1] if "--from" in sys.argv else ""  # a partial run, not written
    for row in run_all(start=start):
        print(f"{row.model_type:28} {row.kind:8} {row.detail} {row.engine}", flush=True)
        found.append(row)
    if "--no-write" not in sys.argv and not start:
        DOC.write_text(render(found))
