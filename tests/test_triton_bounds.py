"""The interpreter's bounds check (tests/triton_bounds.py) that the Triton kernels' own tests run under: it
reports a load and a store past a tensor's end, counts no masked-off lane, and accepts a kernel that stays inside
its arguments."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton_bounds import checked, interpreted  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreted(), reason="the check runs under the Triton interpreter")


@triton.jit
def _shifted_copy(src_ptr, dst_ptr, read_shift, write_shift, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + i + read_shift, mask=i < n, other=0.0)
    tl.store(dst_ptr + i + write_shift, x, mask=i < n)


def _run(read_out: int, write_out: int, n: int = 16):
    """One launch over 16 elements, ``read_out`` / ``write_out`` of them shifted past an end of ``src`` /
    ``dst``: the end away from the other tensor, so the stray addresses lie outside both arguments."""
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    away = 1 if src.data_ptr() > dst.data_ptr() else -1  # +1: past src's end, with dst below it
    with checked() as seen:
        _shifted_copy[(1,)](src, dst, away * read_out, -away * write_out, n, BLOCK=32)
    return seen, dst


def test_a_kernel_inside_its_arguments_passes_and_masked_lanes_are_not_counted():
    seen, dst = _run(0, 0)
    assert torch.equal(dst, torch.arange(16, dtype=torch.float32))
    assert seen.launches == 1 and seen.violations == []
    assert seen.accesses == 32  # 16 loads and 16 stores: the 16 masked-off lanes of each are not accesses


@pytest.mark.parametrize(("read_out", "write_out", "what", "outside"), [(5, 0, "load", 5), (0, 3, "store", 3)])
def test_an_access_past_an_argument_is_reported(read_out, write_out, what, outside):
    seen, _ = _run(read_out, write_out)
    assert [(v[0], v[1], v[2]) for v in seen.violations] == [("_shifted_copy", what, outside)]
    assert "outside every argument" in seen.report()


def test_the_check_ends_with_the_block():
    with checked():
        pass
    src, dst = torch.zeros(4), torch.zeros(16)
    _shifted_copy[(1,)](src, dst, 0, 0, 4, BLOCK=32)  # no check here: the interpreter is as it was
    with checked() as seen:
        _shifted_copy[(1,)](src, dst, 0, 0, 4, BLOCK=32)
    assert seen.violations == [] and seen.accesses == 8
