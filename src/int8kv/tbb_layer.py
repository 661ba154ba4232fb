"""numba's tbb threading layer made loadable from the ``tbb`` wheel, so the parallel kernels run on a fork-safe
layer.

numba takes the first of tbb, omp and workqueue that loads. On omp (GNU OpenMP, found wherever ``libgomp1`` is
installed) a process that has run a parallel kernel cannot fork: the child ends at its first parallel kernel
("Terminating: fork() called from a process already using GNU OpenMP, this is unsafe"), and Python's
multiprocessing forks by default on Linux. tbb is fork- and thread-safe. The ``tbb`` wheel (a dependency on Linux
x86_64) puts ``libtbb.so.12`` in ``<prefix>/lib``, outside the dynamic loader's path, so numba's tbb extension,
which asks for that name, failed to load and numba took omp. :func:`load_tbb` loads the library by its path
first (global symbols), which satisfies the name; it runs when the package is imported, before numba starts its
threads. A layer the user names (``NUMBA_THREADING_LAYER=omp`` or ``workqueue``) is left alone.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys

__all__ = ["TBB_LIBRARY", "load_tbb"]

TBB_LIBRARY = "libtbb.so.12"  # the name numba's tbbpool extension links to


def load_tbb(environ: dict[str, str] | None = None) -> str | None:
    """Load the ``tbb`` wheel's ``libtbb.so.12`` (from this environment's or the user's ``lib``); its path, or
    None where there is none to load (not Linux, no wheel, a layer other than tbb named, or a library that does
    not load: numba then picks among the others as before)."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or env.get("NUMBA_THREADING_LAYER", "").lower() in ("omp", "workqueue"):
        return None
    for base in dict.fromkeys((sys.prefix, sys.base_prefix, site.getuserbase())):
        path = os.path.join(base, "lib", TBB_LIBRARY)
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return None
            return path
    return None
