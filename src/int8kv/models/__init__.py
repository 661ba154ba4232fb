"""Offline model loading (packaged SmolLM2 GGUF, local .gguf files, local transformers directories); a GGUF file's
blocks run in place (gguf_weights.py)."""

from .config import kv_dims
from .gguf_weights import GgufEmbedding, GgufLinear
from .loader import (
    DEFAULT_GGUF_NAME,
    InvalidModelError,
    ModelNotFoundError,
    cache_root,
    default_gguf_path,
    gguf_cache_dir,
    load_model,
    model_config,
    model_dir,
    packaged_model_dir,
    packed_cache_dir,
)
from .packed import PackedLinear, pack_weights
from .weights import WEIGHTS, convert_weights

__all__ = [
    "WEIGHTS",
    "DEFAULT_GGUF_NAME",
    "GgufEmbedding",
    "GgufLinear",
    "InvalidModelError",
    "ModelNotFoundError",
    "PackedLinear",
    "cache_root",
    "convert_weights",
    "default_gguf_path",
    "gguf_cache_dir",
    "kv_dims",
    "load_model",
    "model_config",
    "model_dir",
    "pack_weights",
    "packaged_model_dir",
    "packed_cache_dir",
]
