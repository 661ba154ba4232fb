"""Two small value types every cache, the store and the engine share.

``KvLayout``: the shape of a KV cache independent of how it is held, ``(num_layers, num_kv_heads, head_dim,
format)``, with the sizing helpers (bytes per row / token / block, blocks that fit a budget).

``KvState``: a cache's stored K/V as plain CPU tensors, whatever cache it came from or goes to (mlx-lm's
``state``): each cache exports one (``export_state``) and imports one (``import_state``) through a validated
public method that changes nothing on error, so save/load and block stores never touch a cache's internals.

Tensor layout of a state (per layer ``l``, ``B = batch``, ``T = length``, ``H = num_kv_heads``, ``D = head_dim``),
one entry per part of the format (int8kv.formats), CPU, contiguous:
  groups["k_<part>"][l], groups["v_<part>"][l]   [B, T, H, *part.shape(D)]
e.g. V1: k_codes/v_codes [B, T, H, D] int8 and k_scales/v_scales [B, T, H] float32; F16: k_codes/v_codes only.

``GroupedKvState``: the same for a model whose layers hold K/V of different shapes (Gemma 4: a larger head_dim on
its full-attention layers): one ``KvState`` section per group of layers sharing a ``(num_kv_heads, head_dim)``, in
order of first use, with the model layer each section's layers are (when the exporter knows it). A state of one
shape is always a plain ``KvState`` (``sections == (state,)``), so one-shape files and block values never change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
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
        # A stateful format's block holds a sealed page or F16 rows as its sequence grows: the engine sizes its
        # cache by page (int8kv.cache.paged_q4w), never by a bytes-per-block figure.
        self.format.spec.refuse_stateful("sizing by bytes per block")
        return _positive_int(block_size, "block_size") * self.bytes_per_token

    def blocks_for_memory(self, memory_bytes: int, block_size: int) -> int:
        """Whole blocks of ``block_size`` tokens that fit in ``memory_bytes`` (0 if none)."""
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
            raise ShapeMismatch(f"memory_bytes must be an int, got {memory_bytes!r}")
        return max(0, memory_bytes // self.bytes_per_block(block_size))

    def tokens_for_memory(self, memory_bytes: int, block_size: int = 16) -> int:
        """Token capacity of a pool of ``block_size`` blocks in ``memory_bytes``; for a stateful format (its blocks
        are 64 positions whatever ``block_size``), the longest one sequence that grows to its length within the
        budget, F16 sinks and window included (``Int4SinkWindowFormat.tokens_for_memory``)."""
        spec = self.format.spec
        if spec.stateful:
            if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
                raise ShapeMismatch(f"memory_bytes must be an int, got {memory_bytes!r}")
            return spec.tokens_for_memory(memory_bytes, *self.dims)
        return self.blocks_for_memory(memory_bytes, block_size) * block_size

    def with_format(self, format: KvStorageFormat | str) -> KvLayout:
        return KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, as_format(format))


@dataclass(frozen=True, eq=False)
class KvState:
    """Stored K/V of ``batch`` sequences of ``length`` tokens in ``layout``: CPU tensors, layout above.

    ``groups`` maps each of the format's tensor names (``k_<part>``, ``v_<part>``, in wire order:
    ``fmt.spec.tensor_names()``) to one tensor per layer, ``[batch, length, num_kv_heads, *part.shape(D)]``.
    Construct through :meth:`from_parts` (or :meth:`build`), which checks every shape and dtype; a state that
    exists is consistent. Values are not range-checked here (a cache's own writer produced them); readers of
    untrusted bytes check values before building one (see int8kv.store).
    """

    layout: KvLayout
    batch: int
    length: int
    groups: Mapping[str, tuple[torch.Tensor, ...]]

    @classmethod
    def from_parts(cls, layout: KvLayout, groups: Mapping[str, Any]) -> KvState:
        """Check and normalise (detached, CPU, contiguous) per-layer tensors, keyed by tensor name, into a state."""
        spec = layout.format.spec
        spec.refuse_stateful("KvState")  # a row's stored form depends on the sequence's length
        names = spec.tensor_names()
        if not isinstance(groups, Mapping) or set(groups) != set(names):
            got = sorted(groups) if isinstance(groups, Mapping) else type(groups).__name__
            raise ShapeMismatch(f"format {spec.name} stores the tensors {list(names)}, got {got}")
        first = groups[names[0]][0] if isinstance(groups[names[0]], (list, tuple)) and groups[names[0]] else None
        if not isinstance(first, torch.Tensor) or first.dim() < 3:
            raise ShapeMismatch(f"{names[0]} must be a non-empty list of [batch, length, heads, ...] tensors")
        batch, length = int(first.shape[0]), int(first.shape[1])
        out: dict[str, tuple[torch.Tensor, ...]] = {}
        for name in names:
            tensors = groups[name]
            part = spec.part(name[2:])
            shape = (batch, length, layout.num_kv_heads, *part.shape(layout.head_dim))
            if not isinstance(tensors, (list, tuple)) or len(tensors) != layout.num_layers:
                raise ShapeMismatch(f"{name} must hold one tensor per layer ({layout.num_layers})")
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != part.dtype:
                    got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ShapeMismatch(f"{name}[{i}] must be {part.dtype} {shape}, got {got}")
            out[name] = tuple(t.detach().to("cpu").contiguous() for t in tensors)
        return cls(layout, batch, length, MappingProxyType({name: out[name] for name in names}))

    @classmethod
    def build(cls, layout: KvLayout, k_codes: Any, v_codes: Any, k_scales: Any = None, v_scales: Any = None) -> KvState:
        """:meth:`from_parts` for the two V1-era formats, whose parts are codes (and scales)."""
        given = {"k_codes": k_codes, "v_codes": v_codes, "k_scales": k_scales, "v_scales": v_scales}
        return cls.from_parts(layout, {name: t for name, t in given.items() if t is not None})

    @classmethod
    def from_layers(cls, layout: KvLayout, layers: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]):
        """A state from per-layer ``(k_parts, v_parts)`` (each one ``[batch, length, heads, ...]`` tensor per part,
        in the format's part order): what a cache exports."""
        parts = layout.format.spec.part_names
        return cls.from_parts(layout, {
            f"{side}_{name}": [layer[s][j] for layer in layers]
            for j, name in enumerate(parts) for s, side in enumerate("kv")
        })  # fmt: skip

    @property
    def format(self) -> KvStorageFormat:
        return self.layout.format

    def layer(self, layer: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(k_parts, v_parts)`` of one layer, in the format's part order: the inverse of :meth:`from_layers`."""
        parts = self.layout.format.spec.part_names
        return tuple(self.groups[f"k_{p}"][layer] for p in parts), tuple(self.groups[f"v_{p}"][layer] for p in parts)

    # The V1-era names: None when the format stores no such part.
    @property
    def k_codes(self) -> tuple[torch.Tensor, ...] | None:
        return self.groups.get("k_codes")

    @property
    def v_codes(self) -> tuple[torch.Tensor, ...] | None:
        return self.groups.get("v_codes")

    @property
    def k_scales(self) -> tuple[torch.Tensor, ...] | None:
        return self.groups.get("k_scales")

    @property
    def v_scales(self) -> tuple[torch.Tensor, ...] | None:
        return self.groups.get("v_scales")

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
        cut = {name: tuple(t[:, start:end] for t in group) for name, group in self.groups.items()}
        return KvState(self.layout, self.batch, end - start, MappingProxyType(cut))

    def equal(self, other: KvState) -> bool:
        """Bit-exact equality of layout, sizes and every tensor."""
        if (self.layout, self.batch, self.length) != (other.layout, other.batch, other.length):
            return False
        pairs = ((a, b) for name, group in self.groups.items() for a, b in zip(group, other.groups[name], strict=True))
        return all(torch.equal(a, b) for a, b in pairs)

    # One section: what code iterating a GroupedKvState's sections sees for a one-shape state.
    @property
    def sections(self) -> tuple[KvState, ...]:
        return (self,)

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        return (self.layout,)


def group_layers(shapes: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """The layers of each group of equal ``(num_kv_heads, head_dim)`` in ``shapes`` (one per layer), groups in order
    of first use: the grouping every multi-shape cache uses (one pool per group, a layer's index within its group
    its rank among the group's layers)."""
    order: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        order.setdefault(tuple(shape), []).append(i)  # type: ignore[arg-type]
    return tuple(tuple(layers) for layers in order.values())


def layer_map_problem(counts: Sequence[int], layers: Sequence[Sequence[object]]) -> str | None:
    """Why ``layers`` is not the model layers of groups of ``counts`` layers (ascending within a group, the groups
    in order of their first layer, together exactly ``0 .. sum(counts) - 1``), or None."""
    if [len(g) if isinstance(g, (list, tuple)) else -1 for g in layers] != list(counts):
        return f"groups of {list(counts)} layers"
    flat = [i for g in layers for i in g]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in flat):
        return "layer numbers are ints"
    if sorted(flat) != list(range(len(flat))):  # type: ignore[type-var]
        return f"every layer 0..{len(flat) - 1} once"
    if any(list(g) != sorted(g) for g in layers) or [g[0] for g in layers] != sorted(g[0] for g in layers):
        return "ascending within a group, the groups in order of their first layer"
    return None


@dataclass(frozen=True, eq=False)
class GroupedKvState:
    """Stored K/V of a cache whose layers fall in several sections: one batch-1-or-more :class:`KvState` each.

    ``sections``: at least two, one format, equal batch and length, in the cache's section order: one per pool of
    a shape (Gemma 4), or one per block table of a cache whose attention spans keep separate tables (a
    Gemma-3-like model's sliding and full layers: sections of one shape). ``layers``: for each section, the model
    layers its layers are (ascending, the sections ordered by their first layer, together exactly
    ``0 .. num_layers - 1``), or None when the exporter does not know them (a paged cache knows its pools, not the
    model's layer numbers). Construct through :meth:`of`.
    """

    sections: tuple[KvState, ...]
    layers: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def of(cls, sections: Sequence[KvState], layers: Sequence[Sequence[int]] | None = None) -> GroupedKvState:
        """Check the sections (and the layer map) against each other."""
        if not isinstance(sections, (list, tuple)) or len(sections) < 2 or not all(
            isinstance(s, KvState) for s in sections
        ):
            raise ShapeMismatch("a grouped state holds two or more KvState sections (one shape is a plain KvState)")
        first = sections[0]
        for s in sections[1:]:
            if (s.format, s.batch, s.length) != (first.format, first.batch, first.length):
                raise ShapeMismatch(
                    f"the sections of a grouped state share format, batch and length: {first.format.value} "
                    f"{first.batch} x {first.length} and {s.format.value} {s.batch} x {s.length}"
                )
        kept = None
        if layers is not None:
            kept = tuple(tuple(group) for group in layers) if isinstance(layers, (list, tuple)) else None
            counts = [s.layout.num_layers for s in sections]
            if kept is None or layer_map_problem(counts, kept) is not None:
                raise ShapeMismatch(
                    f"layers must give each section's model layers (ascending; the sections in order of their first "
                    f"layer; together 0..{sum(counts) - 1}) for sections of {counts} layers, got {layers!r}"
                )
        return cls(tuple(sections), kept)

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        return tuple(s.layout for s in self.sections)

    @property
    def format(self) -> KvStorageFormat:
        return self.sections[0].format

    @property
    def batch(self) -> int:
        return self.sections[0].batch

    @property
    def length(self) -> int:
        return self.sections[0].length

    @property
    def num_layers(self) -> int:
        return sum(la.num_layers for la in self.layouts)

    def slice(self, start: int, end: int) -> GroupedKvState:
        """Positions ``[start, end)`` of every sequence in every section (views, no copy)."""
        return GroupedKvState(tuple(s.slice(start, end) for s in self.sections), self.layers)

    def equal(self, other: object) -> bool:
        """Bit-exact equality of the layer map and of every section."""
        return (
            isinstance(other, GroupedKvState)
            and self.layers == other.layers
            and len(self.sections) == len(other.sections)
            and all(a.equal(b) for a, b in zip(self.sections, other.sections, strict=True))
        )


AnyKvState = KvState | GroupedKvState


def state_sections(state: object, layouts: Sequence[KvLayout], owner: str) -> tuple[KvState, ...]:
    """The sections of a batch-1 ``state`` for a cache of ``layouts`` (one per group), or ShapeMismatch naming
    ``owner``: a plain KvState for one layout, a GroupedKvState of exactly these layouts for several."""
    if len(layouts) == 1:
        return (KvState.check_single(state, layouts[0], owner),)
    if not isinstance(state, GroupedKvState):
        got = f"a KvState of {state.layout}" if isinstance(state, KvState) else type(state).__name__
        raise ShapeMismatch(f"{owner} holds {len(layouts)} groups of K/V shapes {list(layouts)}; got {got}")
    if state.layouts != tuple(layouts):
        raise ShapeMismatch(f"the state's groups {list(state.layouts)} differ from the cache's {list(layouts)}")
    if state.batch != 1:
        raise ShapeMismatch(f"{owner} holds one sequence; the state holds {state.batch}")
    return state.sections
