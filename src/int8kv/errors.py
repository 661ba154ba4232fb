"""Typed errors. Every error int8kv raises on bad input is a `KvCacheError`."""

from __future__ import annotations


class KvCacheError(Exception):
    """Base class of every int8kv error about caches, formats and files."""


class NonFiniteError(KvCacheError, ValueError):
    """Input holds NaN or +-inf, or a value that overflows float16."""


class LayerOutOfRange(KvCacheError, IndexError):
    """A layer index is outside [0, num_layers), or a per-layer list has the wrong length."""


class PositionOutOfRange(KvCacheError, IndexError):
    """A token position is outside the stored prefix."""


class HeadOutOfRange(KvCacheError, IndexError):
    """A KV-head index is outside [0, num_kv_heads)."""


class CapacityExceeded(KvCacheError):
    """An append would go past the preallocated capacity."""


class ShapeMismatch(KvCacheError, ValueError):
    """A tensor's shape or dtype does not fit the cache it is meant for."""


class InvalidRequest(KvCacheError, ValueError):
    """A generation request the engine refuses before queueing it: a prompt that is empty, holds a token id
    that is not an int in [0, vocab_size), or with max_tokens runs past the model's positions; or bad
    sampling parameters."""


class InvalidEngineConfig(KvCacheError, ValueError):
    """An engine setting that cannot work: a non-positive size or count, or a memory budget that is not a
    finite, non-negative number of bytes."""


class KvPoolExhausted(KvCacheError):
    """The paged block pool has too few free blocks for the request."""


class UnknownSequence(KvCacheError, KeyError):
    """A sequence id is not (or no longer) registered with the allocator."""


class PrefixKeyError(KvCacheError, ValueError):
    """Prefix-cache block keys that do not fit: a key that is not bytes, more keys than full blocks, a block
    already registered under another key, or a token id that is not an int in [0, 2**64)."""


class StoreError(KvCacheError):
    """A saved KV file cannot be read: corrupt, truncated, or for another model."""


class ModelNotFoundError(KvCacheError, FileNotFoundError):
    """The model path does not exist, or the packaged default model is not installed."""


class InvalidModelError(KvCacheError, ValueError):
    """The path exists but holds no loadable model (not a GGUF file, no config.json, or a failed load)."""


class UnsupportedAttention(KvCacheError, NotImplementedError):
    """The model asks for an attention variant the int8kv kernels do not implement."""


class AttentionBypassed(UnsupportedAttention):
    """A model computed attention around the int8kv attention function: it operated on the K/V handles a
    cache returned, or wrote a layer's K/V without the int8kv attention reading them."""


class UnsupportedFormat(KvCacheError, NotImplementedError):
    """A storage format a backend has no kernels for (int8kv.formats: its ``kernel`` name), refused by name."""


class InvalidKvState(KvCacheError, ValueError):
    """A stored form a format's encoder never writes (a NaN, inf or negative scale, a non-finite F16 row, bytes
    where the format stores zeros): refused when a state is built, so no cache ever holds it."""


class UnknownBackend(KvCacheError, ValueError):
    """A kernel backend name that is not one of int8kv.ops.BACKENDS."""


class UnsupportedModel(KvCacheError, NotImplementedError):
    """A model (architecture, layer kind or config field) the engine does not implement, refused by name."""


class UnsupportedWeights(KvCacheError, ValueError):
    """A weight precision that is not one of int8kv.models.weights.WEIGHTS, or that cannot hold this model's
    weights (int8 off the CPU, Linear layers already converted to another precision, non-float weights)."""
