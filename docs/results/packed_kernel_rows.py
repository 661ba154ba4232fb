"""SmolLM2's 211 packed Linear layers at 1 to 64 rows of input, three ways in one process, taking turns:

    python docs/results/packed_kernel_rows.py docs/results/packed_kernel_rows.json

  block           `PackedLinear.block_product`: the block kernel
  decode + dense  `PackedLinear.dense_product`: the layer's blocks decoded to float32, then torch's matmul
                  (what a layer does above `DENSE_ROWS` rows)
  dense           torch's matmul over float32 weights decoded beforehand (the model's dense weights, as
                  `weights="dense"` runs them)

Every layer runs once per peer and round (weights streamed from memory, as in a model's forward); the figure
is the median of 5 rounds, in ms for all 211 layers. The CPU features and thread counts are recorded beside it.
"""

import json
import os
import statistics
import sys
import time

import numba
import torch

from int8kv.models import load_model, pack_weights
from int8kv.models.packed import PackedLinear

model, _ = load_model(None, quiet=True)
layers = [m for m in pack_weights(model).modules() if isinstance(m, PackedLinear)]
dense = [m.decoded() for m in layers]
result = {
    "command": f"python docs/results/packed_kernel_rows.py {sys.argv[1]}",
    "torch_threads": torch.get_num_threads(),
    "numba_threads": numba.get_num_threads(),
    "cpu_features": os.environ.get("NUMBA_CPU_FEATURES", "host"),
    "load_average_before": os.getloadavg(),
    "rows": {},
}
gen = torch.Generator().manual_seed(0)
with torch.inference_mode():
    for rows in (1, 4, 8, 16, 32, 48, 64):
        xs = [torch.randn(rows, m.in_features, generator=gen) for m in layers]
        peers = {
            "block": lambda xs=xs: [m.block_product(x) for m, x in zip(layers, xs, strict=True)],
            "decode + dense": lambda xs=xs: [m.dense_product(x) for m, x in zip(layers, xs, strict=True)],
            "dense": lambda xs=xs: [torch.nn.functional.linear(x, w) for w, x in zip(dense, xs, strict=True)],
        }
        times = {name: [] for name in peers}
        for run in peers.values():
            run()
        for _ in range(5):
            for name, run in peers.items():
                start = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - start))
        medians = {k: statistics.median(v) for k, v in times.items()}
        result["rows"][rows] = {"ms": times, "median_ms": medians}
        print(f"rows {rows:2d}: " + "  ".join(f"{k} {v:7.2f} ms" for k, v in medians.items()), flush=True)
result["load_average_after"] = os.getloadavg()
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
