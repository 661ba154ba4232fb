"""What bytecode caches save each Python process the suite starts: the time to import int8kv's engine, CLI and
server (torch and transformers with them) from source every time, as under PYTHONDONTWRITEBYTECODE with no .pyc
files, against reading .pyc files; the two take turns, three runs each, in fresh processes.

    .venv/bin/python tools/import_bytecode.py [--json docs/results/import_bytecode.json]

Both read their bytecode from a PYTHONPYCACHEPREFIX of their own in a temporary directory (an empty one, and one
filled by a first import) and write none, so the tree and .venv are left as they are."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CODE = "import int8kv.engine, int8kv.cli, int8kv.server.app"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    with tempfile.TemporaryDirectory() as tmp:
        cold, warm = os.path.join(tmp, "empty"), os.path.join(tmp, "filled")
        os.mkdir(cold)
        subprocess.run([sys.executable, "-c", CODE], env=dict(base, PYTHONPYCACHEPREFIX=warm), check=True)
        runs: dict[str, list[float]] = {"from_source": [], "from_pyc": []}
        for _ in range(args.repeat):
            for kind, prefix in (("from_source", cold), ("from_pyc", warm)):
                env = dict(base, PYTHONPYCACHEPREFIX=prefix, PYTHONDONTWRITEBYTECODE="1")
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", CODE], env=env, check=True)
                runs[kind].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in runs.items()}
    result = {"code": CODE, "runs_s": runs, "median_s": median, "pyc_over_source": median["from_pyc"] /
              median["from_source"], "load_average": list(os.getloadavg()), "cpu_count": os.cpu_count()}
    print(f"import from source {median['from_source']:.1f} s, from .pyc {median['from_pyc']:.1f} s "
          f"(median of {args.repeat}): {result['pyc_over_source']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
