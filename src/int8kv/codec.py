"""The frozen V1 codec. Data written by V1 must decode identically forever.

For each row ``x`` (the last dimension):

1. any NaN or +-inf -> ``NonFiniteError``;
2. ``x16 = float16(x)`` (round to nearest even); an overflow to inf -> ``NonFiniteError``;
3. ``scale = float32(max|x16| / 127)`` in float32; an all-zero row gets ``scale = 1``;
4. ``q = clamp(round_half_even(float32(x16 / scale)), -127, 127)`` as int8;
5. decode: ``float32(q) * scale``.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import torch

from .errors import NonFiniteError, ShapeMismatch

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QMAX = 127


def _describe_first(bad: torch.Tensor) -> str:
    index = tuple(int(i) for i in torch.nonzero(bad)[0])
    return f"{int(bad.sum())} value(s), first at index {index}"


def checked_input(x: object, what: str = "KV input") -> torch.Tensor:
    """``x`` as a tensor the codec can read, detached: a cache stores values, never an autograd graph.

    Refuses (ShapeMismatch) anything but a float32/float16/bfloat16 tensor with at least one dimension,
    and meta tensors, which have a shape but no values to encode.
    """
    if not isinstance(x, torch.Tensor):
        raise ShapeMismatch(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ShapeMismatch(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1:
        raise ShapeMismatch(f"{what} must have at least one dimension, got a 0-d tensor")
    if x.is_meta:
        raise ShapeMismatch(f"{what} is a meta tensor: it holds no values to encode")
    return x.detach()


def round_to_f16(x: torch.Tensor, what: str = "KV input") -> torch.Tensor:
    """Step 1-2 of V1 (and the whole F16 format): check finiteness, round to float16 (detached)."""
    x = checked_input(x, what)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise NonFiniteError(f"{what} holds NaN or inf: {_describe_first(bad)}")
    x16 = x.to(torch.float16)
    bad = ~torch.isfinite(x16)
    if bool(bad.any()):
        raise NonFiniteError(f"{what} overflows float16 (|x| > 65504): {_describe_first(bad)}")
    return x16


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode rows of ``x`` ``[..., d]`` with V1: int8 codes ``[..., d]`` and float32 scales ``[...]``.

    The outputs never require grad, whatever ``x`` does.
    """
    x = checked_input(x)
    if x.shape[-1] == 0:
        raise ShapeMismatch(f"quantize_int8 needs rows of at least one value, got shape {tuple(x.shape)}")
    if x.device.type == "cpu" and x.numel() > 0:
        return _quantize_int8_cpu(x)
    return quantize_int8_torch(x)


def quantize_int8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V1 in plain torch ops: the path for non-CPU tensors, and the readable statement of the codec."""
    x32 = round_to_f16(x).to(torch.float32)
    scale = x32.abs().amax(dim=-1) / QMAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x32 / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _quantize_int8_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from . import _codec_cpu
    from .numba_threads import launch

    # float16/bfloat16 -> float32 is exact, so rounding to float16 afterwards is still one rounding.
    rows = x.to(torch.float32).reshape(-1, x.shape[-1]).contiguous().numpy()
    # numpy's allocations, shared with torch: a fraction of torch.empty's fixed cost, which is what counts here
    # (a decode step encodes every layer's few rows).
    q = np.empty(rows.shape, np.int8)
    scale = np.empty(rows.shape[0], np.float32)
    if rows.size < _codec_cpu.SERIAL_ELEMENTS:  # a decode step's few rows: no thread pool to set or wake
        bad = _codec_cpu.quantize_rows_serial(rows, q, scale)
    else:
        with _codec_cpu.threads_for(rows.size) as threads:
            bad = launch(_codec_cpu.quantize_rows, rows, q, scale, threads)
    if bad:
        refuse_rows(bad, x)
    return torch.from_numpy(q).view(x.shape), torch.from_numpy(scale).view(x.shape[:-1])


def quantize_int8_store(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_dst, v_dst, arrays: tuple | None = None
) -> bool:
    """Encode K and V rows ``[n, heads, d]`` with V1 and store them at int64 ``slots [n]`` of ``k_dst`` /
    ``v_dst`` (each ``(codes int8 [S, heads, d], scales float32 [S, heads])``) in one CPU kernel call; nothing
    is stored if a row is not finite in float16 (NonFiniteError). Returns False, storing nothing, where that
    kernel does not apply (not all on the CPU, a destination not C-contiguous, more than a few rows): the caller
    encodes and stores in two steps then. ``k``, ``v``: float32, float16 or bfloat16, any strides. ``arrays``:
    numpy views of ``(*k_dst, *v_dst)`` kept by the caller (``KvPool.row_arrays``), or None."""
    from . import _codec_cpu

    if k.numel() >= _codec_cpu.SERIAL_ELEMENTS or k.device.type != "cpu" or v.device.type != "cpu":
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in (slots, *k_dst, *v_dst)):
        return False
    # Rows already float32 and contiguous (a decode step's, most often) go as they are: `.to` + `.contiguous`
    # of an unchanged tensor are still a torch call each per side.
    kn, vn = (
        (x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()).numpy()
        for x in (k, v)
    )
    dst = arrays if arrays is not None else tuple(t.numpy() for t in (*k_dst, *v_dst))
    bad = _codec_cpu.quantize_store(kn, vn, slots.numpy(), *dst)
    if bad:
        refuse_rows(bad, k, v)
    return True


def refuse_rows(bad: int, *rows: torch.Tensor) -> NoReturn:
    """NonFiniteError for ``bad`` rows of ``rows`` that a format's compiled store (V1's, F16's) found not finite in
    float16 (and so left unstored), naming the first bad value where :func:`round_to_f16` can."""
    for x in rows:
        round_to_f16(x)  # raises with the location of the first bad value
    raise NonFiniteError(f"KV input holds {bad} row(s) that are not finite in float16")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Decode V1 codes ``q`` int8 ``[..., d]`` with ``scale`` float32 ``[...]``: ``float32(q) * scale``."""
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise ShapeMismatch(f"codes and scales must be tensors, got {type(q).__name__} and {type(scale).__name__}")
    if q.dtype != torch.int8:
        raise ShapeMismatch(f"codes must be int8, got {q.dtype}")
    if q.dim() < 1:
        raise ShapeMismatch("codes must have at least one dimension (a row), got a 0-d tensor")
    if q.is_meta or scale.is_meta:
        raise ShapeMismatch("codes or scales are meta tensors: they hold no values to decode")
    if q.device != scale.device:
        raise ShapeMismatch(f"codes are on {q.device} but scales on {scale.device}")
    q, scale = q.detach(), scale.detach()
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ShapeMismatch(
            f"scales must be float32 of shape {tuple(q.shape[:-1])}, got {scale.dtype} {tuple(scale.shape)}"
        )
    if q.device.type == "cpu" and q.numel() > 0:
        from . import _codec_cpu
        from .numba_threads import launch

        rows = q.reshape(-1, q.shape[-1]).contiguous()
        out = torch.empty(rows.shape, dtype=torch.float32)
        with _codec_cpu.threads_for(rows.numel()):
            launch(_codec_cpu.dequantize_rows, rows.numpy(), scale.reshape(-1).contiguous().numpy(), out.numpy())
        return out.reshape(q.shape)
    return q.to(torch.float32) * scale.unsqueeze(-1)

