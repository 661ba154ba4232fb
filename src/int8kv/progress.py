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


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    if _quiet:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, leave=False)
        return
    yield from _plain(items, desc, total)


def _plain(items: Iterable[T], desc: str, total: int | None) -> Iterator[T]:
    start = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= 2.0 or done == total:
            of = f"/{total}" if total else ""
            print(f"{desc}: {done}{of} ({now - start:.1f}s)", file=sys.stderr, flush=True)
            last = now
