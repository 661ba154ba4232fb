"""Paged-cache operations: plan a step once, then write and attend per layer through one dispatcher.

    plan = plan_attention(cache, block_tables, context_lens, cu_seqlens_q=cu, slots=slots, positions=pos)
    for layer in range(num_layers):
        q = paged_write(cache, layer, qkv, None, None, cos, sin, num_q_heads, plan=plan)
        out = attention(cache, layer, q, plan)

Every backend ("reference": float64 oracle, returned as float32; "cpu": numba; "triton") is a module with one
function ``attend(pool, layer, q, plan, variant=None)`` (the CPU's also ``prepare(pool, plan, num_q_heads,
variant)``, that ``attend`` resolved once for every layer of the plan) that checks nothing: the plan was
validated when it was built and :func:`attention` checks ``q`` (shape, device, finiteness) and the per-call
variant (sliding ``window``, ``chunk``-ed attention, logit ``softcap``, attention ``sinks``:
:class:`~.plan.AttentionVariant`), the same way for all of them. ``backend=None`` picks "triton" for a CUDA
cache and "cpu" otherwise. Backend modules are imported lazily, so importing
int8kv never pulls in numba compilation or triton.

Where many layers share one plan, :class:`PreparedAttention` resolves what :func:`attention` works out at each
call (the backend, the variant's checks, the CPU kernel's work) once, and runs per layer (without a variant the
CPU backend keeps its prepared call in the plan, so :func:`attention` finds it there from the second layer on):

    call = PreparedAttention(cache, plan, num_q_heads)
    for layer in range(num_layers):
        out = call.run(cache, layer, q)

The single-call functions (:func:`paged_decode_attention`, :func:`paged_prefill_attention`,
:func:`append_paged_kv`, :func:`paged_write`) keep working on their own: they plan, then run.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from ..cache.paged import PagedKvCache
from ..cache.pool import KvPool
from ..errors import NonFiniteError, ShapeMismatch, UnknownBackend, UnsupportedFormat
from . import write
from .plan import AttentionPlan, AttentionVariant, check_variant, plan_attention
from .write import FLOAT_DTYPES, apply_rope, prepare_qkv, rms_norm, split_qkv

BACKENDS = ("reference", "cpu", "triton")

__all__ = [
    "BACKENDS",
    "AttentionPlan",
    "AttentionVariant",
    "PreparedAttention",
    "append_paged_kv",
    "apply_rope",
    "attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_write",
    "plan_attention",
    "resolve_backend",
    "rms_norm",
    "split_qkv",
]


def as_pool(cache: PagedKvCache | KvPool) -> KvPool:
    """The storage of a paged cache, or the pool itself."""
    if isinstance(cache, PagedKvCache):
        return cache.pool
    if isinstance(cache, KvPool):
        return cache
    if getattr(cache, "writes_by_step", False):  # cache.pool_q4w's pool (every backend has a kernel for it)
        return cache
    raise ShapeMismatch(f"expected a PagedKvCache or a KvPool, got {type(cache).__name__}")


def resolve_backend(cache: PagedKvCache | KvPool, backend: str | None = None) -> str:
    """The backend name for ``cache``'s device; a name that cannot serve that device is refused (typed)."""
    device = cache.device
    if backend is None:
        return "triton" if device.type == "cuda" else "cpu"
    if backend not in BACKENDS:
        raise UnknownBackend(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "cpu" and device.type != "cpu":
        raise UnknownBackend(f"the cpu backend needs a CPU cache, this one is on {device}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnknownBackend(
            f"the triton backend needs a CUDA cache (this one is on {device}), or TRITON_INTERPRET=1 set before "
            "triton is imported"
        )
    return backend


_MODULES: dict[str, Any] = {}


def _module(name: str) -> Any:
    # A dict lookup per layer instead of importlib's (import lock, spec checks) once a backend is loaded.
    mod = _MODULES.get(name)
    if mod is None:
        mod = _MODULES[name] = importlib.import_module(f"{__name__}.{name}")
    return mod


def check_kernels(module: Any, pool: KvPool) -> None:
    """Refuse (UnsupportedFormat) a pool whose format's kernels the backend ``module`` lacks: its ``KERNELS``
    names the formats' ``kernel`` values it reads (None: any format, through the format's own decode)."""
    kernels = module.KERNELS
    if kernels is not None and pool.format.spec.kernel not in kernels:
        raise UnsupportedFormat(
            f"the {module.__name__.rsplit('.', 1)[-1]} backend has no kernels for the {pool.format.value} format"
        )


_FINITE: list = []  # cpu.all_finite, once the CPU backend is loaded


def _all_finite() -> Any:
    """``cpu.all_finite`` (imported on first use: numba loads with the CPU backend, not with ``int8kv.ops``);
    numpy's check where numba's compiler is off, since the CPU backend then refuses to load
    (`numba_cache.require_jit`) and the reference backend still checks its q."""
    if not _FINITE:
        import numba

        if numba.config.DISABLE_JIT:
            import numpy as np

            _FINITE.append(lambda a: bool(np.isfinite(a).all()))
        else:
            from .cpu import all_finite

            _FINITE.append(all_finite)
    return _FINITE[0]


def check_query(pool: KvPool, q: torch.Tensor, plan: AttentionPlan, *, finite: bool = True) -> torch.Tensor:
    """``q [num_queries, num_q_heads, head_dim]`` as float32, contiguous; NaN/inf refused (NonFiniteError) unless
    ``finite`` is False: for a backend whose runs refuse it themselves (its module's ``CHECKS_QUERY``)."""
    shape = q.shape if isinstance(q, torch.Tensor) else ()  # read once: each read of q.shape builds a torch.Size
    if len(shape) != 3 or shape[2] != pool.head_dim or shape[0] != plan.num_queries:
        got = tuple(shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ShapeMismatch(f"q must be [{plan.num_queries}, num_q_heads, {pool.head_dim}], got {got}")
    if shape[1] == 0 or shape[1] % pool.num_kv_heads != 0:
        raise ShapeMismatch(f"num_q_heads ({shape[1]}) must be a positive multiple of {pool.num_kv_heads}")
    if q.dtype not in FLOAT_DTYPES:
        raise ShapeMismatch(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.device != pool.device:
        raise ShapeMismatch(f"q is on {q.device} but the cache is on {pool.device}")
    # Refused on every backend alike: a NaN query would give NaN rows on one backend and zeros on another.
    if q.requires_grad or q.dtype != torch.float32 or not q.is_contiguous():  # the common case skips three torch calls
        q = q.detach().to(torch.float32).contiguous()
    if not finite:
        return q
    # On the CPU one compiled pass (`cpu.all_finite`): inside a decode step, where every layer checks its q with
    # the caches cold, it beat a BLAS dot of q with itself (np.vdot: a finite result meant finite values), which
    # only looked faster in a loop.
    if q.is_cpu:
        finite = _all_finite()(q.numpy())
    else:
        finite = torch.isfinite(q).all()
    if not bool(finite):
        raise NonFiniteError("q holds NaN or inf")
    return q


# (backend argument, device, format object) -> backend module, for the names resolved without the environment
# (None, "cpu", "reference"): one dict lookup instead of resolve_backend + _module + check_kernels on every call.
# Keyed by the format's spec object, the thing check_kernels reads, not its enum member: a member whose spec
# changes (a format registered again, a test's stand-in) is checked afresh.
_RESOLVED: dict[tuple, Any] = {}


def backend_module(pool: KvPool, backend: str | None = None) -> Any:
    """The backend module that serves ``pool`` for ``backend`` (:func:`resolve_backend`), its kernels checked
    for the pool's format (:func:`check_kernels`); refusals are typed and never remembered."""
    key = (backend, pool.device, pool.format.spec)
    module = _RESOLVED.get(key)
    if module is None:
        name = resolve_backend(pool, backend)
        module = _module(name)
        check_kernels(module, pool)
        if name != "triton":  # the triton check reads TRITON_INTERPRET: asked again each call
            _RESOLVED[key] = module
    return module


def attention(
    cache: PagedKvCache | KvPool,
    layer: int,
    q: torch.Tensor,
    plan: AttentionPlan,
    *,
    backend: str | None = None,
    check_q: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [plan.num_queries, num_q_heads, head_dim]`` for one layer: float32 of q's shape.

    ``check_q=False`` for a q the caller already checked (the write path checks the q it returns).
    ``window`` (sliding window: query p sees keys s with p - window < s <= p), ``chunk`` (chunked attention:
    s and p in the same chunk of ``chunk`` positions counted from kv_start), ``softcap`` (scores become
    softcap * tanh(score / softcap)) and ``sinks`` (``[num_q_heads]`` logits joining the softmax denominator)
    apply to this call only, identically in every backend; :class:`~.plan.AttentionVariant` states them
    exactly. Bad values are refused (typed) before anything runs."""
    pool = as_pool(cache)
    pool.check_layer(layer)
    module = backend_module(pool, backend)
    if check_q:
        q = check_query(pool, q, plan, finite=not getattr(module, "CHECKS_QUERY", False))
    out = _resolve(pool, plan, q.shape[1], module, window, chunk, softcap, sinks)(pool, layer, q)
    return out if out.dtype == torch.float32 else out.to(torch.float32)


def _resolve(
    pool: KvPool, plan: AttentionPlan, num_q_heads: int, module: Any, window: int | None, chunk: int | None,
    softcap: float | None, sinks: torch.Tensor | None,
) -> Any:  # fmt: skip
    """``attend(pool, layer, q)`` of the backend ``module`` (`backend_module`) for ``plan``, ``num_q_heads`` and
    the variant, checked: what :func:`attention` runs once and :class:`PreparedAttention` keeps for every layer."""
    variant = None
    if window is not None or chunk is not None or softcap is not None or sinks is not None:
        variant = check_variant(pool, num_q_heads, window=window, chunk=chunk, softcap=softcap, sinks=sinks)
    prepare = getattr(module, "prepare", None)
    if prepare is not None:
        return prepare(pool, plan, num_q_heads, variant)
    if variant is None:  # plain causal: the backends run it with no variant at all
        return lambda pool, layer, q: module.attend(pool, layer, q, plan)
    return lambda pool, layer, q: module.attend(pool, layer, q, plan, variant)


def _geometry(pool: KvPool) -> tuple:
    """What a prepared call's kernels and work assume of a pool: format, heads, head_dim, blocks, device."""
    return (pool.format, pool.num_kv_heads, pool.head_dim, pool.num_blocks, pool.block_size, pool.device)


class PreparedAttention:
    """:func:`attention` for every layer that shares one plan, number of query heads and variant, resolved once.

    Built once, it resolves what only the plan and the variant decide (`_resolve`: the backend module, the
    variant's checks and, on the CPU, the kernel's work items, thread choice and query path; :func:`attention`
    resolves them at each call), then runs each layer with only what changes per layer checked: the pool against
    the one it was prepared with (format, heads, head_dim, blocks, device), the layer index and q
    (:func:`check_query`): a model's step pays the resolution once instead of once per layer
    (docs/archive/benchmarks-2026.md, "The drop-in's per-layer decode path").

    The backend is resolved when this is built (a "triton" one under ``TRITON_INTERPRET`` is not asked again),
    and so is the CPU kernel's split of the keys over threads: a later ``numba.set_num_threads`` changes how many
    threads run the items, not the items."""

    def __init__(
        self,
        cache: PagedKvCache | KvPool,
        plan: AttentionPlan,
        num_q_heads: int,
        *,
        backend: str | None = None,
        window: int | None = None,
        chunk: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        pool = as_pool(cache)
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int):
            raise ShapeMismatch(f"num_q_heads must be an int, got {num_q_heads!r}")
        if num_q_heads <= 0 or num_q_heads % pool.num_kv_heads:
            raise ShapeMismatch(f"num_q_heads ({num_q_heads}) must be a positive multiple of {pool.num_kv_heads}")
        module = backend_module(pool, backend)
        self._attend = _resolve(pool, plan, num_q_heads, module, window, chunk, softcap, sinks)
        self._finite = not getattr(module, "CHECKS_QUERY", False)  # whether check_query checks q's values
        self.plan = plan
        self.num_q_heads = num_q_heads
        self._geometry = _geometry(pool)

    def run(self, cache: PagedKvCache | KvPool, layer: int, q: torch.Tensor, *, check_q: bool = True) -> torch.Tensor:
        """Attention of ``q [plan.num_queries, num_q_heads, head_dim]`` for ``layer`` of ``cache`` (a pool of the
        prepared one's geometry): float32 of q's shape, as :func:`attention` returns it. ``check_q=False`` for a
        q the caller already checked (the write path checks the q it returns)."""
        pool = as_pool(cache)
        if _geometry(pool) != self._geometry:
            raise ShapeMismatch(f"this call was prepared for another pool than {pool!r}")
        pool.check_layer(layer)
        if check_q:
            q = check_query(pool, q, self.plan, finite=self._finite)
        if q.shape[1] != self.num_q_heads:
            raise ShapeMismatch(f"this call was prepared for {self.num_q_heads} query heads, q has {q.shape[1]}")
        out = self._attend(pool, layer, q)
        return out if out.dtype == torch.float32 else out.to(torch.float32)


def append_paged_kv(
    cache: PagedKvCache | KvPool,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    plan: AttentionPlan | None = None,
    backend: str | None = None,
) -> None:
    """Store already normed and rotated ``k, v [tokens, num_kv_heads, head_dim]`` at ``slots``, encoded."""
    pool = as_pool(cache)
    write.append_paged_kv(pool, layer, k, v, slots, plan=plan, backend=resolve_backend(pool, backend))


def paged_write(
    cache: PagedKvCache | KvPool,
    layer: int,
    qkv: torch.Tensor,
    positions: torch.Tensor | None,
    slots: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_style: str = "neox",
    *,
    plan: AttentionPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Split packed qkv, QK-norm, RoPE, then store k and v; returns float32 q `[tokens, num_q_heads, head_dim]`.

    With a ``plan`` (built with slots and positions) ``positions`` and ``slots`` may be None: the plan's checked
    ones are used. Nothing is written unless every check passes (shapes, finiteness, float16 range).
    """
    pool = as_pool(cache)
    pool.check_layer(layer)
    name = resolve_backend(pool, backend)
    planned = plan is not None and positions is None
    if planned and plan.positions is None:
        raise ShapeMismatch("the plan holds no positions: build it with positions= or pass them here")
    pos = plan.positions if planned else positions
    rows = None
    if planned:  # the tables' rows at the step's positions: checked and picked once for every layer of the step

        def pick() -> tuple[torch.Tensor, torch.Tensor]:
            write.check_rope_tables(cos, sin, pool.head_dim, rope_style)
            return write.rope_rows(pos, cos, sin)

        key = ("rope-rows", cos, sin, pool.head_dim, rope_style)
        rows = plan.derived(key, pick)
        plain = q_norm_weight is None and k_norm_weight is None and rope_style == "neox"  # split_rotate's case
        if plain and slots is None and name != "triton" and pool.device.type == "cpu":
            rows_np = plan.derived((*key, "numpy"), lambda: tuple(t.reshape(t.shape[0], -1).numpy() for t in rows))
            q = write.split_rotate_store(pool, layer, qkv, num_q_heads, plan, rows_np)
            if q is not None:
                return q
    q, k, v = prepare_qkv(
        pool, qkv, pos, cos, sin, num_q_heads, q_norm_weight, k_norm_weight, eps, rope_style,
        positions_checked=planned, rows=rows,
    )  # fmt: skip
    write.append_paged_kv(pool, layer, k, v, slots, plan=plan if slots is None else None, backend=name)
    return q


def paged_decode_attention(
    cache: PagedKvCache | KvPool,
    layer: int,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    precision: str | None = None,
) -> torch.Tensor:
    """`q [batch, Hq, D]` attends to its sequence's positions [kv_start, context_len); float32 `[batch, Hq, D]`.

    ``window``, ``chunk``, ``softcap``, ``sinks``: as in :func:`attention`; ``precision``: as in
    :func:`plan_attention`."""
    pool = as_pool(cache)
    plan = plan_attention(
        pool, block_tables, context_lens, kv_starts=kv_starts, softmax_scale=softmax_scale, precision=precision
    )
    return attention(pool, layer, q, plan, backend=backend, window=window, chunk=chunk, softcap=softcap, sinks=sinks)


def paged_prefill_attention(
    cache: PagedKvCache | KvPool,
    layer: int,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    precision: str | None = None,
) -> torch.Tensor:
    """Causal chunked prefill over `q [total, Hq, D]` packed by `cu_seqlens_q`; float32 `[total, Hq, D]`.

    ``window``, ``chunk``, ``softcap``, ``sinks``: as in :func:`attention`; ``precision``: as in
    :func:`plan_attention`."""
    pool = as_pool(cache)
    num_queries = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() >= 1 else None
    plan = plan_attention(
        pool, block_tables, context_lens, cu_seqlens_q=cu_seqlens_q, kv_starts=kv_starts,
        num_queries=num_queries, softmax_scale=softmax_scale, precision=precision,
    )  # fmt: skip
    return attention(pool, layer, q, plan, backend=backend, window=window, chunk=chunk, softcap=softcap, sinks=sinks)
