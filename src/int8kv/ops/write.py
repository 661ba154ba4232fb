"""The one write path: split QKV -> QK-norm -> RoPE -> check -> encode -> store, for every cache and backend.

This module owns every check a write needs and the encoding; a pool (:class:`~int8kv.cache.pool.KvPool`) only
stores the encoded rows it is given. The rules, the same for the paged cache, the engine and the transformers
cache:
- rows are ``[tokens, num_kv_heads, head_dim]`` float32/float16/bfloat16 on the pool's device (a tensor on
  another device is refused, never moved behind the caller's back);
- slots are int32/int64 ``[tokens]`` on the pool's device, inside the pool and distinct (two rows written to
  one slot would leave one token's codes beside another's scale);
- K and V are encoded together in one codec call, before the first store, so an error (NaN/inf, float16
  overflow, bad shape) leaves the pool untouched.
A step planned with :func:`int8kv.ops.plan.plan_attention` carries slots and positions already checked, so
per layer only the rows themselves are checked (their values differ per layer).

On CUDA with the ``triton`` backend the rows go to Triton's fused quantize-and-store kernel, whose codes and
scales are bit-identical to the format's encoder (``fmt.encode``) (tests/test_ops_triton.py): the same encoding, one
kernel instead of several.
"""

from __future__ import annotations

import numpy as np
import torch

from ..codec import refuse_rows, round_to_f16
from ..errors import NonFiniteError, PositionOutOfRange, ShapeMismatch
from .plan import INDEX_DTYPES, AttentionPlan, check_slots

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROPE_STYLES = ("neox", "gptj")


def split_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed `[tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]` -> float32 q, k, v `[tokens, heads, dim]`."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != width:
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ShapeMismatch(f"qkv must be [tokens, {width}] ((q + 2 * kv heads) * head_dim), got {got}")
    if qkv.dtype not in FLOAT_DTYPES:
        raise ShapeMismatch(f"qkv must be float32, float16 or bfloat16, got {qkv.dtype}")
    x = qkv.detach()  # a KV cache stores values, not graphs
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    q, k, v = x.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    tokens = qkv.shape[0]
    return (
        q.reshape(tokens, num_q_heads, head_dim),
        k.reshape(tokens, num_kv_heads, head_dim),
        v.reshape(tokens, num_kv_heads, head_dim),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (QK-norm per head, and the decoder's norms); identity when `weight` is None."""
    if weight is None:
        return x
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ShapeMismatch(f"norm weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    w = weight if weight.dtype == torch.float32 and weight.device == x.device else weight.to(x.device, torch.float32)
    if x.dtype == torch.float32:
        # torch's rms_norm is this expression's operations in this order (pow, mean, add, rsqrt, mul, mul: its
        # composite kernel), so the same bits (tests/test_write.py), in one call from Python instead of six, which
        # counts because the engine's step runs dozens of them.
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


# Rows at most this many (a decode step's batch) go through the CPU's compiled rotation and numpy's finiteness
# check; more through torch's operations, whose per-call cost is then small beside the work.
_FEW_ROWS = 64


def rope_rows(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `cos/sin [max_pos, dim // 2]` at `positions [tokens]`, float32 `[tokens, 1, dim // 2]` each:
    the same for every layer of a step (a planned write keeps them in its plan)."""
    return cos[positions].to(torch.float32).unsqueeze(1), sin[positions].to(torch.float32).unsqueeze(1)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox",
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rotary embedding of `x [tokens, heads, dim]` with `cos/sin [max_pos, dim // 2]` rows picked by position
    (``rows``: :func:`rope_rows` of them, already picked).

    "neox" rotates the pairs (i, i + dim/2) (rotate-half, Llama/NeoX); "gptj" rotates the pairs (2i, 2i + 1).
    """
    c, s = rows if rows is not None else rope_rows(positions, cos, sin)
    if style == "neox" and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= _FEW_ROWS:
        # A decode step's rows: one compiled loop, torch's arithmetic in torch's order (ops/cpu_rope.py).
        from .cpu_rope import rope_neox

        cn, sn = (t.detach().reshape(t.shape[0], -1).numpy() for t in (c, s))
        return torch.from_numpy(rope_neox(x.detach().numpy(), cn, sn))
    if style == "neox":
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, style: str) -> None:
    if style not in ROPE_STYLES:
        raise ShapeMismatch(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
    if head_dim % 2:
        raise ShapeMismatch(f"RoPE needs an even head_dim, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != head_dim // 2:
            raise ShapeMismatch(f"{name} must be [max_pos, {head_dim // 2}]")
        if table.dtype not in (*FLOAT_DTYPES, torch.float64):
            raise ShapeMismatch(f"{name} must be a floating tensor, got {table.dtype}")
    if cos.shape != sin.shape:
        raise ShapeMismatch(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")


def check_positions(positions: torch.Tensor, tokens: int, max_pos: int) -> torch.Tensor:
    """Positions of a single write (a planned step checked them in its plan): int64 ``[tokens]``."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] != tokens:
        raise ShapeMismatch(f"positions must be [{tokens}]")
    if positions.dtype not in INDEX_DTYPES:
        raise ShapeMismatch(f"positions must be int32/int64, got {positions.dtype}")
    if tokens and (int(positions.min()) < 0 or int(positions.max()) >= max_pos):
        raise PositionOutOfRange(f"positions must lie in [0, {max_pos}) (rows of the cos/sin tables)")
    return positions.to(torch.int64)


def _check_finite(x: torch.Tensor, what: str) -> None:
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16) and x.shape[0] <= _FEW_ROWS:
        finite = bool(np.isfinite(x.detach().numpy()).all())  # numpy: torch's isfinite + all cost far more per call
    else:
        finite = bool(torch.isfinite(x).all())
    if not finite:
        raise NonFiniteError(f"{what} holds NaN or inf")


_Q_CHECKED = "q after QK-norm and RoPE"  # what prepare_qkv's second check names


def serial_elements() -> int:
    """Values per side (K or V) below which a compiled store encodes on the calling thread: the codec's own bound
    (``_codec_cpu.SERIAL_ELEMENTS``; more go through the route that splits them over threads)."""
    from .._codec_cpu import SERIAL_ELEMENTS  # loaded by then: a format's compiled store lives there

    return SERIAL_ELEMENTS


def split_rotate_store(
    pool, layer: int, qkv: torch.Tensor, num_q_heads: int, plan: AttentionPlan, rows: tuple[np.ndarray, np.ndarray]
) -> torch.Tensor | None:
    """A planned step of few rows, without QK-norm, with "neox" RoPE, on the CPU (:func:`int8kv.ops.paged_write`'s
    decode step) in two compiled calls: split, rotate and check (``cpu_rope.split_rotate``), then the format's
    compiled store (``KvPool.compiled_store``) at the plan's slots. ``rows``: the step's cos and sin rows as numpy
    ``[tokens, dim / 2]`` (:func:`rope_rows`'s, viewed). Returns float32 q ``[tokens, num_q_heads, dim]``, checked
    finite, or None with nothing done where this route does not apply (another format, device or dtype, a
    non-contiguous or autograd qkv, more than a few rows, arguments the general route refuses): the general route
    (:func:`prepare_qkv` then :func:`append_paged_kv`) then takes the step and says what is wrong. The same values,
    stores and refusals as that route (tests/test_write.py).

    It exists because the general route's ~25 Python calls a layer are a large share of a small model's decode
    step (docs/archive/benchmarks-2026.md, "The decode write through compiled calls")."""
    if getattr(pool, "writes_by_step", False) or plan.slots is None:  # cache.pool_q4w's pool: written by step
        return None
    found = pool.compiled_store(layer)
    if found is None:
        return None
    heads, dim = pool.num_kv_heads, pool.head_dim
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads <= 0 or num_q_heads % heads:
        return None
    if not isinstance(qkv, torch.Tensor) or qkv.dtype != torch.float32 or qkv.dim() != 2:
        return None
    tokens = qkv.shape[0]
    if not 0 < tokens <= _FEW_ROWS or qkv.shape[1] != (num_q_heads + 2 * heads) * dim or plan.slots.shape[0] != tokens:
        return None
    try:  # a CPU tensor without autograd (another device raises TypeError, autograd RuntimeError)
        x = qkv.numpy()
    except (TypeError, RuntimeError):
        return None
    if not x.flags.c_contiguous or tokens * heads * dim >= serial_elements():
        return None
    from .cpu_rope import split_rotate

    q = np.empty((tokens, num_q_heads, dim), np.float32)
    k, v = np.empty((tokens, heads, dim), np.float32), np.empty((tokens, heads, dim), np.float32)
    refused = split_rotate(x, rows[0], rows[1], q, k, v)
    if refused:
        raise NonFiniteError(f"{'qkv' if refused == 1 else _Q_CHECKED} holds NaN or inf")
    store, arrays = found
    bad = store(k, v, plan.derived("slots as numpy", plan.slots.numpy), *arrays)
    if bad:
        refuse_rows(bad, torch.from_numpy(k), torch.from_numpy(v))
    return torch.from_numpy(q)


def prepare_qkv(
    pool,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_style: str = "neox",
    *,
    positions_checked: bool = False,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split, QK-norm and rotate: float32 q `[tokens, num_q_heads, dim]` and k, v `[tokens, num_kv_heads, dim]`.

    ``pool`` supplies ``num_kv_heads`` and ``head_dim``. ``positions_checked``: they come from a validated plan.
    ``rows``: :func:`rope_rows` of the positions, from tables the caller checked (check_rope_tables).
    """
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads <= 0 or (
        num_q_heads % pool.num_kv_heads
    ):
        raise ShapeMismatch(f"num_q_heads ({num_q_heads}) must be a positive multiple of {pool.num_kv_heads}")
    q, k, v = split_qkv(qkv, num_q_heads, pool.num_kv_heads, pool.head_dim)
    if rows is None:
        check_rope_tables(cos, sin, pool.head_dim, rope_style)
    pos = positions if positions_checked else check_positions(positions, qkv.shape[0], len(cos))
    # cos/sin are not scanned whole (a full table per layer per step costs more than the step): a bad entry at
    # a used position makes q or k non-finite, and both are checked below or by the encoder.
    _check_finite(qkv, "qkv")
    tokens, hq, dim = q.shape
    adjacent = q.stride()[1:] == (dim, 1) and k.data_ptr() == q.data_ptr() + hq * dim * q.element_size()
    if q_norm_weight is None and k_norm_weight is None and adjacent:
        # q and k side by side in one rotation (split_qkv's q and k are adjacent columns of one float32 tensor):
        # elementwise, so the same values as two calls, with half the operations.
        qk = q.as_strided((tokens, hq + k.shape[1], dim), (q.stride(0), dim, 1))
        qk = apply_rope(qk, pos, cos, sin, rope_style, rows)
        q, k = qk[:, :hq], qk[:, hq:]
        if q.shape[0] > 1:
            q = q.contiguous()
    else:
        q = apply_rope(rms_norm(q, q_norm_weight, eps), pos, cos, sin, rope_style, rows)
        k = apply_rope(rms_norm(k, k_norm_weight, eps), pos, cos, sin, rope_style, rows)
    _check_finite(q, _Q_CHECKED)
    return q, k, v


def check_rows(pool, x: torch.Tensor, what: str) -> torch.Tensor:
    """``x [tokens, num_kv_heads, head_dim]``, a float dtype, on the pool's device."""
    shape = (pool.num_kv_heads, pool.head_dim)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShapeMismatch(f"{what} must be [tokens, {shape[0]}, {shape[1]}], got {got}")
    if x.dtype not in FLOAT_DTYPES:
        raise ShapeMismatch(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.device != pool.device:
        raise ShapeMismatch(f"{what} is on {x.device} but the cache is on {pool.device}")
    # A KV cache stores values, not graphs: rows computed with autograd on are taken without their grad_fn.
    return x.detach() if x.requires_grad else x


def kv_to_f16(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked rows ``k``, ``v`` rounded to float16; NaN, inf or |x| > 65504 refused in one host read for both.

    NaN and inf stay non-finite through the cast and an overflow becomes inf, so finiteness of the float16
    copies is the codec's whole check (one sync per layer on a GPU where ``round_to_f16`` twice takes four);
    only a failing call goes back to ``round_to_f16`` for its message."""
    k16, v16 = k.to(torch.float16), v.to(torch.float16)
    if k16.numel() and not bool(torch.isfinite(k16).all() & torch.isfinite(v16).all()):
        round_to_f16(k, "keys")
        round_to_f16(v, "values")
        raise NonFiniteError("keys or values hold NaN, inf or values beyond float16")  # pragma: no cover
    return k16, v16


def store_kv(pool, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, backend: str) -> None:
    """Encode checked rows and store them at checked int64 ``slots`` (nothing is stored if encoding fails)."""
    if backend == "triton":
        from . import triton as tk

        # The codec's checks (NaN/inf, float16 range) run here, before the fused kernel writes anything.
        tk.store_rows(pool, layer, *kv_to_f16(k, v), slots)
        return
    if k.shape[0] <= _FEW_ROWS and store_compiled(pool, layer, k, v, slots):
        return
    pool.encode_rows(layer, slots, k, v)


def store_compiled(pool, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Checked rows ``k, v [n, heads, head_dim]`` (any strides) through the format's compiled store
    (``KvPool.compiled_store``) at int64 ``slots [n]``: False, with nothing done, where it does not apply (no
    compiled store, rows or slots off the CPU or of other dtypes, as many values as the codec encodes on every
    thread); a row it refuses raises NonFiniteError, nothing stored. The pool's own route (``encode_rows``: the
    format's store, the codec's checks) reaches the same compiled function for V1 through three more Python calls;
    the transformers layer's decode step calls this directly (``Int8KvLayer._store_direct``)."""
    compiled = getattr(pool, "compiled_store", None)  # a KvPool's; a pool-like object without one: its route
    found = None if compiled is None else compiled(layer)
    if found is None:
        return False
    try:  # numpy views: CPU tensors (checked rows carry no autograd history)
        kn, vn, sn = k.numpy(), v.numpy(), slots.numpy()
    except (TypeError, RuntimeError):
        return False
    # The dtypes asked of numpy's views (cheaper than torch's attributes on this per-layer path); as many values
    # as the codec splits over threads go the pool's route.
    if kn.dtype != np.float32 or vn.dtype != np.float32 or sn.dtype != np.int64 or kn.size >= serial_elements():
        return False
    store, arrays = found
    bad = store(np.ascontiguousarray(kn), np.ascontiguousarray(vn), np.ascontiguousarray(sn), *arrays)
    if bad:
        refuse_rows(bad, k, v)
    return True


def _check_kv(pool, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pool.check_layer(layer)
    k = check_rows(pool, k, "k")
    v = check_rows(pool, v, "v")
    if k.shape[0] != v.shape[0]:
        raise ShapeMismatch(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    return k, v


def append_rows(pool, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, *, backend: str) -> None:
    """Check and store rows at int64 ``slots`` that the caller built and vouches for (distinct, in range, on the
    pool's device): a validated plan's slots, or the transformers layer's own positions."""
    k, v = _check_kv(pool, layer, k, v)
    if not isinstance(slots, torch.Tensor) or slots.shape != (k.shape[0],):
        raise ShapeMismatch(f"slots must be [{k.shape[0]}]")
    if k.shape[0]:
        store_kv(pool, layer, k, v, slots, backend)


def append_paged_kv(
    pool,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    plan: AttentionPlan | None = None,
    backend: str = "cpu",
) -> None:
    """Check, encode and store ``k, v [tokens, num_kv_heads, head_dim]`` at ``slots`` (or ``plan.slots``).

    A pool that ``writes_by_step`` (int8kv.cache.pool_q4w: its pages are sealed as sequences grow) takes the
    step's rows with the plan, which says where each sequence's rows go; slots are not used there."""
    k, v = _check_kv(pool, layer, k, v)
    if getattr(pool, "writes_by_step", False):
        if plan is None or slots is not None or k.shape[0] != plan.num_queries:
            raise ShapeMismatch(f"the {pool.format.name} pool is written by step: pass the step's plan (rows "
                                f"[num_queries, ...]) and no slots")
        pool.write_step(layer, plan, *kv_to_f16(k, v))
        return
    if plan is not None and slots is None:
        if plan.slots is None:
            raise ShapeMismatch("the plan holds no slots: build it with slots= or pass them here")
        s = plan.slots
    else:
        s = check_slots(pool, slots, k.shape[0])
    append_rows(pool, layer, k, v, s, backend=backend)
