"""Contiguous multi-layer cache for simple decoders: push a step, read rows back.

Storage per layer is token-major, so a decode step appends one contiguous slab: one tensor per part of the
format (int8kv.formats), for K and for V, ``[capacity, num_kv_heads, *part.shape(head_dim)]`` (V1: int8 codes
``[.., head_dim]`` and float32 scales ``[..]``; F16: float16 codes).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import (
    CapacityExceeded,
    HeadOutOfRange,
    KvCacheError,
    LayerOutOfRange,
    PositionOutOfRange,
    ShapeMismatch,
)
from ..formats import KvStorageFormat
from .state import KvLayout, KvState

Rows = torch.Tensor  # [tokens, num_kv_heads, head_dim]
Encoded = tuple[torch.Tensor, ...]  # one tensor per part of the format


def checked_index(value: object, what: str, error: type[KvCacheError]) -> int:
    """``value`` as a Python int, or ``error``: an index is an int, a numpy integer or a 0-d integer tensor.

    A bool is refused (torch would take it as a mask and return a batch of rows), and so are floats, None,
    and tensors that are not 0-d integers; the range is the caller's to check.
    """
    refused = isinstance(value, bool | np.bool_) or (
        isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool or value.is_meta)
    )
    if not refused:
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise error(f"{what} must be an int (or a 0-d integer tensor), got {type(value).__name__} {value!r}")


class QuantizedKvLayer:
    """One layer's K and V: only codes and scales are held, never a float copy."""

    def __init__(
        self,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        device: torch.device | str = "cpu",
    ) -> None:
        capacity = checked_index(capacity, "capacity", ShapeMismatch)
        num_kv_heads = checked_index(num_kv_heads, "num_kv_heads", ShapeMismatch)
        head_dim = checked_index(head_dim, "head_dim", ShapeMismatch)
        if capacity < 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise ShapeMismatch(
                f"capacity >= 0, num_kv_heads > 0 and head_dim > 0 required, "
                f"got {capacity}, {num_kv_heads}, {head_dim}"
            )
        self.format = KvStorageFormat(format)
        self.format.spec.refuse_stateful("the contiguous cache")
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        lead = (capacity, num_kv_heads)

        def side() -> Encoded:
            return tuple(
                torch.full((*lead, *p.shape(head_dim)), p.fill, dtype=p.dtype, device=device) for p in self.format.parts
            )

        self.k_parts, self.v_parts = side(), side()
        self.seq_len = 0

    def _part(self, parts: Encoded, name: str) -> torch.Tensor | None:
        names = self.format.spec.part_names
        return parts[names.index(name)] if name in names else None

    # The V1-era names of the parts (None when the format stores no such part).
    @property
    def k_codes(self) -> torch.Tensor:
        return self._part(self.k_parts, "codes")  # type: ignore[return-value]

    @property
    def v_codes(self) -> torch.Tensor:
        return self._part(self.v_parts, "codes")  # type: ignore[return-value]

    @property
    def k_scales(self) -> torch.Tensor | None:
        return self._part(self.k_parts, "scales")

    @property
    def v_scales(self) -> torch.Tensor | None:
        return self._part(self.v_parts, "scales")

    # -- writing -----------------------------------------------------------------
    def as_rows(self, x: object, what: str) -> Rows:
        """Accept [H*D], [H, D] or [T, H, D] and return [T, H, D], detached (the cache stores values, not graphs)."""
        if isinstance(x, torch.Tensor):
            t = x.detach()
        else:
            try:
                t = torch.as_tensor(x)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ShapeMismatch(f"{what} must be a tensor or array, got {type(x).__name__}: {exc}") from None
        heads, dim = self.num_kv_heads, self.head_dim
        if t.dim() == 1 and t.shape[0] == heads * dim:
            return t.reshape(1, heads, dim)
        if t.dim() == 2 and tuple(t.shape) == (heads, dim):
            return t.unsqueeze(0)
        if t.dim() == 3 and tuple(t.shape[1:]) == (heads, dim):
            return t
        raise ShapeMismatch(
            f"{what} must be [{heads * dim}], [{heads}, {dim}] or [tokens, {heads}, {dim}], got {tuple(t.shape)}"
        )

    def encode_step(self, keys: object, values: object) -> tuple[Encoded, Encoded]:
        """Validate and encode without touching the cache (so a later failure changes nothing)."""
        k = self.as_rows(keys, "keys")
        v = self.as_rows(values, "values")
        if k.shape[0] != v.shape[0]:
            raise ShapeMismatch(f"keys have {k.shape[0]} tokens but values have {v.shape[0]}")
        if self.seq_len + k.shape[0] > self.capacity:
            raise CapacityExceeded(
                f"appending {k.shape[0]} token(s) to {self.seq_len} exceeds capacity {self.capacity}"
            )
        device = self.k_parts[0].device
        return self.format.spec.encode(k.to(device)), self.format.spec.encode(v.to(device))

    def commit(self, k: Encoded, v: Encoded) -> None:
        start, end = self.seq_len, self.seq_len + k[0].shape[0]
        for dst, src in zip((*self.k_parts, *self.v_parts), (*k, *v), strict=True):
            dst[start:end] = src
        self.seq_len = end

    def push(self, keys: object, values: object) -> None:
        self.commit(*self.encode_step(keys, values))

    # -- reading -----------------------------------------------------------------
    def check_row(self, token_pos: object, head: object) -> tuple[int, int]:
        """The checked (token position, head) of one stored row, as ints."""
        token_pos = checked_index(token_pos, "token position", PositionOutOfRange)
        head = checked_index(head, "head", HeadOutOfRange)
        if not 0 <= token_pos < self.seq_len:
            raise PositionOutOfRange(f"token position {token_pos} outside stored [0, {self.seq_len})")
        if not 0 <= head < self.num_kv_heads:
            raise HeadOutOfRange(f"head {head} outside [0, {self.num_kv_heads})")
        return token_pos, head

    def _decode(self, parts: Encoded, index: object) -> torch.Tensor:
        return self.format.spec.decode(tuple(t[index] for t in parts))

    def get_key(self, token_pos: int, head: int) -> torch.Tensor:
        """The decoded key row ``[head_dim]`` at (token_pos, head)."""
        return self._decode(self.k_parts, self.check_row(token_pos, head))

    def get_value(self, token_pos: int, head: int) -> torch.Tensor:
        """The decoded value row ``[head_dim]`` at (token_pos, head)."""
        return self._decode(self.v_parts, self.check_row(token_pos, head))

    def keys(self) -> torch.Tensor:
        return self._decode(self.k_parts, slice(0, self.seq_len))

    def values(self) -> torch.Tensor:
        return self._decode(self.v_parts, slice(0, self.seq_len))

    # -- accounting and rollback -------------------------------------------------
    def bytes_per_position(self) -> int:
        return 2 * self.num_kv_heads * self.format.bytes_per_row(self.head_dim)

    def memory_bytes(self) -> int:
        return self.seq_len * self.bytes_per_position()

    def fp32_memory_bytes(self) -> int:
        return self.seq_len * 2 * self.num_kv_heads * self.head_dim * 4

    def truncate(self, n: int) -> None:
        n = checked_index(n, "truncate length", PositionOutOfRange)
        if not 0 <= n <= self.seq_len:
            raise PositionOutOfRange(f"cannot truncate to {n}: stored length is {self.seq_len}")
        self.seq_len = n

    def reset(self) -> None:
        self.seq_len = 0


class QuantizedKvCache:
    """A multi-layer KV cache: one `QuantizedKvLayer` per transformer layer."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        device: torch.device | str = "cpu",
    ) -> None:
        num_layers = checked_index(num_layers, "num_layers", ShapeMismatch)
        if num_layers <= 0:
            raise ShapeMismatch(f"num_layers must be > 0, got {num_layers}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.format = KvStorageFormat(format)
        self.layers = [  # each layer refuses a stateful format (refuse_stateful) before it allocates
            QuantizedKvLayer(capacity, num_kv_heads, head_dim, self.format, device) for _ in range(num_layers)
        ]

    def __repr__(self) -> str:
        return (
            f"QuantizedKvCache(num_layers={self.num_layers}, capacity={self.capacity}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, format={self.format}, "
            f"seq_len={self.seq_len})"
        )

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len

    def layer(self, index: int) -> QuantizedKvLayer:
        index = checked_index(index, "layer", LayerOutOfRange)
        if not 0 <= index < self.num_layers:
            raise LayerOutOfRange(f"layer {index} outside [0, {self.num_layers})")
        return self.layers[index]

    def push_step(self, all_keys: Sequence[object], all_values: Sequence[object]) -> None:
        """Append one step (or several tokens) to every layer; on any error nothing changes.

        ``all_keys[i]``/``all_values[i]``: layer i's rows, ``[H*D]``, ``[H, D]`` or ``[tokens, H, D]``.
        Inputs that require grad are stored detached: pushing never builds an autograd graph.
        """
        if not all(isinstance(x, Sequence | torch.Tensor) for x in (all_keys, all_values)):
            raise ShapeMismatch(
                f"keys and values must be per-layer sequences, got {type(all_keys).__name__} and "
                f"{type(all_values).__name__}"
            )
        if len(all_keys) != self.num_layers or len(all_values) != self.num_layers:
            raise LayerOutOfRange(
                f"expected {self.num_layers} per-layer entries, got {len(all_keys)} keys and {len(all_values)} values"
            )
        encoded = [layer.encode_step(k, v) for layer, k, v in zip(self.layers, all_keys, all_values, strict=True)]
        tokens = {k[0].shape[0] for k, _ in encoded}
        if len(tokens) != 1:
            raise ShapeMismatch(f"every layer must append the same number of tokens, got {sorted(tokens)}")
        for layer, (k, v) in zip(self.layers, encoded, strict=True):
            layer.commit(k, v)

    def get_key(self, layer: int, token_pos: int, head: int) -> torch.Tensor:
        return self.layer(layer).get_key(token_pos, head)

    def get_value(self, layer: int, token_pos: int, head: int) -> torch.Tensor:
        return self.layer(layer).get_value(token_pos, head)

    def keys(self, layer: int) -> torch.Tensor:
        return self.layer(layer).keys()

    def values(self, layer: int) -> torch.Tensor:
        return self.layer(layer).values()

    def total_memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)

    def total_fp32_memory_bytes(self) -> int:
        return sum(layer.fp32_memory_bytes() for layer in self.layers)

    def compression_ratio(self) -> float:
        if self.seq_len == 0:
            fp32_row = self.head_dim * 4
            return fp32_row / self.format.bytes_per_row(self.head_dim)
        return self.total_fp32_memory_bytes() / self.total_memory_bytes()

    def truncate(self, n: int) -> None:
        n = checked_index(n, "truncate length", PositionOutOfRange)
        if not 0 <= n <= self.seq_len:
            raise PositionOutOfRange(f"cannot truncate to {n}: stored length is {self.seq_len}")
        for layer in self.layers:
            layer.truncate(n)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    # -- state (see cache/state.py) --------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.format)

    def export_state(self) -> KvState:
        """The stored tokens as a batch-1 :class:`KvState` (CPU copies)."""
        n = self.seq_len
        return KvState.from_layers(self.layout, [
            (tuple(t[:n].unsqueeze(0) for t in layer.k_parts), tuple(t[:n].unsqueeze(0) for t in layer.v_parts))
            for layer in self.layers
        ])  # fmt: skip

    def import_state(self, state: KvState) -> None:
        """Replace the contents with a batch-1 ``state``; on any error the cache is unchanged."""
        KvState.check_single(state, self.layout, "a QuantizedKvCache")
        if state.length > self.capacity:
            raise CapacityExceeded(f"the state holds {state.length} tokens but the capacity is {self.capacity}")
        n = state.length
        device = self.layers[0].k_parts[0].device
        # Moved to the device first so an out-of-memory there happens before the first layer changes.
        moved = [tuple(t[0].to(device) for side in state.layer(i) for t in side) for i in range(self.num_layers)]
        for layer, parts in zip(self.layers, moved, strict=True):
            for dst, src in zip((*layer.k_parts, *layer.v_parts), parts, strict=True):
                dst[:n] = src
            layer.seq_len = n
