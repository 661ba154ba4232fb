"""How many CPUs this process may really use: its affinity mask and its cgroup's CPU quota, not the machine's.

``os.cpu_count()`` counts the machine's CPUs; a container limited to two CPUs' worth of time (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us``) or pinned to a few cores (``taskset``, Kubernetes' static policy) still sees
them all, and a thread pool sized by it keeps threads waiting for time slices they will not get: every parallel
kernel then ends at the pace of its slowest, descheduled thread.

`available_cpus` is the smaller of the affinity mask's size and the quota of the process's cgroup and each of its
ancestors (quota / period, rounded up). `apply_budget` runs when the package is imported: it sizes numba's pool
(``NUMBA_NUM_THREADS``) to that count where the user has not set it, and `limit_torch` (the engine and the drop-in
cache call it) lowers torch's intra-op threads to it, so neither runs more threads than the process has CPUs.
An explicit ``NUMBA_NUM_THREADS`` / ``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from pathlib import Path

__all__ = ["apply_budget", "available_cpus", "cgroup_quota", "limit_torch"]


def _read(path: Path) -> str | None:
    """The first 4 KiB of a regular file, or None: absent, unreadable or anything else (a FIFO would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _quota_v2(text: str | None) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000"); None: no limit."""
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(quota: str | None, period: str | None) -> float | None:
    try:
        q, p = int((quota or "").strip()), int((period or "").strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota(proc_self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
                 root: str | os.PathLike[str] = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the process's cgroup allows (the tightest of the cgroup and its ancestors), or None
    where no quota applies or none can be read. Paths are parameters so tests can lay out a hierarchy."""
    text = _read(Path(proc_self_cgroup))
    if not text:
        return None
    root = Path(root)
    limits: list[float] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        rel_parts = [p for p in rel.split("/") if p and p not in (".", "..")]
        if controllers == "":  # cgroup v2: one unified hierarchy
            for depth in range(len(rel_parts), -1, -1):
                limit = _quota_v2(_read(root.joinpath(*rel_parts[:depth], "cpu.max")))
                if limit is not None:
                    limits.append(limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                base = root / mount
                if not base.is_dir():
                    continue
                for depth in range(len(rel_parts), -1, -1):
                    here = base.joinpath(*rel_parts[:depth])
                    limit = _quota_v1(_read(here / "cpu.cfs_quota_us"), _read(here / "cpu.cfs_period_us"))
                    if limit is not None:
                        limits.append(limit)
                break
    return min(limits) if limits else None


def available_cpus() -> int:
    """The CPUs this process can keep busy at once: its affinity mask, capped by its cgroup quota (rounded up:
    1.5 CPUs of quota still run two threads part of the time); at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None:
        count = min(count, math.ceil(quota - 1e-9))
    return max(1, count)


def apply_budget(environ: dict[str, str] | None = None) -> int:
    """Size numba's pool to `available_cpus` where the process has fewer CPUs than the machine and the user set no
    ``NUMBA_NUM_THREADS`` (numba's default is the machine's count); lower torch's intra-op threads likewise if
    torch is already imported (`limit_torch`). Returns the count. Runs at the package's import (module docs)."""
    env = os.environ if environ is None else environ
    cpus = available_cpus()
    if cpus < (os.cpu_count() or cpus) and "NUMBA_NUM_THREADS" not in env and "numba" not in sys.modules:
        env["NUMBA_NUM_THREADS"] = str(cpus)
    if environ is None and "torch" in sys.modules:
        limit_torch(cpus)
    return cpus


def limit_torch(cpus: int | None = None) -> int:
    """Lower torch's intra-op thread count to ``cpus`` (default `available_cpus`) unless the user chose it
    (``OMP_NUM_THREADS`` set) or it is already no higher; returns torch's count. torch's own default is the
    machine's physical cores, blind to a cgroup quota."""
    import torch

    cpus = available_cpus() if cpus is None else cpus
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)
    return torch.get_num_threads()
