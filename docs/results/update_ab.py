"""The transformers drop-in's per-layer update (one decode step's K/V rows) of this checkout against another's.

    python docs/results/update_ab.py --baseline /tmp/kmain [--rounds 3] [--json PATH]

Each round runs one fresh process per checkout, taking turns (so a slow spell of the shared machine hits both):
a one-layer `Int8KvCache` at SmolLM2-135M's shape (3 KV heads x 64, INT8) holding 512 positions per row, then
3,000 `update` calls of one position, at batch 1 and 8; each process prints the median microseconds per call
after 200 untimed ones. Prints the medians of the rounds and the ratios this / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, statistics, time, torch
from transformers import LlamaConfig
from int8kv.hf import Int8KvCache
cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=1,
                  intermediate_size=1536, vocab_size=100)
torch.manual_seed(0)
out = {}
for batch in (1, 8):
    layer = Int8KvCache(cfg).layers[0]
    layer.update(torch.randn(batch, 3, 512, 64), torch.randn(batch, 3, 512, 64))
    rows = [torch.randn(batch, 3, 1, 64) for _ in range(64)]
    times = []
    for i in range(3200):
        if layer.held >= 1024:
            layer.crop(512)  # back to 512 positions: every call appends to the same length range
        k = rows[i % 64]
        t = time.perf_counter()
        layer.update(k, k)
        times.append(time.perf_counter() - t)
    out[str(batch)] = statistics.median(times[200:]) * 1e6
print(json.dumps(out))
"""


def run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="root of the other checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {"baseline": [], "this": []}
    for _ in range(args.rounds):
        samples["baseline"].append(run(args.baseline))
        samples["this"].append(run(HERE))
    rows = []
    for batch in ("1", "8"):
        med = {name: statistics.median(s[batch] for s in runs) for name, runs in samples.items()}
        rows.append({"batch": int(batch), "median_us": med, "ratio": med["this"] / med["baseline"]})
        print(f"batch {batch}: update us baseline {med['baseline']:.1f} this {med['this']:.1f} "
              f"({rows[-1]['ratio']:.2f}x); per round {[round(s[batch], 1) for s in samples['baseline']]} vs "
              f"{[round(s[batch], 1) for s in samples['this']]}")
    result = {"benchmark": "update_ab", "baseline": str(args.baseline), "rounds": args.rounds, "results": rows,
              "load_average_after": os.getloadavg()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
