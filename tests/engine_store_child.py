"""An engine process for the KV-store tests: ``python engine_store_child.py MODEL_DIR URL NAMESPACE PROMPTS``.

Loads the model saved in MODEL_DIR, builds an `LLM` on the block store URL (namespace NAMESPACE), generates
greedily from the JSON list of token-id prompts, waits for its block writes, closes the engine and prints one
JSON line: the generated token ids and the engine's and the store's counters. Bounded: the flush waits 30 s.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from transformers import AutoModelForCausalLM

from int8kv.engine import LLM, SamplingParams

MAX_TOKENS = 8


def main() -> None:
    model_dir, url, namespace, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with LLM(model, memory="1MiB", kv_store=url, kv_namespace=namespace) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        flushed = llm.flush_kv_store(timeout=30)
        store = llm.kv_store.stats().as_dict()
    print(json.dumps({"outputs": [o.token_ids for o in outputs], "stats": asdict(llm.stats), "store": store,
                      "flushed": flushed}))  # fmt: skip


if __name__ == "__main__":
    main()
