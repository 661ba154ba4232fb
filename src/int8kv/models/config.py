"""What a transformers config says about the KV cache's shape."""

from __future__ import annotations

from typing import Any


def kv_dims(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config; head_dim defaults to hidden / heads."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim
