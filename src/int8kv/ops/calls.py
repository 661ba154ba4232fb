"""Run a compiled numba function on several threads without compiling it into the parallel kernel.

numba links every callee's LLVM module into its caller's and optimises and generates machine code for the
whole again, so each level of a call chain pays for the levels below it once more. The attention kernels'
work-item loops (``_run_items`` in ops/cpu.py and ops/cpu_q4w.py) were compiled four or five times per
specialisation: alone, inside the serial entry, inside the parallel loop's gufunc and inside the parallel
entry, so the linking and the two entries cost more than the kernels themselves.

:func:`fan_out` is one small parallel kernel that calls the item loop through its address: what it compiles per
specialisation is a loop and a call. Python calls the item loop itself for a serial run. :func:`call_at` is the
call itself, for any caller: ops/cpu.py's item loop calls its per-item kernels with it, so those too are built
once, which cuts a cold compile to about a third (docs/archive/benchmarks-2026.md, "Kernel compile time"). The
address of each specialisation (:class:`Compiled`) comes from numba's own compile result, and the parallel kernel
compares a tag of the argument types it was compiled for with the tag of the specialisation behind the address before it
calls anything: arguments of other types raise TypeError instead of running code built for other types.

    fan_out(address, tag, lists [workers + 1] int64, args: tuple, then, then_tag, then_args: tuple)
        worker w runs ``function(lists[w], lists[w + 1], *args)``; lists rises from 0 to the item count; then
        (unless ``then`` is 0) the calling thread runs ``finisher(*then_args)``.
"""

from __future__ import annotations

import zlib

import numba
import numpy as np
from numba import njit, prange, types
from numba._dispatcher import compute_fingerprint
from numba.core import cgutils
from numba.core.registry import CPUDispatcher
from numba.extending import intrinsic

from ..numba_cache import require_jit, share_compiles

require_jit(__name__)

__all__ = ["INDEX", "Compiled", "call_at", "compiled_count", "failed_at", "fan_out", "signature_tag", "tag_of"]

INDEX = np.int64(0)  # an item index as the callers' compiled code types it (`first`, `last`, `it`: int64)


def signature_tag(argtypes: tuple) -> int:
    """A number that tells numba argument-type tuples apart (CRC-32 of their spelling)."""
    return zlib.crc32(repr(tuple(argtypes)).encode())


@intrinsic
def tag_of(typingctx, args):
    """The signature tag of the types of the tuple ``args``, a constant of the compiled code."""
    tag = signature_tag(tuple(args.types))

    def codegen(context, builder, sig, llargs):
        return context.get_constant(types.int64, tag)

    return types.int64(args), codegen


def _call_status(context, builder, llargs, argtypes: tuple):
    """The call of the function at the address in ``llargs`` on its packed arguments; numba's status of it."""
    address_value, packed = llargs
    values = [builder.extract_value(packed, i) for i in range(len(argtypes))]
    function_type = context.call_conv.get_function_type(types.none, argtypes)
    pointer = builder.inttoptr(address_value, function_type.as_pointer())
    status, _ = context.call_conv.call_function(builder, pointer, types.none, argtypes, values)
    return status


@intrinsic
def call_at(typingctx, address, args):
    """Call the numba-compiled function at ``address`` (a specialisation returning None) on the tuple ``args``,
    with numba's calling convention; an exception it raises propagates."""
    argtypes = tuple(args.types)

    def codegen(context, builder, sig, llargs):
        status = _call_status(context, builder, llargs, argtypes)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(types.intp, args), codegen


@intrinsic
def failed_at(typingctx, address, args):
    """`call_at` that returns whether the call raised instead of propagating its exception: what a parallel
    worker does, since a worker's exception reaches the caller on omp but is dropped on numba's workqueue layer."""
    argtypes = tuple(args.types)

    def codegen(context, builder, sig, llargs):
        return _call_status(context, builder, llargs, argtypes).is_error

    return types.boolean(types.intp, args), codegen


@njit(parallel=True, cache=True)
def fan_out(address, tag, lists, args, then, then_tag, then_args):
    """Worker w runs ``f(lists[w], lists[w + 1], *args)`` for the specialisation ``f`` at ``address`` whose
    signature tag is ``tag`` (:meth:`Compiled.address`), one worker per thread; then, unless ``then`` is 0, the
    calling thread runs ``g(*then_args)`` for the specialisation ``g`` at ``then`` (tag ``then_tag``): a merge
    of the workers' results without the overhead of a second call from Python.
    A worker's exception reaches the caller on omp as numba's SystemError but is dropped on workqueue, so the
    workers only count their failures; the first failed range then runs again on the calling thread, where its
    exception propagates as itself on every layer (the item loops raise before any item runs: a type refusal
    fails every range the same way). Should that run succeed (a failure that did not last), its work is done; with
    more failed ranges than that one, RuntimeError. The count and the first index are two reductions: an array of
    flags instead cost an allocation and a pass per call, a noticeable share of a short decode call."""
    if tag != tag_of((lists[0], lists[0]) + args) or (then != 0 and then_tag != tag_of(then_args)):
        raise TypeError("fan_out: the function at this address was compiled for other argument types")
    workers = lists.shape[0] - 1
    failed = 0
    first = workers
    for w in prange(workers):
        f = failed_at(address, (lists[w], lists[w + 1]) + args)
        failed += f
        first = min(first, w if f else workers)
    if failed:  # the first failed range again, here: a lasting failure raises as itself
        call_at(address, (lists[first], lists[first + 1]) + args)
        if failed > 1:
            raise RuntimeError("fan_out: several workers failed once; only the first one's range ran again")
    if then != 0:
        call_at(then, then_args)


class Compiled:
    """The addresses of a numba dispatcher's specialisations, found by the types of the arguments they take.
    The dispatcher keeps every specialisation it compiled (or loaded) for the life of the process, so an
    address stays valid."""

    def __init__(self, dispatcher: CPUDispatcher) -> None:
        self.dispatcher = dispatcher
        self._found: dict[bytes, tuple[int, int]] = {}  # the arguments' fingerprint -> (address, tag)

    def address(self, args: tuple) -> tuple[int, int]:
        """(address, signature tag) of the specialisation for ``args`` (compiled or loaded on first use). The
        fingerprint is what numba's dispatcher itself keys argument types by, here of the whole tuple in one
        call, a fraction of the cost of one call per argument."""
        key = compute_fingerprint(args)
        found = self._found.get(key)
        if found is None:
            argtypes = tuple(numba.typeof(a) for a in args)
            self.dispatcher.compile(argtypes)
            result = self.dispatcher.overloads[argtypes]
            if result.signature.return_type != types.none:
                raise TypeError(f"{self.dispatcher.py_func.__name__} must return None to run through fan_out")
            address = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
            found = self._found[key] = (address, signature_tag(argtypes))
        return found


def compiled_count(*dispatchers: CPUDispatcher) -> int:
    """Specialisations compiled (or loaded) so far by ``dispatchers`` and `fan_out`: a call that changed the
    count timed a compile, not the kernel."""
    return sum(len(d.overloads) for d in (*dispatchers, fan_out))


share_compiles(globals())  # int8kv.numba_cache: one compile per signature across processes
