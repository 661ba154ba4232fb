"""`python -m int8kv.bench <name> [options]`: dispatch to the named benchmark's `main(argv)`.

`int8kv bench <name> [options]` calls this same `main`, so both entry points take the same options, parsed by
the one parser each benchmark defines.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from .. import progress
from ..cli_common import COMMON_FLAGS, report_errors
from . import BENCHMARKS

USAGE = (
    f"usage: python -m int8kv.bench {{{','.join(BENCHMARKS)}}} [options] [--quiet] [--debug]\n"
    "       (or int8kv bench ...; <name> --help lists a benchmark's options)\n"
    + "".join(f"  {flag:<9}{text}\n" for flag, text in COMMON_FLAGS.items())
)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Taken by every benchmark, whatever its own parser says, and taken off before that parser runs.
    flags = {flag for flag in COMMON_FLAGS if flag in args}
    args = [a for a in args if a not in COMMON_FLAGS]
    asked_help = not args or args[0] in ("-h", "--help")
    if asked_help or args[0] not in BENCHMARKS:
        print(USAGE, end="", file=sys.stdout if asked_help else sys.stderr)
        return 0 if asked_help else 2
    progress.set_quiet("--quiet" in flags)
    # Imported only when chosen: a benchmark may pull heavy modules (numba kernels, triton).
    module = importlib.import_module(BENCHMARKS[args[0]])

    def run() -> int:
        module.main(args[1:])
        return 0

    return report_errors(run, "--debug" in flags)


if __name__ == "__main__":
    sys.exit(main())
