"""The storage formats, defined once.

A format says how one row (one token, one KV head, ``head_dim`` values) is stored.
Names are stable: they are written into files and configs and must never change.
"""

from __future__ import annotations

import enum

import torch


class KvStorageFormat(str, enum.Enum):
    F16 = "f16"
    INT8_PER_TOKEN_HEAD_F32_SCALE_V1 = "int8_per_token_head_f32_scale_v1"

    def as_str(self) -> str:
        return self.value

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> KvStorageFormat:
        for fmt in cls:
            if fmt.value == name:
                return fmt
        accepted = ", ".join(f.value for f in cls)
        raise ValueError(f"unknown KV storage format {name!r}; accepted: {accepted}")

    @classmethod
    def default(cls) -> KvStorageFormat:
        return cls.F16

    @classmethod
    def from_dtype(cls, name: str) -> KvStorageFormat:
        """Map a serving-config cache dtype (``"auto"``, ``"fp16"``, ``"int8"`` ...) to a format."""
        key = str(name).strip().lower()
        if key in _F16_ALIASES:
            return cls.F16
        if key in _INT8_ALIASES:
            return cls.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
        accepted = ", ".join(sorted(_F16_ALIASES | _INT8_ALIASES))
        raise ValueError(f"unsupported KV cache dtype {name!r}; accepted: {accepted}")

    @property
    def is_quantized(self) -> bool:
        return self is KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1

    @property
    def version(self) -> int:
        return 1

    @property
    def code_dtype(self) -> torch.dtype:
        """dtype of the stored element codes."""
        return torch.int8 if self.is_quantized else torch.float16

    @property
    def bytes_per_element(self) -> int:
        return 1 if self.is_quantized else 2

    @property
    def bytes_per_row_overhead(self) -> int:
        """Bytes stored per (token, KV head) besides the elements: the float32 scale."""
        return 4 if self.is_quantized else 0

    def bytes_per_row(self, head_dim: int) -> int:
        return head_dim * self.bytes_per_element + self.bytes_per_row_overhead

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies across all layers, keys and values together."""
        return 2 * num_layers * num_kv_heads * self.bytes_per_row(head_dim)


_F16_ALIASES = frozenset({"auto", "fp16", "float16", "half", "f16"})
_INT8_ALIASES = frozenset({"int8"})
