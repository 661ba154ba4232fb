"""Two small value types every cache, the store and the engine share.

``KvLayout``: the shape of a KV cache independent of how it is held, ``(num_layers, num_kv_heads, head_dim,
format)``, with the sizing helpers (bytes per row / token / block, blocks that fit a budget).

``KvState``: a cache's stored K/V as plain CPU tensors, whatever cache it came from or goes to (mlx-lm's
``state``): each cache exports one (``export_state``) and imports one (``import_state``) through a validated
public method that changes nothing on error, so save/load and block stores never touch a cache's internals.

Tensor layout of a state (per layer ``l``, ``B = batch``, ``T = length``, ``H = num_kv_heads``, ``D = head_dim``):
  k_codes[l], v_codes[l]    [B, T, H, D]  int8 (INT8) | float16 (F16), CPU, contiguous
  k_scales[l], v_scales[l]  [B, T, H]     float32 (INT8); the lists are None for F16
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShapeMismatch
from ..formats import KvStorageFormat


def as_format(value: KvStorageFormat | str) -> KvStorageFormat:
    """A format from itself, its stable name (``"int8_per_token_head_f32_scale_v1"``) or a dtype alias."""
    if isinstance(value, KvStorageFormat):
        return value
    try:
        return KvStorageFormat.parse(str(value))
    except ValueError:
        return KvStorageFormat.from_dtype(str(value))


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShapeMismatch(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class KvLayout:
    """Shape and format of a KV cache: every sizing question is answered here, once."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _positive_int(getattr(self, name), name)
        object.__setattr__(self, "format", as_format(self.format))

    @classmethod
    def from_config(cls, config: Any, format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1):
        """Layout of a transformers decoder config (head_dim defaults to hidden / heads)."""
        from ..models.config import kv_dims

        return cls(*kv_dims(config), as_format(format))

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    @property
    def bytes_per_row(self) -> int:
        """One (token, KV head) of K or of V in one layer: codes plus the scale."""
        return self.format.bytes_per_row(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """One token across all layers, K and V, codes and scales."""
        return self.format.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        return _positive_int(block_size, "block_size") * self.bytes_per_token

    def blocks_for_memory(self, memory_bytes: int, block_size: int) -> int:
        """Whole blocks of ``block_size`` tokens that fit in ``memory_bytes`` (0 if none)."""
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
            raise ShapeMismatch(f"memory_bytes must be an int, got {memory_bytes!r}")
        return max(0, memory_bytes // self.bytes_per_block(block_size))

    def tokens_for_memory(self, memory_bytes: int, block_size: int = 16) -> int:
        return self.blocks_for_memory(memory_bytes, block_size) * block_size

    def with_format(self, format: KvStorageFormat | str) -> KvLayout:
        return KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, as_format(format))


@dataclass(frozen=True)
class KvState:
    """Stored K/V of ``batch`` sequences of ``length`` tokens in ``layout``: CPU tensors, layout above.

    Construct through :meth:`build`, which checks every shape and dtype; a state that exists is consistent.
    Values are not range-checked here (a cache's own writer produced them); readers of untrusted bytes check
    values before building one (see int8kv.store).
    """

    layout: KvLayout
    batch: int
    length: int
    k_codes: tuple[torch.Tensor, ...]
    v_codes: tuple[torch.Tensor, ...]
    k_scales: tuple[torch.Tensor, ...] | None
    v_scales: tuple[torch.Tensor, ...] | None

    @classmethod
    def build(
        cls,
        layout: KvLayout,
        k_codes: Any,
        v_codes: Any,
        k_scales: Any = None,
        v_scales: Any = None,
    ) -> KvState:
        """Check and normalise (detached, CPU, contiguous) per-layer tensors into a state."""
        fmt = layout.format
        groups = [("k_codes", k_codes), ("v_codes", v_codes)]
        if fmt.is_quantized:
            if k_scales is None or v_scales is None:
                raise ShapeMismatch(f"format {fmt.value} needs k_scales and v_scales")
            groups += [("k_scales", k_scales), ("v_scales", v_scales)]
        elif k_scales is not None or v_scales is not None:
            raise ShapeMismatch(f"format {fmt.value} stores no scales")
        first = k_codes[0] if isinstance(k_codes, (list, tuple)) and k_codes else None
        if not isinstance(first, torch.Tensor) or first.dim() != 4:
            raise ShapeMismatch("k_codes must be a non-empty list of [batch, length, heads, dim] tensors")
        batch, length = int(first.shape[0]), int(first.shape[1])
        code_shape = (batch, length, layout.num_kv_heads, layout.head_dim)
        out: dict[str, tuple[torch.Tensor, ...]] = {}
        for name, tensors in groups:
            if not isinstance(tensors, (list, tuple)) or len(tensors) != layout.num_layers:
                raise ShapeMismatch(f"{name} must hold one tensor per layer ({layout.num_layers})")
            shape = code_shape if "codes" in name else code_shape[:3]
            dtype = fmt.code_dtype if "codes" in name else torch.float32
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                    got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ShapeMismatch(f"{name}[{i}] must be {dtype} {shape}, got {got}")
            out[name] = tuple(t.detach().to("cpu").contiguous() for t in tensors)
        return cls(
            layout, batch, length, out["k_codes"], out["v_codes"], out.get("k_scales"), out.get("v_scales")
        )

    @property
    def format(self) -> KvStorageFormat:
        return self.layout.format

    @staticmethod
    def check_single(state: object, layout: KvLayout, owner: str) -> KvState:
        """``state`` as a batch-1 state of ``layout``, or ShapeMismatch naming ``owner`` (the importing cache)."""
        if not isinstance(state, KvState):
            raise ShapeMismatch(f"expected a KvState, got {type(state).__name__}")
        if state.layout != layout:
            raise ShapeMismatch(f"the state's layout {state.layout} differs from the cache's {layout}")
        if state.batch != 1:
            raise ShapeMismatch(f"{owner} holds one sequence; the state holds {state.batch}")
        return state

    def slice(self, start: int, end: int) -> KvState:
        """Positions ``[start, end)`` of every sequence (views, no copy)."""
        if not 0 <= start <= end <= self.length:
            raise ShapeMismatch(f"slice [{start}, {end}) outside [0, {self.length})")

        def cut(group: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
            return None if group is None else tuple(t[:, start:end] for t in group)

        return KvState(
            self.layout, self.batch, end - start,
            cut(self.k_codes), cut(self.v_codes), cut(self.k_scales), cut(self.v_scales),  # type: ignore[arg-type]
        )

    def equal(self, other: KvState) -> bool:
        """Bit-exact equality of layout, sizes and every tensor."""
        if (self.layout, self.batch, self.length) != (other.layout, other.batch, other.length):
            return False
        pairs = [(self.k_codes, other.k_codes), (self.v_codes, other.v_codes)]
        if self.k_scales is not None and other.k_scales is not None:
            pairs += [(self.k_scales, other.k_scales), (self.v_scales, other.v_scales)]  # type: ignore[list-item]
        return all(torch.equal(a, b) for x, y in pairs for a, b in zip(x, y, strict=True))

