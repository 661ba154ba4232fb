"""How each layer of a transformers model attends, from its config, and what the kernels take from a call.

    specs = layer_specs(model.config)                  # one LayerSpec per decoder layer (typed refusal otherwise)
    opts = attention_options(kwargs, specs[i])         # window / chunk / softcap / sinks for ops.attention

Shared by the drop-in cache (:mod:`int8kv.hf.cache`) and anything else that runs a transformers model's own
forward over int8kv storage (the engine's generic path). Nothing here holds state.

Layer kinds (``LayerSpec.kind``):
  ``"full"``      causal attention over every stored token;
  ``"sliding"``   query ``p`` sees keys in ``(p - window, p]`` (transformers' ``sliding_window``);
  ``"chunked"``   query ``p`` sees keys of its own chunk, ``k // chunk == p // chunk`` counted from the
                  sequence's first token (Llama 4's ``attention_chunk_size``);
  ``"state"``     no per-token K/V: a linear-attention, Mamba or conv state (transformers' own layer class);
  ``"shared"``    no storage of its own: reuses another layer's K/V, or has no attention ("moe", "mlp").
``LayerSpec.state`` is also true for transformers' ``"hybrid"`` / ``"hybrid_sliding"`` layers, which hold a
linear-attention state *and* full / sliding K/V.

The per-layer types come from transformers' own ``get_layer_types_and_kwargs`` (``layer_types``, or
``sliding_window`` / ``attention_chunk_size`` per layer config, KV sharing), so a config spells them the way
its ``DynamicCache`` reads them: Qwen2/Qwen3's ``use_sliding_window`` + ``max_window_layers`` and Gemma's
patterns are already folded into ``layer_types`` by the configs themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .. import ops
from ..errors import UnsupportedAttention

__all__ = [
    "AttentionOptions",
    "LayerSpec",
    "attention_options",
    "layer_specs",
    "unsupported_features",
]

# transformers' layer type -> (kind, holds a linear-attention state as well)
_KINDS: dict[str, tuple[str, bool]] = {
    "full_attention": ("full", False),
    "sliding_attention": ("sliding", False),
    "chunked_attention": ("chunked", False),
    "linear_attention": ("state", True),
    "conv": ("state", True),
    "hybrid": ("full", True),
    "hybrid_sliding": ("sliding", True),
    "dummy": ("shared", False),
}
# What transformers calls the layer types int8kv does not implement, for the refusal message.
_NAMED = {
    "indexed_attention": "DeepSeek sparse attention (an indexer cache)",
    "heavily_compressed_attention": "compressed attention (DeepSeek V4)",
    "compressed_sparse_attention": "compressed sparse attention (DeepSeek V4)",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: transformers' ``layer_type``, the int8kv ``kind``, its window or chunk, and
    ``layer_kwargs`` (what transformers passes to its own cache layer class for this type)."""

    layer_type: str
    kind: str
    window: int | None = None
    chunk: int | None = None
    state: bool = False
    layer_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def has_kv(self) -> bool:
        """Whether the layer stores per-token K/V (in int8kv)."""
        return self.kind in ("full", "sliding", "chunked")


@dataclass(frozen=True)
class AttentionOptions:
    """What one attention call asks of the kernels beyond causal attention (None: not used)."""

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_q_heads] sink logits

    @property
    def plain(self) -> bool:
        """Plain causal attention: no window, chunk, softcap or sinks."""
        return self.window is None and self.chunk is None and self.softcap is None and self.sinks is None

    def as_kwargs(self) -> dict[str, Any]:
        return {"window": self.window, "chunk": self.chunk, "softcap": self.softcap, "sinks": self.sinks}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedAttention(f"{what} must be a positive int, got {value!r}")
    return value


def _field(config: PreTrainedConfig, name: str) -> Any:
    """``config.name``, or the first layer's non-empty value where transformers keeps it per layer (and refuses
    the global read)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute guard
        layers = getattr(config, "per_layer_config", None) or []
        return next((v for la in layers if (v := getattr(la, name, None))), None)


def unsupported_features(config: PreTrainedConfig) -> list[str]:
    """Names of the attention features of ``config`` (a text config) the int8kv kernels do not implement."""
    found = []
    if any(_field(config, name) for name in ("kv_lora_rank", "q_lora_rank")):
        found.append("multi-head latent attention (MLA: kv_lora_rank)")
    attn_config = _field(config, "attn_config")  # MPT keeps its ALiBi flag there (an object or a dict)
    mpt_alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    if _field(config, "alibi") or mpt_alibi or getattr(config, "model_type", None) == "bloom":
        found.append("ALiBi position biases")
    return found


def layer_specs(config: PreTrainedConfig) -> list[LayerSpec]:
    """One :class:`LayerSpec` per decoder layer of ``config`` (a model's config or its text config).

    Raises :class:`UnsupportedAttention` naming the feature for a layer type or attention variant int8kv does
    not implement (MLA, ALiBi, sparse / compressed attention, an unknown layer type)."""
    text = config.get_text_config(decoder=True)
    missing = unsupported_features(text)
    if missing:
        raise UnsupportedAttention(f"the int8kv attention does not implement {', '.join(missing)}")
    try:
        types, kwargs = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError) as e:
        raise UnsupportedAttention(f"cannot read the layer types of this config: {e}") from e
    specs = []
    for i, (layer_type, kw) in enumerate(zip(types, kwargs, strict=True)):
        if layer_type not in _KINDS:
            what = _NAMED.get(layer_type, f"layer type {layer_type!r}")
            raise UnsupportedAttention(f"the int8kv attention does not implement {what} (layer {i})")
        kind, state = _KINDS[layer_type]
        window = chunk = None
        if kind == "sliding":
            window = _positive_int(kw.get("sliding_window"), f"layer {i}'s sliding_window")
        elif kind == "chunked":
            chunk = _positive_int(kw.get("sliding_window"), f"layer {i}'s attention_chunk_size")
        specs.append(LayerSpec(layer_type, kind, window, chunk, state, tuple(sorted(kw.items()))))
    return specs


# Tensor kwargs of transformers' attention calls that do not change what attention computes (positions for
# RoPE already applied, the cache's positions); any other tensor (a position bias, packed-sequence offsets,
# ...) is something the kernels would ignore, so it is refused by name.
_INERT_TENSORS = frozenset({"position_ids", "cache_position", "position_embeddings"})
_HANDLED = frozenset({"sliding_window", "softcap", "s_aux"})


def attention_options(kwargs: dict[str, Any], spec: LayerSpec | None = None) -> AttentionOptions:
    """The kernels' options for one call of a transformers attention function: ``sliding_window`` (else the
    layer's window), the layer's chunk, ``softcap`` and ``s_aux`` (attention sinks) from ``kwargs``.

    Any other tensor argument (``position_bias``, ``cu_seq_lens_q``, ...) is refused by name
    (:class:`UnsupportedAttention`). The attention mask stays the judge of the pattern: a caller checks it
    against these options (a model that passes no ``sliding_window`` kwarg but masks a window is caught there)."""
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in _INERT_TENSORS and name not in _HANDLED:
            raise UnsupportedAttention(f"the int8kv attention does not implement the {name!r} argument")
    window = kwargs.get("sliding_window")
    if window is None and spec is not None:
        window = spec.window
    if window is not None:
        window = _positive_int(int(window) if isinstance(window, torch.Tensor) else window, "sliding_window")
    chunk = spec.chunk if spec is not None else None
    softcap = kwargs.get("softcap")
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0 or softcap == float("inf"):
            raise UnsupportedAttention(f"softcap must be a finite positive number, got {softcap!r}")
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedAttention(f"s_aux (attention sinks) must be a [num_q_heads] tensor, got {got}")
    return AttentionOptions(window, chunk, softcap, sinks)


def prepared_attention(
    calls: dict, key: tuple, pool: Any, plan: Any, num_q_heads: int, backend: str | None, opts: AttentionOptions,
    sinks: torch.Tensor | None,
) -> ops.PreparedAttention:
    """``plan``'s attention over ``pool`` with ``opts`` (:class:`int8kv.ops.PreparedAttention`), kept in ``calls``
    under ``key`` for the layers that share it. ``sinks``: ``opts.sinks`` as the caller hands them to the kernels;
    a layer with sinks (its own tensor: gpt-oss ``s_aux``) prepares its own, never kept."""
    call = calls.get(key) if sinks is None else None
    if call is None:
        call = ops.PreparedAttention(
            pool, plan, num_q_heads, backend=backend, window=opts.window, chunk=opts.chunk, softcap=opts.softcap,
            sinks=sinks,
        )  # fmt: skip
        if sinks is None:
            calls[key] = call
    return call
