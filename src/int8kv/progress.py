"""Progress reporting: a tqdm bar on a terminal, plain lines in logs and CI, nothing with --quiet."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

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


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """``items``, counted on a `Bar` as they are consumed."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Bar(desc, total) as bar:
        for item in items:
            yield item
            bar.update()
