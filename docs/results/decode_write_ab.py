"""The decode write's compiled routes against the general route, in the same process, taking turns: SmolLM2-135M,
batch 1, a 512-token prompt of the license texts, 32 new tokens.

    PYTHONPATH=src python docs/results/decode_write_ab.py [--context 512] [--rounds 8] [--json PATH]

- drop-in: transformers' generate with `Int8KvCache` ("compiled": a decode step's rows go to the format's compiled
  store, `Int8KvLayer._store_direct`; "general": that route declined, so `write.append_rows` takes them) and with
  `DynamicCache` (SDPA) beside them; per decode step, the time in the cache's `update` and in the attention
  function (all 30 layers), and ms per token.
- engine: `int8kv.engine.LLM` with its fused forward and the model's own weights, INT8 cache ("compiled":
  `ops.paged_write` through `write.split_rotate_store`; "general": that route declined, so `prepare_qkv` and
  `append_paged_kv` take the step); per layer of a decode step, the time in `ops.paged_write` and in the prepared
  attention, and ms per token from the engine's stats.
- engine-transformers: the same engine on the model's own forward (`implementation="transformers"`), whose
  layers write through `write.append_rows` ("compiled": `store_kv` hands the rows to the compiled store;
  "general": through the pool's `encode_rows`); per layer, the time in `write.append_rows`.
- engine-f16: the fused forward with an F16 cache (F16's compiled store, `_codec_cpu.f16_store`, against the
  general route), timed as "engine".
Each figure is the median over the rounds; ratios are taken within a round (the peers ran back to back).
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import int8kv.ops as ops
from int8kv.bench import e2e
from int8kv.engine import LLM, EngineStats, SamplingParams
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache
from int8kv.hf.cache import Int8KvLayer
from int8kv.models import load_model
from int8kv.ops import write

SPENT: dict[str, float] = {}
ON = [False]  # timing on: set at generate's first token (the prefill is over) / around the engine's decode
NEW_TOKENS = 32


def _timed(fn, slot: str):
    def timed(*args, **kwargs):
        if not ON[0]:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        SPENT[slot] = SPENT.get(slot, 0.0) + time.perf_counter() - start
        return out

    return timed


def _first_token_starts_timing(clock_call):
    def call(self, *args, **kwargs):
        if not self.stamps:
            SPENT.clear()
            ON[0] = True
        return clock_call(self, *args, **kwargs)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tok = load_model(quiet=True)
    ids = e2e._prompt_ids(tok, args.context)
    layers = model.config.num_hidden_layers
    e2e._TokenClock.__call__ = _first_token_starts_timing(e2e._TokenClock.__call__)
    for name in ("sdpa", "int8kv"):
        ALL_ATTENTION_FUNCTIONS[name] = _timed(ALL_ATTENTION_FUNCTIONS[name], "attention")
    DynamicCache.update = _timed(DynamicCache.update, "update")
    Int8KvCache.update = _timed(Int8KvCache.update, "update")
    ops.paged_write = _timed(ops.paged_write, "paged_write")
    ops.PreparedAttention.run = _timed(ops.PreparedAttention.run, "prepared_attention")  # inside the drop-in's too
    write.append_rows = _timed(write.append_rows, "append_rows")
    direct, split, compiled = Int8KvLayer._store_direct, write.split_rotate_store, write.store_compiled

    def route(general: bool) -> None:
        Int8KvLayer._store_direct = (lambda *a: False) if general else direct
        write.split_rotate_store = (lambda *a, **k: None) if general else split
        write.store_compiled = (lambda *a, **k: False) if general else compiled

    def dropin(name: str) -> dict:
        route(name == "general")
        if name == "DynamicCache":
            model.set_attn_implementation("sdpa")
            result = e2e.hf_decode(model, ids, 1, NEW_TOKENS, DynamicCache)
        else:
            result = e2e.hf_decode(model, ids, 1, NEW_TOKENS, lambda: Int8KvCache(model.config))
        ON[0] = False
        steps = NEW_TOKENS - 1  # timed from the first token on: the decode steps
        return {"ms_per_token": 1e3 / result["decode_tok_per_s"],
                "update_ms_per_step": SPENT.get("update", 0.0) / steps * 1e3,
                "attention_ms_per_step": SPENT.get("attention", 0.0) / steps * 1e3}  # fmt: skip

    int8, f16 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16
    engines = {(implementation, fmt): LLM(model, kv_format=fmt, memory=64 << 20, max_num_seqs=1, tokenizer=tok,
                                          implementation=implementation, weights="model")
               for implementation, fmt in (("fused", int8), ("transformers", int8), ("fused", f16))}  # fmt: skip

    def engine(name: str, implementation: str = "fused", fmt=int8) -> dict:
        route(name == "general")
        llm = engines[(implementation, fmt)]
        figures = []
        for tokens in (2, NEW_TOKENS + 2):  # the difference: NEW_TOKENS decode steps, prefill and first step out
            llm.stats = EngineStats()
            SPENT.clear()
            ON[0] = True
            llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
            ON[0] = False
            figures.append(dict(SPENT))
        per_layer = {k: (figures[1][k] - figures[0].get(k, 0.0)) / NEW_TOKENS / layers * 1e6 for k in figures[1]}
        if implementation == "transformers":
            return {"ms_per_token": 1e3 / llm.stats.decode_tokens_per_s,
                    "append_rows_us_per_layer": per_layer["append_rows"]}  # fmt: skip
        return {"ms_per_token": 1e3 / llm.stats.decode_tokens_per_s,
                "paged_write_us_per_layer": per_layer["paged_write"],
                "attention_us_per_layer": per_layer["prepared_attention"]}  # fmt: skip

    runs = {("drop-in", n): (lambda n=n: dropin(n)) for n in ("DynamicCache", "compiled", "general")}
    runs.update({("engine", n): (lambda n=n: engine(n)) for n in ("compiled", "general")})
    runs.update({("engine-transformers", n): (lambda n=n: engine(n, "transformers")) for n in ("compiled", "general")})
    runs.update({("engine-f16", n): (lambda n=n: engine(n, "fused", f16)) for n in ("compiled", "general")})
    for run in runs.values():  # compiles, loads, warms
        run()
    rows = []
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for key in order:
            rows.append({"round": r + 1, "path": key[0], "peer": key[1], **runs[key]()})
            print(rows[-1], flush=True)
    summary = {}
    for path, peer in runs:
        mine = [row for row in rows if (row["path"], row["peer"]) == (path, peer)]
        summary[f"{path} {peer}"] = {k: statistics.median(row[k] for row in mine) for k in mine[0] if k not in
                                     ("round", "path", "peer")}  # fmt: skip

    def paired(path: str, a: str, b: str) -> float:
        """Median over rounds of b's ms per token / a's (above 1: a is faster)."""
        by = {(row["round"], row["peer"]): row["ms_per_token"] for row in rows if row["path"] == path}
        return statistics.median(by[(r, b)] / by[(r, a)] for r in range(1, args.rounds + 1))

    ratios = {"drop-in compiled speed / DynamicCache": paired("drop-in", "compiled", "DynamicCache"),
              "drop-in general speed / DynamicCache": paired("drop-in", "general", "DynamicCache"),
              "drop-in compiled speed / general": paired("drop-in", "compiled", "general"),
              "engine compiled speed / general": paired("engine", "compiled", "general"),
              "engine-transformers compiled speed / general": paired("engine-transformers", "compiled", "general"),
              "engine-f16 compiled speed / general": paired("engine-f16", "compiled", "general")}  # fmt: skip
    for name, figures in summary.items():
        print(f"{name:22s}", " ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "PYTHONPATH=src python docs/results/decode_write_ab.py "
                       f"--context {args.context} --rounds {args.rounds}", "torch_threads": torch.get_num_threads(),
                       "load_average_before": load_before, "load_average_after": os.getloadavg(),
                       "summary": summary, "ratios": ratios, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
