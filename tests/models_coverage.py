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
* the int8kv kernels really called: every int8kv layer read once per forward.

Outcomes: ``works``; ``refused`` (an ``UnsupportedAttention`` naming what is missing, after which the model run
with its default cache gives its original logits: no side effects); ``crash`` (any other error); ``wrong``
(no error, wrong output, kernels not called, or a refusal that changed the model). The test
(tests/test_models_coverage.py) fails on any crash or wrong and checks that docs/models.md is what this finds.
"""

from __future__ import annotations

import math
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import int8kv.codec
from int8kv.errors import UnsupportedAttention
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
VOCAB = 256
PROMPT, PAD, NEW = 16, 4, 8
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
    eos_token_id=None, initializer_range=0.02,
)  # fmt: skip
DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


@dataclass
class Outcome:
    model_type: str
    kind: str  # works | refused | crash | wrong | skipped
    detail: str = ""


def candidate_types() -> list[str]:
    """Model types of the causal-LM mapping, minus composite (multimodal) configs and encoder-decoders."""
    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        cls = CONFIG_MAPPING[mt] if mt in CONFIG_MAPPING else None
        if cls is None or cls.sub_configs:
            continue  # multimodal families: their text configs are mapping entries of their own where they exist
        out.append(mt)
    return out


class _Timeout(BaseException):  # not an Exception: classify() must not take it for the model's error
    pass


def _alarm(*_):
    raise _Timeout("too slow to build")


def _attempts(model_type: str) -> Iterator[dict]:
    """Tiny settings to try, in order: as is; without ``head_dim`` (configs that derive it); with MLA's
    dimensions (DeepSeek-like configs); more layers (hybrids whose first layers hold no attention)."""
    yield dict(TINY)
    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}
    yield no_head_dim
    if hasattr(CONFIG_MAPPING[model_type], "kv_lora_rank"):
        yield {**TINY, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
               "v_head_dim": 16, "head_dim": 8}  # fmt: skip
    for layers in (4, 8):
        yield {**TINY, "num_hidden_layers": layers}


def build(model_type: str) -> torch.nn.Module | None:
    """The tiny model of ``model_type`` (None where transformers cannot build or run one this small)."""
    for kwargs in _attempts(model_type):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = CONFIG_MAPPING[model_type](**kwargs)
            if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_decoder", True):
                return None
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            _rescale(model)
            with torch.no_grad():
                reference(model)
            return model
        except Exception:  # noqa: BLE001 - this size does not build or run: try the next
            continue
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
        return int8kv.codec.decode(fmt, *int8kv.codec.encode(fmt, x)).to(x.dtype)

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


@torch.no_grad()
def _plain_logits(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = inputs()
    return model(ids, attention_mask=mask).logits


def classify(model_type: str, model: torch.nn.Module) -> Outcome:
    ref = reference(model)
    fake = generate(model, _fake_quant(DynamicCache(config=model.config), INT8))
    original = _plain_logits(model)
    for fmt, want in ((F16, ref), (INT8, fake)):
        try:
            cache = Int8KvCache(model.config, format=fmt)
            got = generate(model, cache)
        except UnsupportedAttention as e:
            after = _plain_logits(model)
            if not torch.equal(after, original):
                return Outcome(model_type, "wrong", f"refused ({e}) but the model's output changed afterwards")
            return Outcome(model_type, "refused", str(e).split("\n")[0])
        except Exception as e:  # noqa: BLE001 - the point is to classify whatever happens
            return Outcome(model_type, "crash", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        diff = compare(want, got)
        if diff:
            return Outcome(model_type, "wrong", f"{fmt.value}: {diff}")
        layers = cache.kv_layers()
        if not layers or any(la.attention_calls != NEW for la in layers):
            calls = [la.attention_calls for la in layers]
            return Outcome(model_type, "wrong", f"int8kv kernels not called once per forward: {calls}")
    kinds = sorted({spec.kind for spec in cache.specs or []})
    return Outcome(model_type, "works", ", ".join(kinds))


def run_all(seconds_per_model: int = 30) -> Iterator[Outcome]:
    transformers.logging.set_verbosity_error()
    warm = build("llama")  # compiles the kernels (or loads them from numba's cache) outside any model's time
    if warm is not None:
        classify("llama", warm)
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for mt in candidate_types():
            signal.alarm(seconds_per_model)
            try:
                model = build(mt)
                if model is None:
                    continue
                yield classify(mt, model)
            except _Timeout:
                yield Outcome(mt, "skipped", f"over {seconds_per_model} s on this machine")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def render(outcomes: list[Outcome]) -> str:
    by = {k: [o for o in outcomes if o.kind == k] for k in ("works", "refused", "crash", "wrong", "skipped")}
    lines = [
        "# Models: Int8KvCache across transformers' decoder architectures",
        "",
        f"Generated by `python tests/models_coverage.py` (transformers {transformers.__version__}); "
        "tests/test_models_coverage.py checks that this page is what it finds. Each decoder-only model type is "
        "built tiny (hidden 64, 2 layers or more until a hybrid has an attention layer, vocab 256, 4 heads / 2 "
        f"KV heads, peaked attention, non-zero biases) and generates {NEW} greedy tokens for a left-padded batch "
        f"of two {PROMPT}-token prompts: F16 storage against `DynamicCache`, INT8 against a `DynamicCache` "
        "holding the same rounded K/V, the int8kv kernels called for every layer and step. A refused model "
        "gets a typed `UnsupportedAttention` naming what is missing and is left exactly as it was.",
        "",
        "| outcome | model types |",
        "|---|---|",
    ]
    lines += [f"| {k} | {len(v)} |" for k, v in by.items() if v]
    lines += ["", "## Works", "", "| model type | layer kinds |", "|---|---|"]
    lines += [f"| `{o.model_type}` | {o.detail} |" for o in by["works"]]
    for kind, title in (("refused", "Refused"), ("crash", "Crash"), ("wrong", "Wrong"), ("skipped", "Skipped")):
        if by[kind]:
            lines += ["", f"## {title}", "", "| model type | why |", "|---|---|"]
            lines += [f"| `{o.model_type}` | {o.detail.replace('|', '/')} |" for o in by[kind]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    found = []
    for outcome in run_all():
        print(f"{outcome.model_type:28} {outcome.kind:8} {outcome.detail}", flush=True)
        found.append(outcome)
    if "--no-write" not in sys.argv:
        DOC.write_text(render(found))
