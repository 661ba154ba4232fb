"""Small helpers shared by the store's modules: canonical JSON, raw tensor bytes, int and size checks."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

# Any real dimension is far below this; it keeps forged integers away from float-precision and overflow edges.
MAX_DIM = 1 << 40
HEX64 = re.compile(r"[0-9a-f]{64}")


def canonical(obj: Any) -> bytes:
    """The one JSON encoding the store writes and accepts: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (CPU, contiguous), as a flat byte view."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def short(value: object, limit: int = 80) -> str:
    """repr() cut to ``limit`` characters: forged headers must not produce megabyte-long error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def int8kv_cache_class() -> type | None:
    """``int8kv.hf.Int8KvCache``, or None when transformers (an optional dependency int8kv.hf needs) is not
    installed: then no Int8KvCache can exist. Imported on call, so the store does not import transformers."""
    try:
        from ..hf import Int8KvCache
    except ImportError:
        return None
    return Int8KvCache
