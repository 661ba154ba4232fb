"""int8kv: INT8 KV-cache storage for LLM inference.

The core (formats, codec, caches, paged ops, save/load) imports only torch, numpy and safetensors.
`int8kv.hf` (transformers drop-in), `int8kv.engine` and `int8kv.models` load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cache import KvLayout, KvPool, PagedKvCache, QuantizedKvCache, QuantizedKvLayer
from .cache.allocator import BlockAllocator
from .codec import dequantize_int8, quantize_int8
from .errors import (
    CapacityExceeded,
    HeadOutOfRange,
    InvalidModelError,
    KvCacheError,
    KvPoolExhausted,
    LayerOutOfRange,
    ModelNotFoundError,
    NonFiniteError,
    PositionOutOfRange,
    ShapeMismatch,
    StoreError,
    UnknownBackend,
    UnknownSequence,
    UnsupportedAttention,
    UnsupportedModel,
)
from .formats import KvStorageFormat
from .ops import (
    AttentionPlan,
    append_paged_kv,
    attention,
    paged_decode_attention,
    paged_prefill_attention,
    paged_write,
    plan_attention,
)
from .store import inspect_kv, load_kv, model_fingerprint, save_kv

if TYPE_CHECKING:
    from . import engine, hf, models

__version__ = "0.1.0"
_LAZY = ("hf", "engine", "models")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionPlan",
    "BlockAllocator",
    "CapacityExceeded",
    "HeadOutOfRange",
    "InvalidModelError",
    "KvCacheError",
    "KvLayout",
    "KvPool",
    "KvPoolExhausted",
    "KvStorageFormat",
    "LayerOutOfRange",
    "ModelNotFoundError",
    "NonFiniteError",
    "PagedKvCache",
    "PositionOutOfRange",
    "QuantizedKvCache",
    "QuantizedKvLayer",
    "ShapeMismatch",
    "StoreError",
    "UnknownBackend",
    "UnknownSequence",
    "UnsupportedAttention",
    "UnsupportedModel",
    "append_paged_kv",
    "attention",
    "dequantize_int8",
    "engine",
    "hf",
    "inspect_kv",
    "load_kv",
    "models",
    "model_fingerprint",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_write",
    "plan_attention",
    "quantize_int8",
    "save_kv",
]
