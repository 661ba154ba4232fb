"""Run one measuring script in two checkouts alternately and keep every round's result in one JSON file.

    python docs/results/ab_checkouts.py --rounds 3 --json OUT.json BEFORE_TREE AFTER_TREE SCRIPT [ARG ...]

Each run is a fresh process in the tree (cwd, PYTHONPATH=src) with an empty numba cache of its own (so a compile
measurement starts cold and a timing one compiles first, then measures), the same Python; the script's last line
"json {...}" is its result. Rounds go before, after, before, after, ... so both see the same machine load.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", required=True)
    parser.add_argument("script", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    script = args.script
    runs = []
    for round_ in range(1, args.rounds + 1):
        for label, tree in (("before", args.before), ("after", args.after)):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "PYTHONPATH": "src", "NUMBA_CACHE_DIR": cache}
                load = os.getloadavg()[0]
                done = subprocess.run([sys.executable, *script], cwd=tree, env=env, capture_output=True, text=True,
                                      check=True, timeout=1200)
            result = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("json "))
            runs.append({"round": round_, "checkout": label, "load_1min": round(load, 2), **result})
            print(label, round_, result, flush=True)
    with open(args.json, "w") as f:
        json.dump({"script": script, "before": args.before, "after": args.after, "cpu": _cpu(),
                   "date": time.strftime("%Y-%m-%d"), "runs": runs}, f, indent=1)


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    main()
