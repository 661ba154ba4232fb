"""The storage formats, defined once: one :class:`KvFormat` object per format, found by its stable name.

A format says how one row (one token, one KV head, ``head_dim`` values) is stored: the tensors it keeps per
row (its :class:`Part` s: a name, a dtype and a trailing shape that is a function of ``head_dim``), how rows
are encoded into them and decoded back, which stored values are legal (what a reader of untrusted bytes
checks), and the bytes a row and a token take. Everything else (pools, states, files, block values, the CLI's
choices, the backends' dispatch) iterates over a format's parts; docs/design.md, "Storage formats", lists
what a new format touches.

Names are stable: they are written into files, block values and configs and must never change. The public
:class:`KvStorageFormat` enum names the registered formats; ``fmt.spec`` is the member's format object.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .codec import dequantize_int8, quantize_int8, quantize_int8_store, round_to_f16
from .errors import ShapeMismatch


@dataclass(frozen=True)
class Part:
    """One tensor a format stores per row: ``name`` (``"codes"``, ``"scales"``), its dtype, its trailing
    shape for a given ``head_dim`` (``(head_dim,)`` for codes, ``()`` for one scale per row, ``(head_dim // 2,)``
    for two 4-bit codes per byte) and the value fresh storage holds (never garbage: a kernel multiplying a
    masked lane by 0 must not meet NaN)."""

    name: str
    dtype: torch.dtype
    row_shape: Callable[[int], tuple[int, ...]]
    fill: float = 0.0
    # One per block and KV head instead of one per row (a per-channel key scale over a sealed block): the
    # tensor is [num_blocks, num_kv_heads, *shape] in a pool.
    per_block: bool = False

    def shape(self, head_dim: int) -> tuple[int, ...]:
        return tuple(self.row_shape(head_dim))

    def row_bytes(self, head_dim: int) -> int:
        return math.prod(self.shape(head_dim)) * self.dtype.itemsize


def _per_value(head_dim: int) -> tuple[int, ...]:
    return (head_dim,)


def _per_row(head_dim: int) -> tuple[int, ...]:
    return ()


class KvFormat:
    """A storage format. Subclasses set the class attributes and implement encode, _decode (called by decode once
    the part count is checked) and value_problem.

    ``parts`` are in the order :meth:`encode` returns them (and the pool, a state and a kernel receive them);
    ``wire_order`` is the order files and block values lay them out (part names; K before V within a part).
    ``kernel`` names the attention kernels that read the parts (each backend maps it to its kernel; a kernel
    name a backend does not know is refused by name, so a new format never runs through another's kernels).
    """

    name: str
    version: int
    parts: tuple[Part, ...]
    wire_order: tuple[str, ...]
    kernel: str
    #: What a position is stored as depends on the sequence's length (pages sealed as it grows), not on the row
    #: alone: only the format's own pool holds it; row-by-row consumers refuse it (:meth:`refuse_stateful`).
    stateful = False

    def __repr__(self) -> str:
        return f"<KvFormat {self.name} v{self.version}>"

    def refuse_stateful(self, what: str) -> None:
        """UnsupportedFormat naming the format if it is :attr:`stateful` (``what``: the consumer refusing it)."""
        if self.stateful:
            from .errors import UnsupportedFormat

            raise UnsupportedFormat(f"{what} does not hold the {self.name} format: its pages are sealed as a "
                                    "sequence grows, which only its own pool (the engine's paged cache) implements")

    # -- the codec -----------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``x [..., head_dim]`` (float32/float16/bfloat16, any device) as one tensor per part,
        ``[..., *part.shape(head_dim)]``; NaN/inf and out-of-domain inputs raise typed errors."""
        raise NotImplementedError

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_dst: Sequence[torch.Tensor],
              v_dst: Sequence[torch.Tensor], arrays: tuple | None = None) -> None:
        """Encode K and V rows ``[n, heads, head_dim]`` and store them at int64 ``slots [n]`` of ``k_dst`` /
        ``v_dst`` (one tensor per part, ``[S, heads, *part.shape(head_dim)]``); nothing is stored if encoding
        fails. One :meth:`encode` call for K and V: at decode (a few rows per layer) the per-call overhead is
        the cost. ``arrays``: the destinations as numpy views (K's parts then V's, ``KvPool.row_arrays``), or
        None; a format may use them instead of viewing the tensors itself."""
        parts = self.encode(torch.stack((k, v)))
        for dst, side in ((k_dst, 0), (v_dst, 1)):
            for t, part in zip(dst, parts, strict=True):
                t.index_copy_(0, slots, part[side])

    def compiled_store(self) -> Callable | None:
        """The format's compiled encode-and-store of rows on the CPU, for callers that hold numpy views (a decode
        step's few rows, where the per-call overhead is the cost), or None: :meth:`store` serves every caller.
        ``fn(k, v, slots, *dst) -> int``: ``k, v`` float32 C-contiguous ``[n, heads, head_dim]``, ``slots`` int64
        ``[n]``, ``dst`` the destination parts as numpy views, K's then V's (``KvPool.row_arrays``); returns the
        count of rows it refuses (V1: not finite in float16), storing nothing when that is not 0. What it stores
        is :meth:`store`'s, bit for bit."""
        return None

    def compiled_views(self, arrays: tuple) -> tuple:
        """The pool's numpy views (``KvPool.row_arrays``) as :meth:`compiled_store` takes them: as they are,
        unless the format's dtypes are ones numba cannot type (F16: its float16 codes, as uint16 bits)."""
        return arrays

    def decode(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stored parts (as :meth:`encode` returns them, any leading shape) as float32 rows ``[..., head_dim]``."""
        if not isinstance(parts, (tuple, list)) or len(parts) != len(self.parts):
            raise ShapeMismatch(f"{self.name} decodes one tensor per part {self.part_names}")
        return self._decode(*parts)

    def _decode(self, *parts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def value_problem(self, tensor: str, values: np.ndarray) -> str | None:
        """Why ``values`` (any shape, numpy) of the tensor named ``tensor`` (``k_<part>`` or ``v_<part>``, see
        :meth:`tensor_names`) are not ones :meth:`encode` produces, or None. Readers of untrusted bytes (files,
        block values) refuse such values: they would poison attention (inf keys, huge scales, codes outside the
        range)."""
        raise NotImplementedError

    # -- names and sizes -----------------------------------------------------------------------------------
    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} stores no part {name!r}; it stores {self.part_names}")

    def tensor_names(self) -> tuple[str, ...]:
        """``k_<part>``, ``v_<part>`` in wire order: the tensors of a file and of a block value's payload."""
        return tuple(f"{side}_{name}" for name in self.wire_order for side in ("k", "v"))

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes of one (token, KV head) of K or of V: every part of the row."""
        return sum(p.row_bytes(head_dim) for p in self.parts)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies across all layers, keys and values together."""
        return 2 * num_layers * num_kv_heads * self.bytes_per_row(head_dim)

    def check_parts(self, parts: object, lead: tuple[int, ...], head_dim: int, what: str) -> tuple[torch.Tensor, ...]:
        """``parts`` as a tuple of tensors of this format with leading shape ``lead`` (one per part, right dtype
        and shape, one device), or ShapeMismatch naming ``what``."""
        if not isinstance(parts, (tuple, list)) or len(parts) != len(self.parts):
            raise ShapeMismatch(f"{what} must be one tensor per part {self.part_names} of {self.name}")
        out = []
        for p, t in zip(self.parts, parts, strict=True):
            want = (*lead, *p.shape(head_dim))
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != p.dtype:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeMismatch(f"{what} {p.name} must be {p.dtype} {want}, got {got}")
            if out and t.device != out[0].device:
                raise ShapeMismatch(f"{what} parts are on {out[0].device} and {t.device}")
            out.append(t)
        return tuple(out)


class F16Format(KvFormat):
    """Rows rounded to float16 (round to nearest even); NaN, inf and |x| > 65504 refused."""

    name = "f16"
    version = 1
    parts = (Part("codes", torch.float16, _per_value),)
    wire_order = ("codes",)
    kernel = "f16"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (round_to_f16(x),)

    def compiled_store(self) -> Callable:
        from . import _codec_cpu  # numba: imported with the first CPU pool that writes this way

        return _codec_cpu.f16_store  # torch's float16 rounding, bit for bit (tests/test_codec.py)

    def compiled_views(self, arrays: tuple) -> tuple:
        return tuple(a.view(np.uint16) for a in arrays)  # numba has no float16 on the CPU

    def _decode(self, *parts: torch.Tensor) -> torch.Tensor:
        return parts[0].to(torch.float32)

    def value_problem(self, tensor: str, values: np.ndarray) -> str | None:
        # float16 NaN and inf are the values whose five exponent bits are all set: an integer test on the bits
        # (numpy's float16 isfinite converts each value first).
        bits = np.ascontiguousarray(values).view(np.uint16)
        if ((bits & 0x7C00) == 0x7C00).any():
            return f"{tensor} holds NaN or inf, which the F16 format never stores"
        return None


class Int8V1Format(KvFormat):
    """The frozen V1 codec (int8kv.codec): int8 codes in [-127, 127] per value, one float32 scale per row."""

    name = "int8_per_token_head_f32_scale_v1"
    version = 1
    parts = (Part("codes", torch.int8, _per_value), Part("scales", torch.float32, _per_row, fill=1.0))
    wire_order = ("scales", "codes")
    kernel = "int8"
    # The largest scale the encoder writes: float32(65504 / 127), from a row whose max |x| is float16's max
    # (larger inputs are refused as overflowing float16), computed the encoder's way (float32 division).
    # Smaller positive scales all occur (subnormal rows).
    SCALE_MAX = float(torch.tensor(65504.0, dtype=torch.float32) / 127)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize_int8(x)

    def store(self, k, v, slots, k_dst, v_dst, arrays=None) -> None:
        # A decode step's rows on the CPU: encode and store in one kernel call (codec.quantize_int8_store).
        if not quantize_int8_store(k, v, slots, k_dst, v_dst, arrays=arrays):
            super().store(k, v, slots, k_dst, v_dst)

    def compiled_store(self) -> Callable:
        from . import _codec_cpu  # numba: imported with the first CPU pool that writes this way

        return _codec_cpu.quantize_store  # what quantize_int8_store calls: the same codes and scales

    def _decode(self, *parts: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(*parts)

    def value_problem(self, tensor: str, values: np.ndarray) -> str | None:
        # numpy, not torch: on a busy machine torch's threaded reductions pay thread start-up under contention,
        # far more than the reductions on one chunk.
        if values.size == 0:
            return None
        if tensor.endswith("scales"):
            # NaN fails both comparisons (min/max propagate it), so this also refuses NaN.
            if not (values.min() > 0 and values.max() <= self.SCALE_MAX):
                return f"{tensor} holds a scale outside (0, 65504/127] (not finite, not positive, or above V1's top)"
        elif values.min() == -128:
            return f"{tensor} holds -128, outside the V1 code range [-127, 127]"
        return None


def _half(head_dim: int) -> tuple[int, ...]:
    return (head_dim // 2,)


class Int4SinkWindowFormat(KvFormat):
    """``int4_kchan64_vtok_asym_sink4_win64_v1`` (int8kv.quant4w; docs/kv_file_format.md): rows enter as F16
    rows (:meth:`encode`, the sinks and the window) and pages of 64 positions are sealed into 4-bit codes with
    per-channel key scales (:meth:`seal`) once 64 positions follow them. A stateful format: its pool is
    :class:`int8kv.cache.pool_q4w.Int4SinkWindowPool`, whose writes take the step's plan.

    Registered (``KvStorageFormat.INT4_SINK_WINDOW_V1``) and ``stateful``: only that pool and its owners (the
    engine's cache, int8kv.cache.paged_q4w; the transformers drop-in) hold it, its states are
    :class:`int8kv.cache.state_q4w.Q4WState` (whole sequences' stored forms, which KV files hold); every row-by-row
    consumer of a member (the plain pool, ``KvState``, the contiguous cache, block values) refuses it by name
    (UnsupportedFormat)."""

    name = "int4_kchan64_vtok_asym_sink4_win64_v1"
    version = 1
    kernel = "int4_sink_window"
    stateful = True
    page = 64  # positions per block: a key group's span (docs/kv_file_format.md, "In the paged cache")
    sinks = 4
    window = 64
    # What encode returns and what the F16 side of the pool holds: the rows rounded to float16.
    parts = (Part("rows", torch.float16, _per_value),)
    wire_order = ("rows",)
    # A sealed page, per side, in seal's order.
    k_page_parts = (
        Part("codes", torch.uint8, _half),
        Part("scale", torch.float16, _per_value, per_block=True),
        Part("min", torch.float16, _per_value, per_block=True),
    )
    v_page_parts = (
        Part("codes", torch.uint8, _half),
        Part("scale", torch.float16, _per_row),
        Part("min", torch.float16, _per_row),
    )

    @property
    def spec(self) -> KvFormat:  # a pool's ``format.spec`` / ``format.value``, as for the enum's members
        return self

    @property
    def value(self) -> str:
        return self.name

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (round_to_f16(x),)

    def _decode(self, *parts: torch.Tensor) -> torch.Tensor:
        return parts[0].to(torch.float32)

    def seal(self, k16: torch.Tensor, v16: torch.Tensor, first: bool) -> tuple[tuple[torch.Tensor, ...], ...]:
        """One page's F16 rows ``[64, H, d]`` of keys and values -> ``(k_parts, v_parts)`` of the sealed page
        (:data:`k_page_parts` / :data:`v_page_parts`, on the rows' device); ``first``: the sequence's first page,
        whose rows 0-3 are the sinks. Bit for bit :func:`int8kv.quant4w.seal_block`, which it runs."""
        from .quant4w import seal_block

        out = seal_block(k16.cpu().numpy().astype("float32"), v16.cpu().numpy().astype("float32"), first)
        parts = tuple(torch.from_numpy(a).to(k16.device) for a in out)
        return parts[:3], parts[3:]

    def value_problem(self, tensor: str, values: np.ndarray) -> str | None:
        from .quant4 import value_problem as scale_problem

        side, _, part = tensor.partition("_")
        if part in ("scale", "min"):
            scale = values if part == "scale" else np.zeros(0, np.float16)
            mn = values if part == "min" else np.zeros(0, np.float16)
            problem = scale_problem(np.ascontiguousarray(scale), np.ascontiguousarray(mn))
            return None if problem is None else f"{tensor}: {problem}"
        if part in ("rows", "sink", "window"):  # F16 rows: the pool's, a state's sinks and window
            return F16.value_problem(tensor, values)
        if part == "codes":
            return None if values.dtype == np.uint8 else f"{tensor} must be uint8, got {values.dtype}"
        return f"{self.name} stores no tensor {tensor!r}"

    def bytes_per_page(self, head_dim: int) -> int:
        """Bytes of one sealed page of one KV head, keys and values: codes, the keys' channel scales and
        minimums, the values' per-position scales and minimums (``68 d + 256``)."""
        return sum(
            math.prod(p.shape(head_dim)) * p.dtype.itemsize * (1 if p.per_block else self.page)
            for p in (*self.k_page_parts, *self.v_page_parts)
        )

    def bytes_per_row(self, head_dim: int) -> float:  # type: ignore[override]
        """A sealed K row and V row's mean (``(17 d / 16 + 4) / 2``; not an integer when ``d`` is not a multiple
        of 16), so that :meth:`bytes_per_token` is the long-context cost, the F16 rows left out."""
        return self.bytes_per_page(head_dim) / (2 * self.page)

    def stored_bytes(self, length: int, head_dim: int) -> int:
        """Bytes the stored form of a sequence of ``length`` positions takes per layer and KV head, the F16 sinks
        and window included (:func:`int8kv.quant4w.stored_bytes`)."""
        from .quant4w import stored_bytes

        return stored_bytes(length, head_dim)

    def peak_bytes(self, length: int, head_dim: int) -> int:
        """The most :meth:`stored_bytes` takes at any length up to ``length``: it drops when a page is sealed,
        so a sequence's peak sits at its last length before a seal (``64 b + 127``) or at ``length`` itself."""
        last = (length - 127) // self.page * self.page + 127 if length >= 127 else -1  # latest pre-seal length
        return max(self.stored_bytes(length, head_dim), self.stored_bytes(last, head_dim) if last >= 0 else 0)

    def tokens_for_memory(self, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """The longest sequence that grows to its length within ``budget_bytes`` over ``num_layers`` x
        ``num_kv_heads`` (:meth:`peak_bytes`, sinks and window included): the figure the demo prints beside
        ``PagedKvCache.tokens_for_memory``'s for F16 and INT8."""
        heads = num_layers * num_kv_heads
        lo, hi = 0, 1
        while heads * self.peak_bytes(hi, head_dim) <= budget_bytes:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # peak_bytes never falls as the length grows: the largest fitting one, by bisection
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if heads * self.peak_bytes(mid, head_dim) <= budget_bytes else (lo, mid)
        return lo


F16 = F16Format()
INT8_V1 = Int8V1Format()
INT4_SINK_WINDOW_V1 = Int4SinkWindowFormat()
_REGISTRY: dict[str, KvFormat] = {}


def register(fmt: KvFormat) -> KvFormat:
    """Add a format to the registry under its stable name (refused if the name is taken)."""
    if fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise ValueError(f"a KV storage format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


for _fmt in (F16, INT8_V1, INT4_SINK_WINDOW_V1):
    register(_fmt)


def get_format(name: str) -> KvFormat:
    """The registered format of stable name ``name``, or ValueError listing the accepted names."""
    fmt = _REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"unknown KV storage format {name!r}; accepted: {', '.join(_REGISTRY)}")
    return fmt


def format_names() -> tuple[str, ...]:
    """The stable names of every registered format (the CLI's ``--kv-format`` choices)."""
    return tuple(_REGISTRY)


class KvStorageFormat(str, enum.Enum):
    """The registered formats by stable name; ``.spec`` is the member's :class:`KvFormat`."""

    F16 = F16Format.name
    INT8_PER_TOKEN_HEAD_F32_SCALE_V1 = Int8V1Format.name
    INT4_SINK_WINDOW_V1 = Int4SinkWindowFormat.name

    def as_str(self) -> str:
        return self.value

    def __str__(self) -> str:
        return self.value

    @property
    def spec(self) -> KvFormat:
        return _REGISTRY[self.value]

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
        if key in _INT4_ALIASES:
            return cls.INT4_SINK_WINDOW_V1
        accepted = ", ".join(sorted(_F16_ALIASES | _INT8_ALIASES | _INT4_ALIASES))
        raise ValueError(f"unsupported KV cache dtype {name!r}; accepted: {accepted}")

    # -- the format object's answers, for the callers that hold a member (encode and decode: ``.spec``, as
    # ``str.encode`` is the member's own) ------------------------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        """Whether rows are stored lossily beyond float16 rounding (every format but F16)."""
        return self is not KvStorageFormat.F16

    @property
    def is_stateful(self) -> bool:
        """Whether the format's stored form depends on the sequence's length (:attr:`KvFormat.stateful`)."""
        return self.spec.stateful

    @property
    def version(self) -> int:
        return self.spec.version

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.spec.parts

    def bytes_per_row(self, head_dim: int) -> int:
        return self.spec.bytes_per_row(head_dim)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies across all layers, keys and values together."""
        return self.spec.bytes_per_token(num_layers, num_kv_heads, head_dim)


_F16_ALIASES = frozenset({"auto", "fp16", "float16", "half", "f16"})
_INT8_ALIASES = frozenset({"int8"})
_INT4_ALIASES = frozenset({"int4"})
