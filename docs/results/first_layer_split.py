"""Inside transformers' `generate` on SmolLM2-135M (the drop-in, batch 1): where the first layer's attention call
of each decode step goes, the call that plans the step for every layer. Timers around the functions it calls,
counted during layer 0's decode calls only; per function the median microseconds of a call and how many calls
a layer-0 call makes:

    PYTHONPATH=src python docs/results/first_layer_split.py [--context 512] [--rounds 3]

It runs docs/results/generate_split.py's rounds (DynamicCache and Int8KvCache taking turns) with these timers.
Medians, not means: the first calls compile or load kernels (milliseconds), which a mean over ~100 steps shows
as tens of microseconds a step.
"""

import atexit
import os
import runpy
import statistics
import sys
import time

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import int8kv.hf.attention as attention_module
import int8kv.ops as ops
import int8kv.ops.cpu as cpu

SPENT: dict[str, list[int]] = {}
IN_LAYER_0 = [False]
TIMED = [
    (attention_module, "_shared_plan"), (attention_module, "plan_attention"), (attention_module, "_prepared"),
    (cpu, "_work"), (cpu, "_decode_items"), (cpu, "_assign_items"), (cpu, "_runner"), (cpu, "_entry"),
    (cpu, "_leaves"), (cpu, "_run_items"), (cpu, "_layer_arrays"), (ops, "check_query"),
]  # fmt: skip


def _timed(fn, label: str):
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if IN_LAYER_0[0]:
            SPENT.setdefault(label, []).append(time.perf_counter_ns() - start)
        return out

    return timed


def _attention(real):
    def call(module, query, *args, **kwargs):
        IN_LAYER_0[0] = query.shape[2] == 1 and module.layer_idx == 0
        try:
            return _timed(real, "the layer-0 call")(module, query, *args, **kwargs)
        finally:
            IN_LAYER_0[0] = False

    return call


def _report() -> None:
    calls = len(SPENT.get("the layer-0 call", [])) or 1
    for label, spent in sorted(SPENT.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"{label:18s} median {statistics.median(spent) / 1e3:8.1f} us  x{len(spent) / calls:.2f}")


for module, name in TIMED:
    setattr(module, name, _timed(getattr(module, name), name))
ALL_ATTENTION_FUNCTIONS["int8kv"] = _attention(attention_module.int8kv_attention_forward)
atexit.register(_report)
sys.argv = ["generate_split.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_split.py"), run_name="__main__")
