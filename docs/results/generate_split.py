"""Inside transformers' `generate` on SmolLM2-135M, batch 1: per decode step, the time in the attention function
and in the cache's `update` (all 30 layers), for `DynamicCache` (SDPA) and `Int8KvCache` (the int8kv attention),
taking turns, for whichever checkout PYTHONPATH names:

    PYTHONPATH=src python docs/results/generate_split.py [--context 512] [--rounds 3] [--json PATH]

Each round is one `bench e2e` run per cache (the same prompt, 32 new tokens, the same timestamps); the timers
wrap the registered attention functions and `update`, counting only calls of one position (the decode steps).
"""

import argparse
import json
import time

from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from int8kv.bench.e2e import _prompt_ids, hf_decode
from int8kv.hf import Int8KvCache
from int8kv.models import load_model

SPENT = {"attention": 0.0, "update": 0.0, "calls": 0}


def _timed(fn, slot: str, steps_arg: int):
    """``fn`` timed into SPENT[slot] when its argument ``steps_arg`` holds one position (dim 2: a decode step)."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if args[steps_arg].shape[2] == 1:
            SPENT[slot] += time.perf_counter() - start
            SPENT["calls"] += slot == "attention"
        return out

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tok = load_model(quiet=True)
    ids = _prompt_ids(tok, args.context)
    for name in ("sdpa", "int8kv"):
        ALL_ATTENTION_FUNCTIONS[name] = _timed(ALL_ATTENTION_FUNCTIONS[name], "attention", 1)  # (module, query, ...)
    DynamicCache.update = _timed(DynamicCache.update, "update", 1)  # (self, key_states, ...)
    Int8KvCache.update = _timed(Int8KvCache.update, "update", 1)
    layers = model.config.num_hidden_layers

    def dynamic() -> dict:
        model.set_attn_implementation("sdpa")
        return hf_decode(model, ids, 1, 32, DynamicCache)

    def int8kv() -> dict:
        return hf_decode(model, ids, 1, 32, lambda: Int8KvCache(model.config))

    peers = {"DynamicCache": dynamic, "Int8KvCache": int8kv}
    for run in peers.values():  # compiles, loads, warms
        run()
    rows = []
    for r in range(args.rounds):
        for name, run in peers.items():
            SPENT.update(attention=0.0, update=0.0, calls=0)
            result = run()
            steps = SPENT["calls"] / layers
            row = {"round": r + 1, "cache": name, "ms_per_token": 1e3 / result["decode_tok_per_s"],
                   "attention_ms_per_step": SPENT["attention"] / steps * 1e3,
                   "update_ms_per_step": SPENT["update"] / steps * 1e3}  # fmt: skip
            rows.append(row)
            print(f"{name:13s} {row['ms_per_token']:.2f} ms/token, attention {row['attention_ms_per_step']:.2f} "
                  f"ms/step, update {row['update_ms_per_step']:.2f} ms/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
