"""numba's threading layer, as int8kv's parallel kernels meet it: every Python call of a ``parallel=True`` kernel
goes through :func:`launch`.

numba runs ``prange`` loops on one of three layers, the first of ``NUMBA_THREADING_LAYER_PRIORITY`` (tbb, omp,
workqueue) that loads. omp needs the system's GNU OpenMP runtime under the name ``libgomp.so.1.0.0`` (Debian's
``libgomp1``; torch's bundled copy does not count), tbb the ``tbb`` package. Without either, as in a slim
container image, numba takes workqueue, which aborts the whole process when two threads launch parallel kernels
at once ("Concurrent access has been detected"): three threads calling ``ops.attention`` did that at their first
overlap. omp and tbb take concurrent launches, so :func:`launch` calls straight through on them; on workqueue
(and before the first launch tells which layer runs) it holds a process-wide lock around each launch, so threads
take turns instead of ending the process. (A launch from a numba kernel of another library in the process is
outside this lock.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numba

__all__ = ["THREAD_SAFE_LAYERS", "launch", "layer", "thread_count"]

THREAD_SAFE_LAYERS = ("omp", "tbb")

_LOCK = threading.Lock()
_safe = False  # the layer in use takes concurrent launches
_named = False  # numba has named its layer (after the first parallel launch): _safe is final


def layer() -> str | None:
    """The name of the threading layer numba runs parallel kernels on; None before the first one has run."""
    try:
        return numba.threading_layer()
    except ValueError:  # "Threading layer is not initialized"
        return None


_COUNT: list[Callable[[], int]] = []  # numba's C getter of the calling thread's count, once its threads run


def thread_count() -> int:
    """``numba.get_num_threads()``: the calling thread's count, as ``numba.set_num_threads`` last set it in that
    thread. numba's function takes two locks (making sure its threads are launched) before it asks its C
    getter; once they are, this asks the getter alone, skipping the locks (the CPU attention asks it at every
    ``ops.attention`` call). A numba without that getter gets its public function every time."""
    if _COUNT:
        return _COUNT[0]()
    count = numba.get_num_threads()  # launches the threads, after which numba holds the getter
    getter = getattr(getattr(numba.np.ufunc, "parallel", None), "_get_num_threads", None)
    _COUNT.append(getter if callable(getter) and getter() == count else numba.get_num_threads)
    return count


def launch(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)`` for a numba ``parallel=True`` kernel: one launch at a time in the process unless the
    layer is known to take concurrent ones (module docs). Costs one Python call on omp and tbb."""
    if _safe:
        return kernel(*args)
    return _launch_in_turn(kernel, args)


def _launch_in_turn(kernel: Callable[..., Any], args: tuple) -> Any:
    global _safe, _named
    with _LOCK:
        out = kernel(*args)
    if not _named:  # asked until numba names its layer, then never again (on workqueue every launch comes here)
        name = layer()
        _named, _safe = name is not None, name in THREAD_SAFE_LAYERS
    return out
