"""What `int8kv` and `python -m int8kv.bench` share: the usage error, parsers whose help shows defaults, checks
run on arguments before any work starts, strict JSON output, and the one-line error report.

Kept free of torch and model imports so `--help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import stat
import sys
import tempfile
import textwrap
from collections.abc import Callable

from .errors import KvCacheError

# Flags every command and every benchmark takes.
COMMON_FLAGS = {"--quiet": "no progress output", "--debug": "show tracebacks instead of one-line errors"}


class CliError(KvCacheError, ValueError):
    """A bad command-line value."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option's help, except where there is no default to show (None, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise `CliError` (one line, exit 1) instead of exiting with 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


def bench_parser(name: str, description: str) -> Parser:
    """The parser of benchmark ``name``, serving both `python -m int8kv.bench name` and `int8kv bench name`;
    it has --json, and its epilog lists the common flags, which the dispatcher takes off before it runs."""
    common = ", ".join(f"{flag} ({text})" for flag, text in COMMON_FLAGS.items())
    parser = Parser(prog=f"python -m int8kv.bench {name}", description=description, epilog=f"Also: {common}.")
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="also write the results as JSON (NaN and inf as null)"
    )
    return parser


def output_problem(path: str) -> str | None:
    """Why the command could not write ``path`` (--json, --plot), or None: checked before any work is done, so
    a long run does not end in an unwritable file. An existing path must be a writable regular file (a FIFO
    would block the write, a device would swallow it); a new one needs a folder in which a file can be
    created, which is tried (a probe file, removed at once: some folders accept no new file whatever their
    permission bits say)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # ENOTDIR: under a regular file
        return f"cannot write {path!r}: {exc.strerror}"
    if mode is None and os.path.islink(path):  # the write would create the link's target, or fail after the work
        return f"{path!r} is a symbolic link to a missing file ({os.readlink(path)!r}): give the file itself"
    if mode is not None:
        if stat.S_ISDIR(mode):
            return f"{path!r} is a directory, not a file to write"
        if not stat.S_ISREG(mode):
            return f"{path!r} is not a regular file: outputs are written to regular files"
        return None if os.access(path, os.W_OK) else f"cannot write {path!r}: the file is not writable"
    if not os.path.isdir(folder):
        return f"cannot write {path!r}: folder {folder!r} does not exist"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".int8kv-probe-"):
            pass
    except OSError as exc:
        return f"cannot write {path!r}: no file can be created in folder {folder!r} ({exc.strerror})"
    return None


def output_path(path: str) -> str:
    """An argparse type for an output file (see `output_problem`)."""
    problem = output_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def check_outputs(args: argparse.Namespace, dests: tuple[str, ...] = ("json", "plot")) -> None:
    """Refuse (CliError) output files given in ``args`` that could not be written."""
    for dest in dests:
        path = getattr(args, dest, None)
        problem = output_problem(path) if path else None
        if problem:
            raise CliError(f"--{dest}: {problem}")


def check_minimums(args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Refuse integer options below their minimum: ``{"max_tokens": 1}`` checks ``--max-tokens >= 1``."""
    for dest, least in minimums.items():
        value = getattr(args, dest)
        if value < least:
            raise CliError(f"--{dest.replace('_', '-')} must be >= {least}, got {value}")


def memory_budget(text: str, option: str = "--memory") -> int:
    """A positive memory size in bytes from text such as '8GiB' (`int8kv.engine.parse_bytes` reads it)."""
    from .engine import parse_bytes

    try:
        budget = parse_bytes(text)  # InvalidEngineConfig (a ValueError) for text, inf, NaN or a negative size
    except ValueError as exc:
        raise CliError(f"{option}: {exc}") from None
    if budget <= 0:
        raise CliError(f"{option} must be a positive size, got {text!r}")
    return budget


def legend(columns: dict[str, str], title: str = "columns:", width: int = 110) -> str:
    """The words under a printed table: one entry per column name, its text wrapped under it."""
    pad = max(map(len, columns)) + 4
    lines = [title]
    for name, text in columns.items():
        lines += textwrap.wrap(text, width, initial_indent=f"  {name:<{pad - 2}}", subsequent_indent=" " * pad)
    return "\n".join(lines)


def strict_json_value(value: object) -> object:
    """``value`` with every NaN or infinite float (at any depth) replaced by None, which JSON writes as null:
    the `json` module would write NaN/Infinity, which strict readers refuse."""
    if isinstance(value, dict):
        return {k: strict_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json_value(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = float(value)  # numpy floats too
        return number if math.isfinite(number) else None
    return value


def write_json(path: str | None, result: object) -> None:
    """Write ``result`` as strict JSON (non-finite numbers as null); the text is built before the file is
    opened, so a value that cannot be written leaves no partial file."""
    if not path:
        return
    text = json.dumps(strict_json_value(result), indent=1, default=str, allow_nan=False)
    with open(path, "w") as f:
        f.write(text + "\n")


def report_errors(run: Callable[[], int | None], debug: bool) -> int:
    """Run a command: errors a user can cause print one line on stderr and give exit status 1 (with ``debug``:
    the traceback instead)."""
    try:
        return run() or 0
    except (KvCacheError, ValueError, OSError) as exc:
        if debug:
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"int8kv: error: {text}", file=sys.stderr)
        return 1
