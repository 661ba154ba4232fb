"""Sums of a suite_cpu log: CPU seconds per (test file, command) for the per-process log, or per compiled
function (top-level compiles only: a nested one is inside its caller's figure) for ``--compiles``."""

import argparse
import collections
import json
import os


def _command(argv: list[str]) -> str:
    """The script and its subcommand, without paths, ports or other values that differ between runs."""
    words = [os.path.basename(argv[0])] if argv else []
    words += [a for a in argv[1:3] if a.startswith("-") or a.isalpha()]
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log")
    parser.add_argument("--compiles", action="store_true", help="the log is numba_compile_log's")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.log) as f:
        rows = [json.loads(line) for line in f]
    if args.compiles:
        rows = [r for r in rows if r["depth"] == 0]
        key = lambda r: f"{r['module']}.{r['fn']}"  # noqa: E731
    else:
        key = lambda r: f"{(r['test'] or '-').split('::')[0]}  {_command(r['argv'])}"  # noqa: E731
    cpu: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for r in rows:
        cpu[key(r)] += r["cpu"]
        count[key(r)] += 1
    print(f"{len(rows)} entries, {sum(cpu.values()):.1f} s of CPU")
    for name, seconds in cpu.most_common(args.top):
        print(f"{seconds:8.1f} s {count[name]:4d}  {name}")


if __name__ == "__main__":
    main()
