"""4-bit KV candidates on real weights: perplexity against a float32 cache, per-step top-1 agreement with F16
storage, bytes per token.

    python -m int8kv.bench kv4 [--text FILE ...] [--ctx 1024] [--windows 12] [--batch 4] [--chunk 256]
                               [--gen-tokens 128] [--prompts 4] [--agree-ctx 0] [--only NAME ...] [--model PATH]
                               [--json PATH]
    python -m int8kv.bench kv4 --combine PART.json ... [--json PATH]     (merge runs made side by side)

``--ctx 0`` runs the agreement alone, ``--prompts 0`` the perplexity alone (a process per text and group of
candidates, merged with ``--combine``: docs/archive/benchmarks-2026.md, "4-bit KV").

Every candidate is a fake-quantizing transformers cache: ``update`` stores ``decode(encode(K/V))`` and attention
reads those rows, so each figure is the storage's error alone (a kernel that reads the codes computes the same
attention up to float rounding). For the rotated candidates rotating K/V, quantizing and rotating back is the
same computation as rotating q and the output with the rows left rotated (the rotation is orthogonal).

Candidates that keep some rows in F16 (the block being filled, a recent window, the first positions) run on
:func:`mixed_attention`: the cache holds every row both in F16 and, once its block is sealed, quantized, and
each query reads each key as the decode step at that query would (a block is sealed by the query at its last
position, plus ``window``). So a prefill chunk of any length scores every token as decode would, and the
agreement is one teacher-forced forward.

Perplexity follows `int8kv eval`: windows of ``--ctx`` tokens, each fed in chunks through a fresh cache (batches
of ``--batch`` windows), the second half of each scored. Agreement: F16 storage generates ``--gen-tokens``
greedily from each prompt; every candidate is then fed the same tokens and its top-1 is compared at each step
(teacher forcing, so an early difference does not count twice).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..cli_common import bench_parser
from ..progress import Bar, note
from .timing import emit

EVAL_CORPUS = "common-licenses"  # the eval's default text (int8kv.eval.DEFAULT_TEXT_GLOB)
DEFAULT_TEXTS = (EVAL_CORPUS, "/usr/lib/python3.11/pydoc_data/topics.py")


def hadamard(d: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix of order ``d`` (a power of two), float32: orthogonal, symmetric."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(torch.float32)


def random_signs(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.float32)


@dataclass(frozen=True)
class Scheme:
    """One candidate. ``mode``: "sym" (codes -7..7, scale = absmax / 7), "sym16" (all 16 codes, levels
    (q + 0.5) * scale, q in -8..7, scale = absmax / 7.5), "asym" (codes 0..15, min + q * scale). ``clip``:
    the scale is the best of a grid of clipping ratios for each group's squared error. ``scale_bytes``: per
    group (4: float32 scale; 2: float16 scale; asym stores a float16 scale and a float16 minimum, 4)."""

    name: str
    group: int | None = None  # None: head_dim
    mode: str = "sym"
    rotate: bool = False
    signs: bool = False
    clip: bool = False
    scale_bytes: int = 4
    kivi: bool = False  # keys per channel over each sealed block (values per token); implies open_f16
    open_f16: bool = False  # the block being filled kept in F16, quantized once sealed
    block: int = 16  # tokens per sealed block (open_f16)
    window: int = 0  # open_f16: a block stays in F16 until this many positions follow it (a recent window)
    sinks: int = 0  # open_f16: the first positions kept in F16 for good (left out of block 0's key groups)
    vgroup: int | None = None  # kivi: channels per value group (None: head_dim)
    keys: bool = True  # kivi: quantize the keys (False: F16; a diagnostic)
    values: bool = True  # kivi: quantize the values (False: F16; a diagnostic)
    prerope: bool = False  # kivi: keys quantized before RoPE (the kernel rotates each decoded key)
    vchan: bool = False  # kivi: values per channel over each sealed block too (as the keys)

    def quantized_from(self, positions: torch.Tensor) -> torch.Tensor:
        """float32: for each key position, the first query position that reads its row quantized (inf: never).
        A sealed block's rows from the query that seals it (its last position) plus ``window``."""
        first = positions.float() if not self.open_f16 else (
            (positions // self.block + 1) * self.block + self.window - 1).float()
        return torch.where(positions < self.sinks, math.inf, first)


SCHEMES = (
    Scheme("per-token sym g=d (no rotation)"),
    Scheme("per-token asym g=d (no rotation)", mode="asym"),
    Scheme("H + sym g=d", rotate=True),
    Scheme("H + sym16 g=d", mode="sym16", rotate=True),
    Scheme("H + asym g=d", mode="asym", rotate=True),
    Scheme("H + sym g=d + MSE clip", rotate=True, clip=True),
    Scheme("H + sym16 g=d + MSE clip", mode="sym16", rotate=True, clip=True),
    Scheme("H + signs + sym16 g=d + MSE clip", mode="sym16", rotate=True, signs=True, clip=True),
    Scheme("H + sym g=32 (f16 scale)", group=32, rotate=True, scale_bytes=2),
    Scheme("H + asym g=32", group=32, mode="asym", rotate=True),
    Scheme("H + asym g=d, open block F16", mode="asym", rotate=True, open_f16=True),
    Scheme("KIVI (K per channel / 16-block, V per token)", mode="asym", kivi=True, open_f16=True),
    Scheme("KIVI, 64-token blocks", mode="asym", kivi=True, open_f16=True, block=64),
    # What the 16-block format's error is made of, and what buys it down (docs/archive/benchmarks-2026.md, "4-bit KV").
    Scheme("KIVI keys only (values F16)", mode="asym", kivi=True, open_f16=True, values=False),
    Scheme("KIVI values only (keys F16)", mode="asym", kivi=True, open_f16=True, keys=False),
    Scheme("KIVI + 1 sink", mode="asym", kivi=True, open_f16=True, sinks=1),
    Scheme("KIVI + 4 sinks", mode="asym", kivi=True, open_f16=True, sinks=4),
    Scheme("KIVI + window 32", mode="asym", kivi=True, open_f16=True, window=32),
    Scheme("KIVI + window 64", mode="asym", kivi=True, open_f16=True, window=64),
    Scheme("KIVI + window 128", mode="asym", kivi=True, open_f16=True, window=128),
    Scheme("KIVI, V groups of 32", mode="asym", kivi=True, open_f16=True, vgroup=32),
    Scheme("KIVI 32-blocks", mode="asym", kivi=True, open_f16=True, block=32),
    Scheme("KIVI 32-blocks + 4 sinks + window 64", mode="asym", kivi=True, open_f16=True, block=32, sinks=4,
           window=64),
    Scheme("KIVI 64-blocks + 4 sinks + window 64", mode="asym", kivi=True, open_f16=True, block=64, sinks=4,
           window=64),
    Scheme("KIVI 64-blocks + 4 sinks", mode="asym", kivi=True, open_f16=True, block=64, sinks=4),
    Scheme("KIVI 64-blocks + window 64", mode="asym", kivi=True, open_f16=True, block=64, window=64),
    Scheme("K and V per channel, 16-blocks", mode="asym", kivi=True, open_f16=True, vchan=True),
    Scheme("K and V per channel, 64-blocks", mode="asym", kivi=True, open_f16=True, vchan=True, block=64),
    Scheme("K and V per channel, 64-blocks + 4 sinks + window 64", mode="asym", kivi=True, open_f16=True,
           vchan=True, block=64, sinks=4, window=64),
    Scheme("K pre-RoPE and V per channel, 64-blocks + 4 sinks + window 64", mode="asym", kivi=True,
           open_f16=True, prerope=True, vchan=True, block=64, sinks=4, window=64),
    Scheme("KIVI + 4 sinks + window 64", mode="asym", kivi=True, open_f16=True, sinks=4, window=64),
    Scheme("KIVI 64-blocks + 1 sink + window 64", mode="asym", kivi=True, open_f16=True, block=64, sinks=1,
           window=64),
    Scheme("KIVI 64-blocks + 4 sinks + window 32", mode="asym", kivi=True, open_f16=True, block=64, sinks=4,
           window=32),
    Scheme("KIVI pre-RoPE keys", mode="asym", kivi=True, open_f16=True, prerope=True),
    Scheme("KIVI pre-RoPE 64-blocks", mode="asym", kivi=True, open_f16=True, prerope=True, block=64),
    Scheme("KIVI pre-RoPE 64-blocks + 4 sinks + window 64", mode="asym", kivi=True, open_f16=True, prerope=True,
           block=64, sinks=4, window=64),
)
BASELINE = "fp32 (baseline)"
# The frozen format, int8kv.quant4 (tests/test_bench_kv4.py: the same rows, bit for bit).
CHOSEN = "KIVI (K per channel / 16-block, V per token)"
# The frozen format with F16 sinks and window, int8kv.quant4w (tests/test_quant4w.py: every query reads that
# format's stored form of its prefix, bit for bit, and the mixed attention equals its float64 reference).
SINK_WINDOW = "KIVI 64-blocks + 4 sinks + window 64"
# The same format stored in its pool (int8kv.cache.pool_q4w) and read by the reference backend: the frozen
# format's own code path, which must give the bench's figures (float64 attention instead of float32).
POOL = "int4_kchan64_vtok_asym_sink4_win64_v1 (pool, reference backend)"
_WINNER = next(s for s in SCHEMES if s.name == SINK_WINDOW)
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(17))  # 1.0 down to 0.6


def _levels(x: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "sym":
        return torch.round(x / scale).clamp(-7, 7) * scale
    return (torch.floor(x / scale).clamp(-8, 7) + 0.5) * scale  # sym16


def quant_groups(x: torch.Tensor, group: int, mode: str, clip: bool, scale_bytes: int) -> torch.Tensor:
    """decode(encode(x)) of 4-bit groups of ``group`` values along the last dimension, float32."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    if mode == "asym":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).half().float()
        lo = lo.half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (lo + torch.round((g - lo) / scale).clamp(0, 15) * scale).reshape(shape)
    top = 7.0 if mode == "sym" else 7.5
    amax = g.abs().amax(-1, keepdim=True)
    best, best_err = None, None
    for ratio in CLIP_RATIOS if clip else (1.0,):
        scale = amax * ratio / top
        if scale_bytes == 2:
            scale = scale.half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = _levels(g, scale, mode)
        err = (y - g).square().sum(-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, y, best), torch.where(take, err, best_err)
    return best.reshape(shape)


class FakeQuant4:
    """Rows ``[..., head_dim]`` -> decode(encode(rows)) of one per-token scheme (or F16 rounding)."""

    def __init__(self, scheme: Scheme | None, head_dim: int) -> None:
        self.scheme = scheme
        if scheme is not None and scheme.rotate:
            self.h = hadamard(head_dim)
            self.s = random_signs(head_dim) if scheme.signs else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x16 = x.to(torch.float16).to(torch.float32)
        sc = self.scheme
        if sc is None:
            return x16.to(x.dtype)
        y = x16
        if sc.rotate:
            y = (y * self.s if self.s is not None else y) @ self.h
        y = quant_groups(y, sc.group or y.shape[-1], sc.mode, sc.clip, sc.scale_bytes)
        if sc.rotate:
            y = y @ self.h
            y = y * self.s if self.s is not None else y
        return y.to(x.dtype)


def make_cache(scheme: Scheme | None, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
    """A DynamicCache whose stored rows went through ``scheme`` (None: F16 rounding; "fp32": no change).
    Schemes with an F16 part (open block, window, sinks) return rows for :func:`mixed_attention`; ``rope``:
    the model's (cos, sin) ``[positions, head_dim]`` from position 0, which ``prerope`` schemes need."""
    from transformers import DynamicCache

    if scheme == "fp32":
        return DynamicCache()
    if scheme == POOL:
        return PoolCache(head_dim, capacity=4096 if rope is None else rope[0].shape[0])
    fq = FakeQuant4(scheme, head_dim)
    if scheme is not None and mixed(scheme):
        if scheme.prerope and rope is None:
            raise ValueError(f"{scheme.name!r} quantizes keys before RoPE: pass the model's rope table")
        return MixedCache(scheme, fq, rope)

    class Fake(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            return super().update(fq(key_states), fq(value_states), layer_idx, *args, **kwargs)

    return Fake()


def mixed(scheme: Any) -> bool:
    """Whether ``scheme`` reads some rows in F16 and others quantized (then it runs on :func:`mixed_attention`)."""
    return isinstance(scheme, Scheme) and (scheme.open_f16 or scheme.sinks > 0)


def _kivi_keys(block: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, T, D]`` of one sealed block, asym 4-bit per channel (over the block's T tokens)."""
    return quant_groups(block.transpose(-1, -2), block.shape[-2], "asym", False, 4).transpose(-1, -2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def _prerope_keys(rope: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """Keys of a sealed block (post-RoPE, from position ``start``) -> RoPE of the 4-bit per-channel codes of
    the keys before RoPE (rotated back by the position's angle, quantized, rotated forward)."""
    cos, sin = rope

    def keys(x: torch.Tensor, start: int) -> torch.Tensor:
        c, s = cos[start : start + x.shape[-2]], sin[start : start + x.shape[-2]]
        q = _kivi_keys(x * c - _rotate_half(x) * s)
        return q * c + _rotate_half(q) * s

    return keys


def MixedCache(scheme: Scheme, per_token: Any, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:  # noqa: N802 - built on demand (lazy transformers)
    """A DynamicCache holding each row in F16 and, once its block is sealed, as decode(encode(row)).

    ``update`` returns keys ``[B, H, T, 2D + 1]`` (F16 rows, quantized rows, :meth:`Scheme.quantized_from`)
    and values ``[B, H, T, 2D]`` (F16, quantized): :func:`mixed_attention` picks for each query and key the
    row a decode step at that query would read, so a prefill chunk of any length scores every token as
    decode would. Rows of the block not yet sealed stand in F16 in the quantized half (never read there)."""
    from transformers import DynamicCache

    if scheme.kivi:
        keys = _prerope_keys(rope) if scheme.prerope else (
            (lambda x, start: _kivi_keys(x)) if scheme.keys else (lambda x, start: x))
        group = scheme.vgroup

        def values(x: torch.Tensor) -> torch.Tensor:
            if not scheme.values:
                return x
            return _kivi_keys(x) if scheme.vchan else quant_groups(x, group or x.shape[-1], "asym", False, 4)
    else:
        values = per_token

        def keys(x: torch.Tensor, start: int) -> torch.Tensor:
            return per_token(x)
    b, sinks = scheme.block if scheme.open_f16 else 1, scheme.sinks

    class Mixed(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.sealed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            k, v = super().update(key_states.half().float(), value_states.half().float(), layer_idx, *args, **kwargs)
            qk, qv = self.sealed.get(layer_idx, (k[..., :0, :], v[..., :0, :]))
            n = k.shape[-2] // b * b
            for s in range(qk.shape[-2], n, b):
                lo = min(max(s, sinks), s + b)  # sinks: F16 for good, outside the block's key groups
                if lo < s + b:
                    qk = torch.cat([qk, k[..., s:lo, :], keys(k[..., lo : s + b, :], lo)], -2)
                    qv = torch.cat([qv, v[..., s:lo, :], values(v[..., lo : s + b, :])], -2)
                else:
                    qk, qv = torch.cat([qk, k[..., s : s + b, :]], -2), torch.cat([qv, v[..., s : s + b, :]], -2)
            self.sealed[layer_idx] = (qk, qv)
            when = scheme.quantized_from(torch.arange(k.shape[-2])).expand(*k.shape[:-1])[..., None]
            kq, vq = torch.cat([qk, k[..., n:, :]], -2), torch.cat([qv, v[..., n:, :]], -2)
            return torch.cat([k, kq, when], -1), torch.cat([v, vq], -1)

    return Mixed()


def PoolCache(head_dim: int, capacity: int) -> Any:  # noqa: N802 - built on demand (lazy transformers)
    """A DynamicCache that also writes every row, through the write path, into one
    :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool` per layer (one sequence per batch row, ``capacity``
    positions each), with one plan per forward; :func:`pool_attention` reads the pools. The DynamicCache's own
    rows only keep transformers' lengths (they are not read); the keys it returns carry the cache."""
    from transformers import DynamicCache

    from ..cache.pool_q4w import PAGE, Int4SinkWindowPool
    from ..ops import append_paged_kv, plan_attention

    pages = -(-capacity // PAGE)

    class Pooled(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.pools: dict[int, Int4SinkWindowPool] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            bsz, heads, n, d = key_states.shape
            if layer_idx not in self.pools:
                # Window pages: a step of n positions holds ceil(n / 64) + 2 per sequence (the bench's chunks are
                # never longer than its first).
                windows = bsz * (-(-n // PAGE) + 2)
                self.pools[layer_idx] = Int4SinkWindowPool(1, heads, d, bsz * pages, windows, bsz)
            pool = self.pools[layer_idx]
            if layer_idx == 0:  # one plan per forward, for every layer's pool (they share the dimensions)
                self.lens = getattr(self, "lens", torch.zeros(bsz, dtype=torch.int32)) + n
                tables = torch.arange(bsz * pages, dtype=torch.int32).reshape(bsz, pages)
                self.plan = plan_attention(pool, tables, self.lens,
                                           cu_seqlens_q=torch.arange(bsz + 1, dtype=torch.int32) * n)
            rows = [x.transpose(1, 2).reshape(bsz * n, heads, d) for x in (key_states, value_states)]
            append_paged_kv(pool, 0, *rows, plan=self.plan, backend="reference")
            k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            k.int8kv_pool = (pool, self.plan)
            return k, v

    return Pooled()


def pool_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                   scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of the queries ``[B, Hq, T, d]`` through the reference backend over the layer's pool of
    :func:`PoolCache` (carried by ``key``; ``value`` is not read)."""
    from .. import ops

    pool, plan = key.int8kv_pool
    if scaling is not None and not math.isclose(scaling, plan.softmax_scale, rel_tol=1e-12):
        raise ValueError(f"the pool path plans with head_dim ** -0.5, the model scales by {scaling}")
    bsz, heads, n, d = query.shape
    out = ops.attention(pool, 0, query.transpose(1, 2).reshape(bsz * n, heads, d), plan, backend="reference")
    return out.reshape(bsz, n, heads, d).to(query.dtype), None


POOL_ATTENTION = "int8kv-kv4-pool"
MIXED_ATTENTION = "int8kv-kv4-mixed"


def mixed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention over :class:`MixedCache` rows: query ``t`` reads key ``j`` quantized when
    ``t >= quantized_from[j]``, in F16 otherwise. The queries are the cache's last positions (the bench feeds
    unpadded windows, so the model's mask is the causal one and is not read)."""
    bsz, heads, q_len, d = query.shape
    kv_heads, t_len = key.shape[1], key.shape[2]
    k16, kq, when = key[..., :d], key[..., d : 2 * d], key[0, 0, :, 2 * d]
    v16, vq = value[..., :d], value[..., d:]
    # q head h reads KV head h // (heads / kv_heads): [B, kv_heads, heads / kv_heads * q_len, d]
    q = query.reshape(bsz, kv_heads, heads // kv_heads * q_len, d) * (d**-0.5 if scaling is None else scaling)
    first = t_len - q_len
    at = torch.arange(first, t_len, dtype=torch.float32)[:, None]
    # All keys are read quantized but these: F16 for some query (sinks, window, open block) or in its future.
    # Scoring only them in F16 took a 256-query chunk over 1,024 keys from 7x SDPA's time to 4x (80 ms against
    # 21 ms, one thread, load average 5).
    cols = torch.nonzero((when > first) | (torch.arange(t_len) >= first)).squeeze(1)
    use_q = at >= when[cols][None, :]  # [q, cols]
    s = (q @ kq.transpose(-1, -2)).view(bsz, kv_heads, -1, q_len, t_len)
    f16 = (q @ k16[..., cols, :].transpose(-1, -2)).view(bsz, kv_heads, -1, q_len, len(cols))
    part = torch.where(use_q, s[..., cols], f16).masked_fill(cols[None, :] > at, -math.inf)
    p = torch.softmax(s.index_copy_(-1, cols, part), -1)
    out = p.flatten(2, 3) @ vq + (p[..., cols] * ~use_q).flatten(2, 3) @ (v16 - vq)[..., cols, :]
    return out.view(bsz, heads, q_len, d).transpose(1, 2).contiguous(), None


def use_attention(model: Any, scheme: Any) -> None:
    """Route ``model``'s attention for ``scheme``: :func:`mixed_attention` or SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(MIXED_ATTENTION, mixed_attention)
    AttentionMaskInterface.register(MIXED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionInterface.register(POOL_ATTENTION, pool_attention)
    AttentionMaskInterface.register(POOL_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation_internal = (
        POOL_ATTENTION if scheme == POOL else MIXED_ATTENTION if mixed(scheme) else "sdpa")


def bytes_per_row(scheme: Scheme | None, d: int) -> float:
    """Stored bytes of one sealed K row plus one V row of one head (scales included): the long-context bytes
    per position, where the F16 rows (open block, window, sinks) are a vanishing share."""
    if scheme is None:
        return 4.0 * d
    if scheme.kivi:  # keys: a float16 scale and minimum per channel per block; values: one pair per group
        k = d / 2 + d * 4 / scheme.block if scheme.keys else 2.0 * d
        v = d / 2 + 4 * d / (scheme.block if scheme.vchan else scheme.vgroup or d)
        return k + (v if scheme.values else 2.0 * d)
    groups = d // (scheme.group or d)
    return 2 * (d / 2 + groups * (4 if scheme.mode == "asym" else scheme.scale_bytes))


def bytes_at(scheme: Scheme | None, d: int, n: int) -> float:
    """Bytes per position of one head at a context of ``n`` positions: the rows the next decode step reads
    quantized at :func:`bytes_per_row`, the others (sinks, window, open block) at F16's ``4d``."""
    if not mixed(scheme):
        return bytes_per_row(scheme, d)
    quantized = int((scheme.quantized_from(torch.arange(n)) <= n - 1).sum())
    return (quantized * bytes_per_row(scheme, d) + (n - quantized) * 4.0 * d) / n


BYTES_AT = (4096, 32768)  # the contexts at which bytes are reported besides the long-context figure


def _windows(ids: list[int], ctx: int, count: int) -> list[list[int]]:
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:count]
    if len(out) < count:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} windows of {ctx}")
    return out


TOP = 32  # the baseline's most likely tokens per position kept for the KL (the rest is one bucket)


@dataclass
class Scored:
    """One candidate's scores over a text: summed NLL, token count, and against the baseline's ``ref`` (when
    given) the summed KL(baseline || candidate) and the summed square of per-token log-prob differences."""

    nll: float = 0.0
    count: int = 0
    kl: float = 0.0
    delta: float = 0.0
    delta_sq: float = 0.0

    def delta_se(self) -> float:
        """Standard error of the mean per-token NLL change (nats): the perplexity change's noise."""
        mean = self.delta / self.count
        return math.sqrt(max(self.delta_sq / self.count - mean * mean, 0.0) / self.count)


@torch.inference_mode()
def nll(model: Any, make: Any, wins: list[list[int]], batch: int, chunk: int, bar: Bar,
        ref: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        keep: list | None = None) -> Scored:
    """Scores of the second half of each window, windows fed ``batch`` at a time in chunks of ``chunk``.
    ``keep``: a list that receives, per batch, the baseline's (target log-probs, top log-probs, top ids) for
    ``ref`` of later candidates. The KL over the top ``TOP`` tokens and one bucket for the rest is a lower
    bound of the full KL; it ranks candidates with far less noise than the perplexity of a few thousand
    tokens (the 4-window screen ran a candidate that keeps more rows in F16 at +1.24 % against +0.43 %)."""
    out = Scored()
    for i, b in enumerate(range(0, len(wins), batch)):
        ids = torch.tensor(wins[b : b + batch])
        cache = make()
        logits = []
        half = ids.shape[1] // 2
        for s in range(0, ids.shape[1], chunk):
            part = ids[:, s : s + chunk]
            # Logits only where a scored token is predicted (the LM head is ~20 % of the forward's work).
            want = max(1, s + part.shape[1] - (half - 1))
            res = model(input_ids=part, cache=cache, use_cache=True, logits_to_keep=min(want, part.shape[1]))
            logits.append(res.logits.double())
            bar.update(part.numel())
        lp = torch.log_softmax(torch.cat(logits, 1)[:, -(ids.shape[1] - half) - 1 : -1], -1)
        del logits
        target = lp.gather(2, ids[:, half:, None])[..., 0]
        out.nll -= float(target.sum())
        out.count += target.numel()
        if keep is not None:
            top, idx = lp.topk(TOP, -1)
            keep.append((target, top, idx))
        if ref is not None:
            base, top, idx = ref[i]
            d = base - target
            out.delta += float(d.sum())
            out.delta_sq += float(d.square().sum())
            p, q = top.exp(), lp.gather(2, idx)
            rest_p = (1 - p.sum(-1)).clamp_min(1e-300)
            rest_q = (1 - q.exp().sum(-1)).clamp_min(1e-300)
            out.kl += float((p * (top - q)).sum() + (rest_p * (rest_p.log() - rest_q.log())).sum())
    return out


@torch.inference_mode()
def reference_tokens(model: Any, prompt: list[int], n: int, head_dim: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` with F16 storage."""
    cache, out = make_cache(None, head_dim), []
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.tensor([[nxt]])
    return out


@torch.inference_mode()
def agreement(model: Any, scheme: Any, prompt: list[int], ref: list[int], head_dim: int,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """Steps (of ``len(ref)``) at which ``scheme``'s top-1 equals the F16 greedy token, teacher-forced: one
    forward over the prompt and ``ref`` (each position reads the rows its decode step would read)."""
    use_attention(model, scheme)
    logits = model(input_ids=torch.tensor([prompt + ref[:-1]]), cache=make_cache(scheme, head_dim, rope)).logits[0]
    return sum(p == r for p, r in zip(logits[len(prompt) - 1 :].argmax(-1).tolist(), ref, strict=True))


def rope_table(model: Any, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE (cos, sin), float32 ``[positions, head_dim]`` from position 0."""
    cos, sin = model.model.rotary_emb(torch.zeros(1), position_ids=torch.arange(positions)[None])
    return cos[0], sin[0]


def run(
    texts: tuple[str, ...] = DEFAULT_TEXTS,
    ctx: int = 1024,
    windows: int = 12,
    batch: int = 4,
    chunk: int = 256,
    gen_tokens: int = 128,
    prompts: int = 4,
    only: tuple[str, ...] = (),
    model_path: str | None = None,
    agree_ctx: int = 0,
) -> dict:
    from ..eval import DEFAULT_PROMPTS, read_text
    from ..models import kv_dims, load_model

    model, tokenizer = load_model(model_path, quiet=True)
    _, heads, d = kv_dims(model.config)
    rope = rope_table(model, max(ctx, agree_ctx, 4096) + gen_tokens)
    # F16 storage is the agreement's reference (its perplexity is in `int8kv eval`'s table).
    kinds: list[tuple[str, Any]] = [(BASELINE, "fp32")] + [(s.name, s) for s in SCHEMES] + [(POOL, POOL)]
    kinds = [k for k in kinds if not only or k[0] in only]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct", "head_dim": d, "kv_heads": heads, "ctx": ctx, "windows": windows,
        "chunk": chunk, "threads": torch.get_num_threads(), "gen_tokens": gen_tokens, "texts": {}, "rows": {},
    }
    for path in texts if ctx else ():  # ctx 0: the agreement only
        name = path
        wins = _windows(tokenizer(read_text(None if path == EVAL_CORPUS else path))["input_ids"], ctx, windows)
        result["texts"][name] = {"tokens_fed": sum(map(len, wins)), "scored": 0}
        ref: list | None = None  # the baseline's per batch, when it runs (first)
        for kind, scheme in kinds:
            use_attention(model, scheme)
            with Bar(f"{name}: {kind}", total=sum(map(len, wins)), unit="tok") as bar:
                start = time.perf_counter()
                keep = [] if kind == BASELINE else None
                got = nll(model, lambda s=scheme: make_cache(s, d, rope), wins, batch, chunk, bar, ref, keep)
                ref = keep if keep is not None else ref
            row = result["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
            row["ppl"][name] = math.exp(got.nll / got.count)
            row["seconds"][name] = time.perf_counter() - start
            if ref is not None and keep is None:
                row.setdefault("kl", {})[name] = got.kl / got.count
                row.setdefault("ppl_change_se", {})[name] = got.delta_se() * math.exp(got.delta / got.count)
            result["texts"][name]["scored"] = got.count
    if agree_ctx and prompts:  # long prompts: windows of the first text after the ones scored
        ids = tokenizer(read_text(None if texts[0] == EVAL_CORPUS else texts[0]))["input_ids"]
        chosen = _windows(ids[windows * ctx :], agree_ctx, prompts)
        result["agreement_prompts"] = f"{prompts} windows of {agree_ctx} tokens of {texts[0]}"
    else:
        chosen = [tokenizer(p)["input_ids"] for p in DEFAULT_PROMPTS[:prompts]]
        result["agreement_prompts"] = f"the eval's first {prompts} prompts"
    use_attention(model, None)
    refs = [reference_tokens(model, p, gen_tokens, d) for p in chosen]
    note(f"F16 reference tokens generated for {len(chosen)} prompts")
    for kind, scheme in kinds:
        row = result["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
        if chosen:
            pairs = zip(chosen, refs, strict=True)
            same = sum(agreement(model, scheme, p, r, d, rope) for p, r in pairs)
            row["agreement"] = same / (len(chosen) * gen_tokens)
        s = scheme if isinstance(scheme, Scheme) else _WINNER if scheme == POOL else None
        scale = 2 if scheme == "fp32" else 1
        for dim in (64, 128):
            row[f"bytes_vs_f16_d{dim}"] = scale * bytes_per_row(s, dim) / bytes_per_row(None, dim)
            for n in BYTES_AT:
                row[f"bytes_vs_f16_d{dim}_at{n}"] = scale * bytes_at(s, dim, n) / bytes_per_row(None, dim)
        row["bytes_per_token"] = scale * heads * model.config.num_hidden_layers * bytes_per_row(s, d)
    return with_changes(result)


def with_changes(result: dict) -> dict:
    """``result`` with each row's perplexity change against the float32 baseline, per text."""
    if BASELINE not in result["rows"]:  # a part run without it (see combine)
        return result
    base = result["rows"][BASELINE]["ppl"]
    for row in result["rows"].values():
        row["ppl_change"] = {t: row["ppl"][t] / base[t] - 1 for t in row["ppl"]}
    return result


def combine(parts: list[dict]) -> dict:
    """One result from runs over different texts (the same model and settings), e.g. run in parallel: texts
    and perplexities merged, the agreement taken from the run that measured it."""
    out = parts[0]
    for part in parts[1:]:
        out["texts"].update(part["texts"])
        for kind, row in part["rows"].items():
            mine = out["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
            mine.update({k: v for k, v in row.items() if k.startswith("bytes")})
            for key in ("ppl", "seconds", "kl", "ppl_change_se"):
                mine.setdefault(key, {}).update(row.get(key, {}))
            if "agreement" in row:
                mine["agreement"] = row["agreement"]
    return with_changes(out)


def report(result: dict) -> str:
    texts = list(result["texts"])
    head = (
        f"{result['model']} (head_dim {result['head_dim']}): windows of {result['ctx']} fed in chunks of "
        f"{result['chunk']}, second half scored; "
        + "; ".join(f"{t}: {v['tokens_fed']} tokens fed, {v['scored']} scored" for t, v in result["texts"].items())
        + f"; agreement with F16 per step over {result['gen_tokens']} tokens after "
        + f"{result.get('agreement_prompts', 'the eval prompts')}; torch threads {result['threads']}"
    )
    cols = "".join(f"{'ppl ' + t[:12]:>20}{'Δ':>9}{'± se':>8}{'KL mnat':>9}" for t in texts)
    sizes = [f"bytes_vs_f16_d{dim}{at}" for dim in (64, 128) for at in ("", *(f"_at{n}" for n in BYTES_AT))]
    ats = ("long", *(f"@{n // 1024}k" for n in BYTES_AT))
    named = "".join(f"{f'd{dim} {at}':>10}" for dim in (64, 128) for at in ats)
    lines = [head + "; ± se: the change's standard error over the scored tokens; KL(fp32 || cache) per token in"
             " millinats (the baseline's top tokens and the rest); bytes vs F16 per position, long context and"
             " at 4k / 32k positions",
             f"{'cache':<46}{cols}{'agree':>8}{named}"]
    for kind, row in result["rows"].items():
        vals = "".join(
            (f"{row['ppl'][t]:>20.4f}{100 * row['ppl_change'][t]:>+8.3f}%" if t in row.get("ppl_change", {})
             else f"{'-':>29}")
            + (f"{100 * row['ppl_change_se'][t]:>7.3f}%{1000 * row['kl'][t]:>9.3f}" if t in row.get("kl", {})
               else f"{'-':>8}{'-':>9}")
            for t in texts
        )
        agree = f"{100 * row['agreement']:>7.1f}%" if "agreement" in row else f"{'-':>8}"
        size = "".join(f"{row[k]:>10.3f}" if k in row else f"{'-':>10}" for k in sizes)
        lines.append(f"{kind:<46}{vals}{agree}{size}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("kv4", __doc__.split("\n")[0])
    parser.add_argument("--text", action="append", help=f"a text to score (repeatable; {EVAL_CORPUS}: the eval's "
                        f"corpus; default: both of {DEFAULT_TEXTS})")
    parser.add_argument("--ctx", type=int, default=1024, help="tokens per window (0: the agreement only)")
    parser.add_argument("--windows", type=int, default=12, help="windows per text")
    parser.add_argument("--batch", type=int, default=4, help="windows per forward")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    parser.add_argument("--gen-tokens", type=int, default=128, help="greedy steps per prompt")
    parser.add_argument("--prompts", type=int, default=4, help="prompts for the agreement (0: none)")
    parser.add_argument("--agree-ctx", type=int, default=0, help="agreement prompts of this many tokens: windows "
                        "of the first --text after the scored ones (0: the eval's prompts)")
    parser.add_argument("--only", action="append", default=[], help="run only this candidate (repeatable)")
    parser.add_argument("--model", metavar="PATH", default=None)
    # One thread: on the shared 2-core machine (load 7) two threads ran a 1,024-token prefill 4.6x slower.
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="only merge the results of earlier runs "
                        "(e.g. one per text, run side by side) into one table")
    args = parser.parse_args(argv)
    if args.combine:
        parts = [json.load(open(p)) for p in args.combine]
        result = combine(parts)
        return emit(result, report(result), args.json)
    if min(args.windows, args.batch, args.chunk, args.gen_tokens) < 1 or min(args.prompts, args.ctx,
                                                                                 args.agree_ctx) < 0:
        parser.error("--windows, --batch, --chunk and --gen-tokens must be >= 1, --ctx, --prompts and "
                     "--agree-ctx >= 0")
    torch.set_num_threads(max(1, args.threads))
    names = {s.name for s in SCHEMES} | {BASELINE, POOL}
    if unknown := [n for n in args.only if n not in names]:
        parser.error(f"unknown candidate(s) {unknown}; known: {sorted(names)}")
    result = run(tuple(args.text) if args.text else DEFAULT_TEXTS, args.ctx, args.windows, args.batch, args.chunk,
                 args.gen_tokens, args.prompts, tuple(args.only), args.model, args.agree_ctx)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
