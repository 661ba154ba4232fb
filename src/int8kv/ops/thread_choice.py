"""One thread or all of numba's for a kernel call, whichever measured cheaper for calls of that size.

The CPU attention kernels (ops/cpu.py, cpu_q4w.py, cpu_q4.py) keep one `ThreadChoice` per kind of call
(`thread_choice`); the engine keeps one for whole steps (engine/step_threads.py). Pure Python: no numba here.
"""

from __future__ import annotations

__all__ = ["ThreadChoice", "thread_choice"]


class ThreadChoice:
    """Runs a call on one thread or on all of numba's, whichever measured cheaper for calls of that size.

    The items (and so the numerics) never depend on this: only how many threads share them. Calls are grouped
    by the size of their work (query head x key units, in powers of two); in each group every mode keeps a
    running estimate of its seconds per unit, and the cheaper one runs. Each mode is first measured twice in a
    group and the faster of the two kept (a process's first parallel call also starts numba's threads, so it is
    slower than the next); a mode not chosen is re-measured after `EXPLORE` calls of its group, and each time it
    still loses the wait doubles (up to `MAX_EXPLORE`), so a change in load is noticed without paying a losing mode
    often (on a busy machine, waking the second thread can take milliseconds where idle it takes microseconds).
    A measurement counts for at most `CLIP` times the mode's estimate: the OS delays a single call by
    milliseconds now and then, and taken at face value one such call made the two-thread mode look several times
    slower than it is; with the doubling waits a call kind then stayed on the slower single thread for thousands
    of calls. Clipped, one delayed call moves the estimate by at most 25 %, and a real rise still shows within a
    few measurements (a doubling counts in full). A re-measured mode runs `BURST` calls in a row, and the burst's
    median, when it beats the mode's estimate, takes its place at once: the first parallel call after a run of
    serial ones wakes the pool (milliseconds now and then), and lone re-measuring calls, each moving the estimate
    a quarter of the way, left calls on the slower single thread for thousands of calls
    (docs/results/threads_switch.py; docs/archive/benchmarks-2026.md, "The thread choice after a slow start, and
    where SmolLM2's 2,048 keys stand"). The median, not the fastest: against the chosen mode's running estimate,
    a burst's one lucky call handed the group to the slower mode now and then.
    Why by size: one model for all sizes (seconds per unit on one thread, plus a fixed cost of waking the pool
    fitted on the parallel calls) took the higher per-unit cost of keys read from DRAM, as the context grew, for
    a wake-up cost of milliseconds, and kept long single-sequence calls on one thread where two are about twice
    as fast."""

    EXPLORE = 64
    MAX_EXPLORE = 4096
    FIRST = 2  # measurements of each mode before the estimates decide
    MEASURE_EVERY = 8  # calls that keep the chosen mode's estimate fresh: one in 8 (recording one is not free)
    DECAY = 0.25  # weight of the newest measurement in the running estimates
    CLIP = 2.0  # a measurement counts for at most this many times the estimate it updates
    BURST = 3  # calls in a row of a re-measured mode; their median stands (the first may wake the pool)

    def __init__(self) -> None:
        self.rate: dict[tuple[bool, int], float] = {}  # (parallel, size group) -> seconds per unit
        self.samples: dict[tuple[bool, int], int] = {}  # (parallel, size group) -> calls measured
        self.calls: dict[int, int] = {}  # size group -> calls so far
        self.last: dict[tuple[bool, int], int] = {}  # (parallel, group) -> call index the mode last ran
        self.wait: dict[tuple[bool, int], int] = {}  # (parallel, group) -> calls before it is tried again
        self.exploring: bool | None = None  # the mode of a call made only to measure it
        self.ending = False  # whether that call is the last of a re-measuring burst
        self.burst: dict[int, tuple[bool, int]] = {}  # size group -> (re-measured mode, its calls still to run)
        self.taken: dict[tuple[bool, int], list[float]] = {}  # (mode, group) -> its burst's figures so far
        self.timed = False  # whether the caller should time this call and `record` it
        # size group -> (its best mode, the last call before the other is re-measured): set when a call finds the
        # group settled and dropped when any of its calls is recorded. Deciding by it is one dict read where the
        # full rules read eight, a visible part of a decode call's fixed cost with the caches cold after the kernel.
        self.settled: dict[int, tuple[bool, int]] = {}

    @staticmethod
    def group(work: int) -> int:
        return int(work).bit_length()

    def parallel(self, work: int, threads: int) -> bool:
        self.exploring = None
        self.timed = False
        if threads <= 1 or work <= 0:
            return False
        g = self.group(work)
        n = self.calls[g] = self.calls.get(g, 0) + 1
        settled = self.settled.get(g)
        if settled is not None and n <= settled[1]:
            self.timed = n % self.MEASURE_EVERY == 0
            return settled[0]
        self.timed = True
        for mode in (False, True):
            if self.samples.get((mode, g), 0) < self.FIRST:
                # Not a re-measuring: a mode that loses its first samples is tried again after EXPLORE calls
                # (the waits doubled by these samples sent the first re-measuring 256 calls away, past the ~180
                # calls a context gets in the attention benchmark).
                self.exploring, self.ending = mode, False
                return mode
        burst = self.burst.pop(g, None)
        if burst is None:
            best = self.rate[(True, g)] < self.rate[(False, g)]
            other = not best
            until = self.last.get((other, g), 0) + self.wait.get((other, g), self.EXPLORE)
            if n <= until:
                self.settled[g] = (best, until)
                self.timed = n % self.MEASURE_EVERY == 0
                return best
            burst = (other, self.BURST)
            self.taken.pop((other, g), None)
        mode, left = burst
        if left > 1:
            self.burst[g] = (mode, left - 1)
        self.exploring, self.ending = mode, left == 1
        return mode

    def record(self, parallel: bool, work: int, threads: int, seconds: float | None) -> None:
        """What a call in mode `parallel` took; None: it compiled a kernel, so it says nothing of either mode
        (tried again at the next call)."""
        exploring, self.exploring = self.exploring, None
        ending, self.ending = self.ending, False
        if seconds is None or work <= 0 or (parallel and threads <= 1):
            return
        g = self.group(work)
        self.settled.pop(g, None)
        key = (parallel, g)
        self.last[key] = self.calls.get(g, 0)
        unit = seconds / work
        old = self.rate.get(key)
        count = self.samples[key] = self.samples.get(key, 0) + 1
        if old is None or count <= self.FIRST:
            self.rate[key] = unit if old is None else min(old, unit)
        else:
            if exploring is not None:  # a call of a re-measuring burst: the burst's median decides, at its end
                taken = self.taken.setdefault(key, [])
                taken.append(unit)
                if not ending:
                    return
                del self.taken[key]
                unit = sorted(taken)[len(taken) // 2]
            faster = exploring is not None and unit < old  # a re-measured mode's faster figure stands whole
            self.rate[key] = unit if faster else old + self.DECAY * (min(unit, self.CLIP * old) - old)
        other = (not parallel, g)
        if exploring is not None and ending and other in self.rate:  # re-measured: wait longer if it still loses
            lost = self.rate[key] > self.rate[other]
            self.wait[key] = min(2 * self.wait.get(key, self.EXPLORE), self.MAX_EXPLORE) if lost else self.EXPLORE


# One ThreadChoice per kind of call: decode and prefill, INT8 and F16, the two precisions and each head shape
# cost different amounts per unit of work. A single shared model once learned its seconds per unit on INT8 decode
# calls, took the F16 calls' larger cost for a wake-up cost, and kept long calls on one thread where two
# threads were clearly faster.
_THREADS: dict[tuple, ThreadChoice] = {}


def thread_choice(key: tuple) -> ThreadChoice:
    """The ThreadChoice of calls of kind `key` (created on first use)."""
    choice = _THREADS.get(key)
    if choice is None:
        choice = _THREADS[key] = ThreadChoice()
    return choice
