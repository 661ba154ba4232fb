"""int8kv: INT8 KV-cache storage for LLM inference.

The core (formats, codec, caches, paged ops, save/load) imports only torch, numpy and safetensors;
`int8kv.hf` (transformers drop-in), `int8kv.engine` and `int8kv.models` add transformers. Every name here loads
on first use, so importing the package alone imports neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import engine, hf, models
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

__version__ = "0.1.0"

# Before any kernel module loads numba: INT8KV_CPU=avx2 sets numba's target (int8kv.cpu_target), numba's pool
# is sized to the CPUs the process may use (affinity, cgroup quota: int8kv.cpu_budget), and the tbb wheel's library
# is loaded so that numba's threads run on tbb, which a process can fork (int8kv.tbb_layer).
from .cpu_budget import apply_budget as _apply_cpu_budget  # noqa: E402
from .cpu_target import apply_switch as _apply_cpu_switch  # noqa: E402
from .tbb_layer import load_tbb as _load_tbb  # noqa: E402

_apply_cpu_switch()
_apply_cpu_budget()
_load_tbb()

# Every public name loads on first use (PEP 562), from the module that defines it: `import int8kv.bench.gpu_check`
# or `int8kv.errors` then costs no torch import (2.4 s of CPU on the 2-core dev VM, paid by each child process
# such a tool starts).
_ERRORS = (
    "CapacityExceeded", "HeadOutOfRange", "InvalidModelError", "KvCacheError", "KvPoolExhausted", "LayerOutOfRange",
    "ModelNotFoundError", "NonFiniteError", "PositionOutOfRange", "ShapeMismatch", "StoreError", "UnknownBackend",
    "UnknownSequence", "UnsupportedAttention", "UnsupportedModel",
)
_HOME = {
    **dict.fromkeys(("KvLayout", "KvPool", "PagedKvCache", "QuantizedKvCache", "QuantizedKvLayer"), "cache"),
    "BlockAllocator": "cache.allocator",
    "dequantize_int8": "codec",
    "quantize_int8": "codec",
    **dict.fromkeys(_ERRORS, "errors"),
    "KvStorageFormat": "formats",
    **dict.fromkeys(("AttentionPlan", "append_paged_kv", "attention", "paged_decode_attention",
                     "paged_prefill_attention", "paged_write", "plan_attention"), "ops"),
    **dict.fromkeys(("inspect_kv", "load_kv", "model_fingerprint", "save_kv"), "store"),
}
_SUBMODULES = ("hf", "engine", "models")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
