"""transformers drop-in: an INT8 (or F16) KV cache and the attention function that reads it.

    cache = Int8KvCache(model.config)                  # V1 INT8 storage; F16 with format=KvStorageFormat.F16
    out = model.generate(**inputs, cache=cache)       # ``past_key_values=`` works too (deprecated in 5.x)

Three modules, following transformers' own split:
  :mod:`int8kv.hf.layers`     which layers are full / sliding / chunked / state (from the config), and the
                              kernels' options (window, chunk, softcap, sinks) from an attention call's kwargs.
  :mod:`int8kv.hf.cache`      ``Int8KvCache`` (a ``transformers.Cache``) and ``Int8KvLayer`` (one layer's codes
                              and scales in a one-layer :class:`~int8kv.cache.pool.KvPool`); writes go through
                              the one write path, :mod:`int8kv.ops.write`. Hybrids' other layers are
                              transformers' own classes.
  :mod:`int8kv.hf.attention`  the ``"int8kv"`` attention function: plans once per forward and pattern (from the
                              attention masks) and runs the paged kernels on the stored codes.

How it fits into transformers 5.x: a decoder layer calls ``cache.update(k, v, layer_idx)`` and passes whatever
comes back, untouched, to ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. ``Int8KvCache.update``
encodes the new rows into its own storage and returns two *empty* tensors tagged with the layer. The
attention function registered here as ``"int8kv"`` recognises the tag and runs :mod:`int8kv.ops` on the
stored codes, so no dequantized copy of the context is ever built; any other use of the handles raises
:class:`~int8kv.errors.AttentionBypassed`. Untagged keys (any other cache, or no cache) go to the model's own
attention implementation (recorded when the cache attached), which makes the switch harmless for other caches;
a refusal puts the implementation back.

Why the constructor switches ``config._attn_implementation``: transformers reads the attention implementation
from the model's config at every forward, and ``Int8KvCache(model.config)`` receives that very object, so
setting it there is the one hook that makes ``generate(..., cache=Int8KvCache(cfg))`` work without a second
call. Pass ``attach=False`` to leave the config alone and call :func:`enable_int8kv_attention` yourself.
"""

from __future__ import annotations

from ..errors import AttentionBypassed, UnsupportedAttention
from .attention import (
    ATTN_IMPLEMENTATION,
    disable_int8kv_attention,
    enable_int8kv_attention,
    int8kv_attention_forward,
)
from .cache import Int8KvCache, Int8KvHybridLayer, Int8KvLayer
from .layers import AttentionOptions, LayerSpec, attention_options, layer_specs

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionBypassed",
    "AttentionOptions",
    "Int8KvCache",
    "Int8KvHybridLayer",
    "Int8KvLayer",
    "LayerSpec",
    "attention_options",
    "layer_specs",
    "UnsupportedAttention",
    "disable_int8kv_attention",
    "enable_int8kv_attention",
    "int8kv_attention_forward",
]
