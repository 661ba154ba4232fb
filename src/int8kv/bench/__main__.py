"""`python -m int8kv.bench <name> [options]`: dispatch to the named benchmark's `main(argv)`."""

from __future__ import annotations

import importlib
import sys

from . import BENCHMARKS


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        print(f"usage: python -m int8kv.bench {{{','.join(BENCHMARKS)}}} [options]   (<name> --help for options)")
        return 0 if not args or args[0] in ("-h", "--help") else 2
    # Imported only when chosen: a benchmark may pull heavy modules (numba kernels, triton).
    importlib.import_module(BENCHMARKS[args[0]]).main(args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
