"""Every load and store of a Triton kernel under the interpreter checked against the memory its launch was given.

Inside :func:`checked`, each kernel launch records the storage extents of its tensor arguments, and each load or
store the interpreter performs checks that every address whose mask is on lies, with its whole element, inside
one of them. An address outside them all is what faults on a GPU (or silently reads another allocation); the
interpreter itself reads and writes host memory without any check, so such a lane is recorded and masked off
(the test fails, the process does not). The kernels' own tests run with it on
(tests/test_ops_triton.py, tests/test_triton_q4w.py); tests/test_triton_bounds.py shows it catches a planted
out-of-bounds load and store and counts no masked-off lane.

Not thread-safe (it patches the interpreter's classes for the duration); a no-op where Triton compiles (a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch


@dataclasses.dataclass
class Seen:
    """What the checked launches did: ``accesses`` (elements loaded or stored with the mask on) and
    ``violations`` (kernel, 'load' / 'store', how many elements fell outside, the first bad address)."""

    accesses: int = 0
    launches: int = 0
    violations: list[tuple[str, str, int, int]] = dataclasses.field(default_factory=list)

    def report(self) -> str:
        return "; ".join(f"{k}: {n} {what}(s) outside every argument, first at {hex(a)}"
                         for k, what, n, a in self.violations[:8])  # fmt: skip


def interpreted() -> bool:
    """Whether the Triton kernels were bound to the interpreter (the mode is fixed when they are imported)."""
    from int8kv.ops import triton as tk

    return not tk.is_compiled()


def _extents(values) -> list[tuple[int, int]]:
    out = []
    for a in values:
        if isinstance(a, torch.Tensor) and a.device.type == "cpu":
            s = a.untyped_storage()
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return out


@contextlib.contextmanager
def checked():
    """Check every interpreted launch's memory accesses inside the block; yields the :class:`Seen` record."""
    seen = Seen()
    if not interpreted():
        yield seen
        return
    import triton.runtime.interpreter as itp

    builder, executor = itp.InterpreterBuilder, itp.GridExecutor
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__
    frames: list[tuple[str, np.ndarray, np.ndarray]] = []  # (kernel, extent starts, extent ends), per launch

    def check(ptrs, mask, what: str):
        """The mask with every lane outside the launch's arguments turned off (recorded as a violation): the
        interpreter never touches memory a kernel was not given, so a bad kernel fails its test, not the run."""
        if not frames:
            return mask
        name, lo, hi = frames[-1]
        size = np.uint64(itp._get_np_dtype(ptrs.get_element_ty()).itemsize)
        on = np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)
        p = ptrs.data.astype(np.uint64)
        inside = ((p[..., None] >= lo) & (p[..., None] + size <= hi)).any(axis=-1)
        seen.accesses += int(on.sum())
        stray = on & ~inside
        if not stray.any():
            return mask
        seen.violations.append((name, what, int(stray.sum()), int(p[stray].ravel()[0])))
        return itp.TensorHandle(on & inside, mask.dtype)

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, check(ptrs, mask, "load"), other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, check(ptrs, mask, "store"), cache_policy)

    def checked_call(self, *args, **kwargs):
        ext = _extents([*args, *kwargs.values()])
        lo = np.array([e[0] for e in ext], dtype=np.uint64)
        hi = np.array([e[1] for e in ext], dtype=np.uint64)
        frames.append((getattr(self.fn, "__name__", str(self.fn)), lo, hi))
        seen.launches += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            frames.pop()

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    executor.__call__ = checked_call
    try:
        yield seen
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        executor.__call__ = call
