"""An engine process for the KV-store tests: ``python engine_store_child.py MODEL_DIR STORES PROMPTS``.

Loads the model saved in MODEL_DIR; for each ``[url, namespace]`` of the JSON list STORES, one after the other,
builds an `LLM` on that block store, generates greedily from the JSON list of token-id prompts, waits for its
block writes and closes the engine. Prints one JSON line: per store, the generated token ids and the engine's and
the store's counters. One process serves every store: its start (importing torch and transformers, ~8 s of the
~10 a process took) is the cost, not the engine's run. Bounded: each flush waits 30 s.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from transformers import AutoModelForCausalLM

from int8kv.engine import LLM, SamplingParams

MAX_TOKENS = 8


def run(model, url: str, namespace: str, prompts: list[list[int]]) -> dict:
    with LLM(model, memory="1MiB", kv_store=url, kv_namespace=namespace) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        flushed = llm.flush_kv_store(timeout=30)
        store = llm.kv_store.stats().as_dict()
    return {"outputs": [o.token_ids for o in outputs], "stats": asdict(llm.stats), "store": store, "flushed": flushed}


def main() -> None:
    model_dir, stores, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    print(json.dumps([run(model, url, namespace, prompts) for url, namespace in stores]))


if __name__ == "__main__":
    main()
