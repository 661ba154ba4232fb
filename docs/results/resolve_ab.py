"""The Python of one `ops.attention` call around its kernel, this checkout against another, in one process.

    PYTHONPATH= python docs/results/resolve_ab.py --baseline /tmp/kbase [--rounds 30] [--json PATH]

Both checkouts are loaded as in `attention_ab.py` (the baseline as ``int8kv_baseline``) on its inputs (SmolLM2's
shape, batch 1 x 512 keys, INT8). Times the two pieces of `ops.attention` that run before the kernel: `_resolve`
(the backend and the CPU backend's prepared call for the plan) and `check_query`; each round runs every
(checkout, piece) for 2,000 calls in turn. Prints the median and best us per call over the rounds, and
`attention_ab.py` then times whole calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="root of the other checkout")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="resolve_ab_numba_"))
    sys.path.insert(0, str(HERE))
    import attention_ab as ab

    trees = {"baseline": ab.load("int8kv_baseline", args.baseline), "this": ab.load("int8kv", HERE.parents[1])}
    from int8kv.bench.timing import seconds_in_turns  # this checkout's, as loaded above
    pieces = {}
    for name, (ops, paged, formats) in trees.items():
        call = ab.call_for(ops, paged, formats, 512, 0)
        call()  # compiles, and keeps what the plan keeps
        held = {type(c.cell_contents).__name__: c.cell_contents for c in call.__closure__}
        cache, plan, q = held["PagedKvCache"], held["AttentionPlan"], held["Tensor"]
        heads = q.shape[1]
        pieces[(name, "_resolve")] = lambda o=ops, c=cache, p=plan, h=heads: o._resolve(
            c.pool, p, h, "cpu", None, None, None, None
        )
        pieces[(name, "check_query")] = lambda o=ops, c=cache, p=plan, x=q: o.check_query(c.pool, x, p)
    seconds = seconds_in_turns(pieces, args.rounds, 2000)
    rows = []
    for (tree, piece), s in seconds.items():
        row = {"tree": tree, "piece": piece, "median_us": statistics.median(s) * 1e6, "best_us": min(s) * 1e6}
        rows.append(row)
        print(f"{tree:8s} {piece:12s} median {row['median_us']:.2f} us, best {row['best_us']:.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "resolve_ab", "baseline": str(args.baseline),
                                               "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
