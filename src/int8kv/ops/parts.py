"""How a format's parts reach the CPU and Triton kernels, which read two formats (int8kv.formats ``kernel``):
``"int8"`` (V1: int8 codes and one float32 scale per row) and ``"f16"`` (float16 codes, no scales). Both take
each of K and V as a (codes, scales-or-None) pair; a format with other parts brings its own kernels and its
own entry here."""

from __future__ import annotations

import torch

from ..formats import KvStorageFormat

KERNELS = frozenset({"f16", "int8"})


def codes_and_scales(fmt: KvStorageFormat, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One side's parts as the kernels' pair: V1's (int8 codes, float32 scales), F16's (float16 codes, None)."""
    return (parts[0], parts[1]) if int8_codes(fmt) else (parts[0], None)


def int8_codes(fmt: KvStorageFormat) -> bool:
    """Whether the codes are V1 int8 with a scale per row (the integer q . k path and the scale folding apply)."""
    return fmt.spec.kernel == "int8"
