"""One thread or all of the process's CPUs for a whole engine step, whichever is measured faster right now.

On an idle machine two threads decode faster than one. With another CPU-bound process on a core, every parallel
region (torch's matmuls, the attention and weight kernels: hundreds a step) ends by waiting for a thread the OS
has not scheduled, and a step can take 50 times as long as on one thread. The attention kernels choose per call
(`ops.thread_choice`), but the model's matmuls are most of a step, so the engine chooses per step:

* each step size (tokens, in powers of two) keeps a running estimate of its seconds in each mode, and the
  cheaper mode runs;
* the other mode is measured again on one step when it is due: after `EXPLORE` steps, the wait doubling each
  time it still loses, and never sooner than keeps that measuring under `OVERHEAD` of the time (a mode 50x
  slower is asked again after ~1,000 steps, not 16);
* it is due at once when the chosen mode's own time moves by a factor `CHANGE` while the other is within reach
  (the load changed);
* while other processes keep the process's CPUs busy (`OtherLoad`, from /proc/stat), every step runs on one
  thread without measuring the parallel mode, which is due again as soon as that load goes (`StepThreads`);
* a new step size starts with the mode the nearest measured size chose, and where that size found the other
  mode `BORROW` times slower, takes that ratio instead of paying for the slow mode's first measurements;
* a step that compiled a kernel or failed is not recorded.

Outputs never depend on the choice: only how many threads share the same work.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..cpu_budget import available_cpus, limit_torch

__all__ = ["OtherLoad", "StepChoice", "StepThreads"]

T = TypeVar("T")


class StepChoice:
    """The rules above, over measured seconds; no clocks or threads of its own (tests drive it directly)."""

    FIRST = 2  # measurements of each mode before the estimates decide (the faster of them kept)
    EXPLORE = 16  # steps before the losing mode is measured again, doubled each time it still loses
    MAX_WAIT = 2048
    OVERHEAD = 0.05  # the share of time re-measuring a losing mode may cost
    DECAY = 0.2  # weight of the newest measurement: a running mean, outliers included (no clipping, unlike
    # ThreadChoice's calls): under load a parallel step is fast most of the time and 20-40x slower whenever the OS
    # deschedules one of its threads, and it is the mean that sets the tokens per second
    CHANGE = 1.3  # the chosen mode's estimate moving this much from its level when it won: the other is due
    CHANGE_RATIO = 2.0  # ... while the other mode's estimate is within this factor of the chosen one's
    BORROW = 3.0  # a new step size takes a nearer size's ratio where one mode is this many times slower

    def __init__(self) -> None:
        self.rate: dict[tuple[bool, int], float] = {}  # (parallel, group) -> seconds a step
        self.samples: dict[tuple[bool, int], int] = {}
        self.calls: dict[int, int] = {}  # group -> steps so far
        self.due: dict[int, int] = {}  # group -> the step at which the losing mode is measured again
        self.wait: dict[int, int] = {}  # group -> the last wait set
        self.level: dict[int, float] = {}  # group -> the chosen mode's estimate when it last won
        self.measuring = False  # whether the step being run was chosen to measure the losing mode

    @staticmethod
    def group(tokens: int) -> int:
        return int(tokens).bit_length()

    def best(self, g: int) -> bool | None:
        """The mode with the lower estimate in group g; None before both are measured `FIRST` times."""
        if any(self.samples.get((m, g), 0) < self.FIRST for m in (False, True)):
            return None
        return self.rate[(True, g)] < self.rate[(False, g)]

    def parallel(self, tokens: int, threads: int) -> bool:
        """The mode for the next step of ``tokens`` tokens."""
        self.measuring = False
        if threads <= 1 or tokens <= 0:
            return False
        g = self.group(tokens)
        n = self.calls[g] = self.calls.get(g, 0) + 1
        if any(self.samples.get((m, g), 0) < self.FIRST for m in (False, True)):
            near = self._nearest(g)  # a size still being learned: the nearest measured size's best first
            for mode in (False, True) if near is None or not near[0] else (True, False):
                if self.samples.get((mode, g), 0) < self.FIRST:
                    return mode
        best = self.rate[(True, g)] < self.rate[(False, g)]
        if n >= self.due.get(g, 0):
            self.measuring = True
            return not best
        return best

    def _nearest(self, g: int) -> tuple[bool, float] | None:
        """(best mode, how many times slower the other is) of the decided size group nearest to g, or None."""
        decided = [h for h in self.calls if h != g and self.best(h) is not None]
        if not decided:
            return None
        h = min(decided, key=lambda h: (abs(h - g), h))
        best = self.rate[(True, h)] < self.rate[(False, h)]
        return best, self.rate[(not best, h)] / max(self.rate[(best, h)], 1e-12)

    def make_due(self, tokens: int) -> None:
        """Measure the losing mode of steps of ``tokens`` tokens at their next step (the load changed)."""
        g = self.group(tokens)
        self.due[g] = min(self.due.get(g, 0), self.calls.get(g, 0) + 1)

    def record(self, parallel: bool, tokens: int, seconds: float | None) -> None:
        """What a step of ``tokens`` tokens took in mode ``parallel``; None: it says nothing (it compiled, failed)."""
        measuring, self.measuring = self.measuring, False
        if seconds is None or tokens <= 0:
            return
        g = self.group(tokens)
        key = (parallel, g)
        count = self.samples[key] = self.samples.get(key, 0) + 1
        old = self.rate.get(key)
        if old is None or count <= self.FIRST:
            self.rate[key] = seconds if old is None else old + (seconds - old) / count  # the first ones' mean
        elif measuring and seconds * self.CHANGE < old:  # a re-measured mode much faster stands whole: the load
            self.rate[key] = seconds  # changed (a figure only a little better is one more sample of the mean)
        else:
            self.rate[key] = old + self.DECAY * (seconds - old)
        other = (not parallel, g)
        near = self._nearest(g) if count == self.FIRST and other not in self.samples else None
        if near is not None and near[1] >= self.BORROW:
            # A new step size where another size found one mode several times slower: the same ratio is taken
            # for this size instead of two more steps at that cost (it is measured when due, like any loser).
            if near[0] == parallel:
                self.rate[other], self.samples[other] = self.rate[key] * near[1], self.FIRST
        best = self.best(g)
        if best is None:
            return
        n = self.calls.get(g, 0)
        if measuring or g not in self.due:
            won = best == parallel  # the re-measured mode (or, at the start, the last one measured) now wins
            wait = self.EXPLORE if won or g not in self.wait else min(2 * self.wait[g], self.MAX_WAIT)
            ratio = self.rate[(not best, g)] / max(self.rate[(best, g)], 1e-12)
            wait = min(max(wait, math.ceil((ratio - 1) / self.OVERHEAD)), self.MAX_WAIT)
            self.wait[g], self.due[g] = wait, n + wait
            self.level[g] = self.rate[(best, g)]
        elif parallel == best and self.rate[(not best, g)] < self.CHANGE_RATIO * self.rate[key]:
            # Only while the other mode is within reach: 30 % either way cannot make a mode 10x slower the faster
            # one, and when a load leaves, one thread's time barely moves (the idle CPUs show it: StepThreads).
            level = self.level.setdefault(g, self.rate[key])
            if not level / self.CHANGE <= self.rate[key] <= self.CHANGE * level:
                self.due[g] = n + 1
                self.level[g] = self.rate[key]


class OtherLoad:
    """CPU time other processes took on the CPUs of this process's affinity mask since the last call, in CPUs (1.0:
    one CPU busy with others' work the whole time), from Linux ``/proc/stat`` (the mask's CPUs not idle) less this
    process's own CPU time; None where it cannot be read. ``stat_path`` and ``own_seconds`` for tests."""

    def __init__(self, stat_path: str = "/proc/stat", own_seconds: Callable[[], float] = time.process_time) -> None:
        self.path = stat_path
        self.own = own_seconds
        try:
            self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = None
        self.last: tuple[float, float, float] | None = None  # (busy seconds of the mask, own seconds, wall)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy_seconds(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                text = f.read(1 << 16).decode("ascii", "replace")
        except OSError:
            return None
        busy = 0.0
        seen = False
        for line in text.splitlines():
            fields = line.split()
            if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
                continue
            if self.cpus is not None and fields[0] not in self.cpus:
                continue
            try:
                ticks = [float(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            except ValueError:
                return None
            if len(ticks) < 5:
                return None
            busy += sum(ticks) - ticks[3] - ticks[4]
            seen = True
        return busy / self.tick if seen else None

    def __call__(self) -> float | None:
        busy, own, now = self._busy_seconds(), self.own(), time.monotonic()
        if busy is None:
            return None
        last, self.last = self.last, (busy, own, now)
        if last is None or now <= last[2]:
            return None
        return max(0.0, (busy - last[0]) - (own - last[1])) / (now - last[2])


class _Compiles:
    """Counts numba compiles in this process (numba's "numba:compile" event), to skip timing steps that made one."""

    def __init__(self) -> None:
        from numba.core import event

        counter = self

        class Listener(event.Listener):
            def on_start(self, ev):
                counter.count += 1

            def on_end(self, ev):
                pass

        self.count = 0
        event.register("numba:compile", Listener())


_COMPILES: list[_Compiles] = []
_COMPILES_LOCK = threading.Lock()


def _compiles() -> _Compiles:
    with _COMPILES_LOCK:
        if not _COMPILES:
            _COMPILES.append(_Compiles())
        return _COMPILES[0]


class StepThreads:
    """Runs engine steps with numba's kernels on 1 or `threads` threads (in the calling thread; torch's own thread
    count stays as it is, so a step's outputs never depend on the choice);
    `threads` None: the CPUs the process may use (`cpu_budget.available_cpus`, within numba's pool). A count of 1
    runs every step on one thread and measures nothing.

    Every `LOOK_EVERY` steps it reads how much CPU other processes took on its CPUs (`OtherLoad`). While that is
    `BUSY` CPUs or more, every step runs on one thread: a parallel step would wait at each of its hundreds of
    parallel regions for a thread the OS gives to the other process (such a step often takes several times as
    long as one on a single thread), and measuring that mode only pays for it. Otherwise
    `StepChoice` decides by measured times; when the others' load goes, the parallel mode is due at once.
    ``load``: the reader (tests pass their own)."""

    LOOK_EVERY = 8
    BUSY = 0.5  # CPUs of others' work on this process's CPUs: a parallel step would share a core

    def __init__(self, threads: int | None = None, load: Callable[[], float | None] | None = None) -> None:
        import numba

        most = min(available_cpus(), numba.config.NUMBA_NUM_THREADS)
        self.threads = max(1, min(most if threads is None else int(threads), numba.config.NUMBA_NUM_THREADS))
        limit_torch()  # torch within the process's CPUs; its count is the process's, not this engine's
        self.choice = StepChoice()
        self.load = OtherLoad() if load is None else load
        self.contended = False
        self._compiles = _compiles()
        self._current: tuple[int, int] | None = None  # (thread, count) last set
        self._steps = 0
        self.parallel_steps = 0
        self.serial_steps = 0

    def _use(self, n: int) -> None:
        # numba's count is per thread: a server's engine loop steps from its own thread, not the constructor's.
        want = (threading.get_ident(), n)
        if want == self._current:
            return
        import numba
        import torch

        # numba's count only: int8kv's kernels (attention, GGUF / packed weights) sum in a fixed order whatever the
        # threads, but torch's matmul does not (a 5 x 128 by 128 x 384 product differs in its last bits on 1 and
        # 2 threads), so switching torch per step would make outputs depend on the machine's load. torch keeps the
        # count it had (`limit_torch`); numba's omp layer shares the OpenMP runtime and its first launch resets
        # that count, so it is put back.
        torch_threads = torch.get_num_threads()
        numba.set_num_threads(n)  # thread-local: the engine's own thread
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        self._current = want

    def _look_at_load(self, tokens: int) -> None:
        self._steps += 1
        if self._steps % self.LOOK_EVERY:
            return
        others = self.load()  # read every LOOK_EVERY steps, so each reading spans them
        if others is None:
            return
        contended = others >= self.BUSY
        if self.contended and not contended:
            self.choice.make_due(tokens)  # the load has gone: measure the parallel mode again now
        self.contended = contended

    def run(self, tokens: int, step: Callable[[], T]) -> T:
        """``step()`` on the thread count chosen for steps of ``tokens`` tokens, timed and recorded."""
        if self.threads <= 1:
            self._use(1)
            return step()
        self._look_at_load(tokens)
        if self.contended:
            parallel = False
            self.choice.measuring = False
        else:
            parallel = self.choice.parallel(tokens, self.threads)
        self._use(self.threads if parallel else 1)
        if parallel:
            self.parallel_steps += 1
        else:
            self.serial_steps += 1
        compiles = self._compiles.count
        start = time.perf_counter()
        try:
            out = step()
        except BaseException:
            self.choice.record(parallel, tokens, None)
            raise
        seconds = time.perf_counter() - start
        self.choice.record(parallel, tokens, None if self._compiles.count != compiles else seconds)
        return out
