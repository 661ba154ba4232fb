"""``Q4WState``: the exported state of ``int4_kchan64_vtok_asym_sink4_win64_v1`` (int8kv.quant4w), what
:class:`~int8kv.cache.state.KvState` is for the per-row formats.

A row of this format has no stored form of its own: what ``n`` positions store (sealed 64-position blocks, the
F16 sinks and the F16 window) is a function of the inputs and ``n`` alone (:func:`int8kv.quant4w.encode_sequence`),
so a state is ``batch`` sequences of one length ``n``, per layer their :class:`~int8kv.quant4w.Q4WRows` stacked
over the batch. Importing it into a fresh cache and continuing gives exactly the stored form (and tokens) of never
stopping; a slice of it (positions ``[start, end)`` other than ``[0, n)``) is no stored form and does not exist.

Arrays (numpy, read-only, C-contiguous; ``L`` layers, ``B = batch``, ``H`` KV heads, ``d`` head_dim, ``c =
sealed_blocks(n)``, ``s = min(n, 4)``, ``r`` the window's positions ``[max(64 c, s), n)``), in this order (the
KV file's tensor order, :data:`TENSOR_NAMES`):

  k_codes  uint8   [L, B, c, 64, H, d / 2]     v_codes  uint8   [L, B, c, 64, H, d / 2]
  k_scale  float16 [L, B, c, H, d]             v_scale  float16 [L, B, c, 64, H]
  k_min    float16 [L, B, c, H, d]             v_min    float16 [L, B, c, 64, H]
  k_sink   float16 [L, B, s, H, d]             v_sink   float16 [L, B, s, H, d]
  k_window float16 [L, B, r, H, d]             v_window float16 [L, B, r, H, d]

(K's five, then V's five.) Built only through :meth:`Q4WState.of` (per layer, per sequence ``Q4WRows``: what a
cache exports) or :meth:`Q4WState.from_arrays` (the stacked arrays: what a KV file holds), which check every
name, dtype and shape against ``n`` and every value (:func:`int8kv.quant4w.rows_problem`) before building
anything: a state that exists is one the encoder writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ..errors import InvalidKvState, ShapeMismatch
from ..formats import KvStorageFormat
from ..quant4w import BLOCK, Q4WRows, f16_positions, rows_problem, sealed_blocks
from .state import KvLayout

__all__ = ["Q4W", "TENSOR_NAMES", "Q4WState", "row_shapes", "rows_shape_problem"]

Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
TENSOR_NAMES = tuple(f.name for f in fields(Q4WRows))  # k_codes, k_scale, k_min, k_sink, k_window, v_...
_U8, _F16 = np.dtype(np.uint8), np.dtype(np.float16)


def row_shapes(n: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Dtype and shape of each :class:`Q4WRows` array of one sequence of ``n`` positions (module docs, without
    the ``[L, B]`` axes), in :data:`TENSOR_NAMES` order."""
    c, (sinks, window) = sealed_blocks(n), f16_positions(n)
    H, d = num_kv_heads, head_dim
    codes, k_group, v_group = (c, BLOCK, H, d // 2), (c, H, d), (c, BLOCK, H)
    shapes = {"codes": (_U8, codes), "sink": (_F16, (len(sinks), H, d)), "window": (_F16, (len(window), H, d))}
    out = {}
    for side, group in (("k", k_group), ("v", v_group)):
        for part in ("codes", "scale", "min", "sink", "window"):
            out[f"{side}_{part}"] = shapes.get(part, (_F16, group))
    return out


def rows_shape_problem(rows: Q4WRows, n: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why ``rows`` is not one sequence's stored form of ``n`` positions by dtype and shape (:func:`row_shapes`),
    or None."""
    for name, (dtype, shape) in row_shapes(n, num_kv_heads, head_dim).items():
        a = getattr(rows, name)
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            return f"{name} of {n} positions must be {dtype} {shape}, got {got}"
    return None


def _length(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShapeMismatch(f"length must be an int >= 0, got {value!r}")
    return value


def _array(x: object, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu").numpy()
    if not isinstance(x, np.ndarray):
        raise ShapeMismatch(f"{what} must be a numpy array or a tensor, got {type(x).__name__}")
    return x


@dataclass(frozen=True, eq=False)
class Q4WState:
    """Stored form of ``batch`` sequences of ``length`` positions in ``layout`` (module docs): ``arrays`` maps
    each of :data:`TENSOR_NAMES` to one ``[num_layers, batch, ...]`` array. Construct through :meth:`of` or
    :meth:`from_arrays`."""

    layout: KvLayout
    batch: int
    length: int
    arrays: Mapping[str, np.ndarray]

    @classmethod
    def of(cls, layout: KvLayout, rows: Sequence[Sequence[Q4WRows]]) -> Q4WState:
        """A state from one :class:`Q4WRows` per layer and sequence (``rows[layer][b]``, every sequence of one
        length): checked as :meth:`from_arrays` checks, nothing built on error."""
        if not isinstance(rows, (list, tuple)) or not rows or not all(
                isinstance(r, (list, tuple)) and r and all(isinstance(x, Q4WRows) for x in r) for r in rows):
            raise ShapeMismatch("rows must hold, per layer, a non-empty list of Q4WRows (one per sequence)")
        batch = len(rows[0])
        if any(len(r) != batch for r in rows):
            raise ShapeMismatch(f"every layer holds the same sequences: got {[len(r) for r in rows]}")
        lengths = {len(x) for r in rows for x in r}
        if len(lengths) != 1:
            raise ShapeMismatch(f"the sequences of a state share one length, got {sorted(lengths)}")
        n = lengths.pop()
        _check_layout(layout, len(rows))
        for i, r in enumerate(rows):
            for b, x in enumerate(r):
                problem = rows_shape_problem(x, n, layout.num_kv_heads, layout.head_dim)
                if problem is not None:
                    raise ShapeMismatch(f"layer {i}, sequence {b}: {problem}")
        arrays = {name: np.stack([np.stack([getattr(x, name) for x in r]) for r in rows]) for name in TENSOR_NAMES}
        return cls._checked(layout, batch, n, arrays)

    @classmethod
    def from_arrays(cls, layout: KvLayout, batch: int, length: int, arrays: Mapping[str, Any]) -> Q4WState:
        """A state from the stacked ``[num_layers, batch, ...]`` arrays (numpy or CPU tensors) of every name in
        :data:`TENSOR_NAMES` (module docs). Every name, dtype and shape is checked against ``length``, then every
        sequence's values (:func:`int8kv.quant4w.rows_problem`): ShapeMismatch / InvalidKvState, nothing built."""
        n = _length(length)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ShapeMismatch(f"batch must be a positive int, got {batch!r}")
        _check_layout(layout, None)
        if not isinstance(arrays, Mapping) or set(arrays) != set(TENSOR_NAMES):
            got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__
            raise ShapeMismatch(f"a {Q4W.value} state holds the arrays {list(TENSOR_NAMES)}, got {got}")
        lead = (layout.num_layers, batch)
        out = {}
        for name, (dtype, shape) in row_shapes(n, layout.num_kv_heads, layout.head_dim).items():
            a = _array(arrays[name], name)
            if a.dtype != dtype or a.shape != (*lead, *shape):
                raise ShapeMismatch(f"{name} of {n} positions must be {dtype} {(*lead, *shape)}, got {a.dtype} "
                                    f"{a.shape}")
            out[name] = a
        return cls._checked(layout, batch, n, out)

    @classmethod
    def _checked(cls, layout: KvLayout, batch: int, n: int, arrays: dict[str, np.ndarray]) -> Q4WState:
        """Values of every (layer, sequence) checked, then the state built on owned read-only copies."""
        for layer in range(layout.num_layers):
            for b in range(batch):
                problem = rows_problem(Q4WRows(**{name: arrays[name][layer, b] for name in TENSOR_NAMES}))
                if problem is not None:
                    raise InvalidKvState(f"layer {layer}, sequence {b} is not a stored form of the {Q4W.value} "
                                         f"format: {problem}")
        owned = {}
        for name in TENSOR_NAMES:
            a = np.array(arrays[name], order="C", copy=True)
            a.flags.writeable = False
            owned[name] = a
        return cls(layout, batch, n, MappingProxyType(owned))

    # -- what callers of a KvState read too ------------------------------------------------------------
    @property
    def format(self) -> KvStorageFormat:
        return self.layout.format

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        return (self.layout,)

    @property
    def sections(self) -> tuple[Q4WState, ...]:
        return (self,)

    def rows(self, layer: int, b: int = 0) -> Q4WRows:
        """The stored form of sequence ``b`` in ``layer`` (read-only views)."""
        if not (0 <= layer < self.layout.num_layers and 0 <= b < self.batch):
            raise ShapeMismatch(f"(layer, sequence) ({layer}, {b}) outside ({self.layout.num_layers}, {self.batch})")
        return Q4WRows(**{name: self.arrays[name][layer, b] for name in TENSOR_NAMES})

    def sequence(self, b: int = 0) -> tuple[Q4WRows, ...]:
        """Sequence ``b``'s stored form in every layer."""
        return tuple(self.rows(layer, b) for layer in range(self.layout.num_layers))

    def layer_tensors(self, name: str) -> tuple[torch.Tensor, ...]:
        """Array ``name`` as one CPU tensor per layer, ``[batch, ...]`` (copies: the arrays stay read-only)."""
        return tuple(torch.from_numpy(np.array(a)) for a in self.arrays[name])

    def equal(self, other: object) -> bool:
        """Bit-exact equality of layout, sizes and every array."""
        if not isinstance(other, Q4WState):
            return False
        if (self.layout, self.batch, self.length) != (other.layout, other.batch, other.length):
            return False
        return all(np.array_equal(self.arrays[n].view(np.uint8), other.arrays[n].view(np.uint8))
                   for n in TENSOR_NAMES)


def _check_layout(layout: object, num_layers: int | None) -> None:
    if not isinstance(layout, KvLayout) or layout.format is not Q4W:
        got = layout.format.value if isinstance(layout, KvLayout) else type(layout).__name__
        raise ShapeMismatch(f"a Q4WState's layout is of the {Q4W.value} format, got {got}")
    if layout.head_dim % 2:
        raise ShapeMismatch(f"4-bit rows need an even head_dim, got {layout.head_dim}")
    if num_layers is not None and num_layers != layout.num_layers:
        raise ShapeMismatch(f"the layout has {layout.num_layers} layers, the rows {num_layers}")
