"""int8kv: INT8 KV-cache storage for LLM inference."""

from .cache import QuantizedKvCache, QuantizedKvLayer
from .codec import dequantize_int8, quantize_int8
from .errors import (
    CapacityExceeded,
    HeadOutOfRange,
    KvCacheError,
    KvPoolExhausted,
    LayerOutOfRange,
    NonFiniteError,
    PositionOutOfRange,
    ShapeMismatch,
    StoreError,
    UnknownSequence,
)
from .formats import KvStorageFormat

__version__ = "0.1.0"

__all__ = [
    "CapacityExceeded",
    "HeadOutOfRange",
    "KvCacheError",
    "KvPoolExhausted",
    "KvStorageFormat",
    "LayerOutOfRange",
    "NonFiniteError",
    "PositionOutOfRange",
    "QuantizedKvCache",
    "QuantizedKvLayer",
    "ShapeMismatch",
    "StoreError",
    "UnknownSequence",
    "dequantize_int8",
    "quantize_int8",
]
