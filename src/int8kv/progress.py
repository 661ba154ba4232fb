"""Progress reporting: a tqdm bar on a terminal, plain lines in logs and CI, nothing with --quiet; `Stages` for a
long run of several stages, with an estimate of the time left."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

T = TypeVar("T")
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet
    try:  # transformers draws its own bars while loading and converting weights
        from transformers.utils import logging as hf_logging

        (hf_logging.disable_progress_bar if quiet or not sys.stderr.isatty() else hf_logging.enable_progress_bar)()
    except ImportError:
        pass


def is_quiet() -> bool:
    return _quiet


def note(message: str) -> None:
    """A status line on stderr (kept off stdout so --json output and tables stay clean)."""
    if not _quiet:
        print(message, file=sys.stderr, flush=True)


class Bar:
    """A progress bar counted by hand (`update(n)`): tqdm on a terminal, a plain line every 2 s (and at the end)
    otherwise, nothing with --quiet. Use as a context manager."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it") -> None:
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0
        self._tqdm = None
        self._start = self._last = time.perf_counter()
        self._shown = 0
        if not _quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._tqdm = tqdm(desc=desc, total=total, unit=unit, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if _quiet:
            return
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        if time.perf_counter() - self._last >= 2.0 or self.done == self.total:
            self._line()

    def _line(self) -> None:
        now = time.perf_counter()
        of = f"/{self.total}" if self.total else ""
        unit = "" if self.unit == "it" else f" {self.unit}"
        print(f"{self.desc}: {self.done}{of}{unit} ({now - self._start:.1f}s)", file=sys.stderr, flush=True)
        self._last, self._shown = now, self.done

    def close(self) -> None:
        """Ends the bar; a plain bar prints its last count unless that line is already out."""
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif not _quiet and self.done != self._shown:
            self._line()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def clock_text(seconds: float) -> str:
    """``seconds`` as m:ss (h:mm:ss from an hour on)."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Stages:
    """Progress of a run made of stages, each counting units of one of a few kinds that go at different speeds
    (a model's scored tokens and its generated tokens), with the time left: one line redrawn in place on a
    terminal, a plain line every ``every`` seconds otherwise, a last line with the total time; nothing with
    --quiet.

    ``stages`` lists (label, kind, units) in the order they run; `begin(i)` starts stage i and `update(n)` counts
    n units of it. The time left is every unit still to count at its kind's speed so far (units over the seconds
    spent in that kind's stages), so it is known once each kind still ahead has been timed. Use as a context
    manager."""

    def __init__(self, desc: str, stages: Sequence[tuple[str, str, int]], unit: str = "tok", every: float = 30.0,
                 stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.desc, self.stages, self.unit, self.every = desc, list(stages), unit, every
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.done = [0] * len(self.stages)
        self.seconds = [0.0] * len(self.stages)  # spent in each stage
        self.current: int | None = None
        self.start = self._since = self._drawn = clock()

    def begin(self, index: int) -> None:
        self._account()
        self.current = index
        self._show(force=True)

    def update(self, n: int = 1) -> None:
        if self.current is None:
            raise RuntimeError("Stages.update before begin")
        self._account()
        self.done[self.current] += n
        self._show()

    def _account(self) -> None:
        now = self.clock()
        if self.current is not None:
            self.seconds[self.current] += now - self._since
        self._since = now

    def seconds_left(self) -> float | None:
        """The estimate (None until every kind with units still to count has been timed)."""
        speed: dict[str, list[float]] = {}
        for (_, kind, _), done, spent in zip(self.stages, self.done, self.seconds, strict=True):
            units_seconds = speed.setdefault(kind, [0.0, 0.0])
            units_seconds[0] += done
            units_seconds[1] += spent
        left = 0.0
        for (_, kind, units), done in zip(self.stages, self.done, strict=True):
            todo = max(0, units - done)
            if todo:
                counted, spent = speed[kind]
                if counted == 0 or spent <= 0:
                    return None
                left += todo * spent / counted
        return left

    def line(self, width: int | None = None) -> str:
        """The progress line as it stands; over ``width`` characters, its stage part is cut so that the times stay
        in view."""
        i = self.current if self.current is not None else 0
        label, _, units = self.stages[i]
        left = self.seconds_left()
        estimate = "estimating the time left" if left is None else f"about {clock_text(left)} left"
        head = f"{self.desc} [{i + 1}/{len(self.stages)}] {label}: {self.done[i]:,}/{units:,} {self.unit}"
        tail = f", {clock_text(self.clock() - self.start)} elapsed, {estimate}"
        if width is not None and len(head) + len(tail) > width:
            head = head[: max(0, width - len(tail) - 3)] + "..."
        return head + tail

    def _show(self, force: bool = False) -> None:
        if _quiet:
            return
        now = self.clock()
        if self.tty:
            if force or now - self._drawn >= 0.2:
                width = shutil.get_terminal_size().columns - 1  # a wrapped line would not be redrawn in place
                self.stream.write(f"\r{self.line(width)}\x1b[K")
                self.stream.flush()
                self._drawn = now
        elif now - self._drawn >= self.every:
            print(self.line(), file=self.stream, flush=True)
            self._drawn = now

    def close(self, finished: bool = True) -> None:
        """Ends the run: the line in place is cleared and, when it ``finished``, one line gives the total time."""
        self._account()
        if _quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        if not finished:
            return
        n = len(self.stages)
        print(f"{self.desc}: done in {clock_text(self.clock() - self.start)} ({n} stage{'s' * (n != 1)}, "
              f"{sum(self.done):,} {self.unit})", file=self.stream, flush=True)

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(finished=exc_type is None)


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """``items``, counted on a `Bar` as they are consumed."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Bar(desc, total) as bar:
        for item in items:
            yield item
            bar.update()
