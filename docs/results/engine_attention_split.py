"""An engine decode step of SmolLM2 (the defaults: INT8, packed GGUF blocks, fused forward) split into the time
inside the CPU attention kernels' entry (what `ops.cpu.prepare` returns, run per layer; `ops.cpu.attend` in
checkouts before it) and the rest, at two contexts: per decoded token, the
difference of an 18-token and a 2-token generate of the same prompt (a GPL-3 prefix from
/usr/share/common-licenses), three rounds each, for whichever checkout PYTHONPATH names:

    PYTHONPATH=src python docs/results/engine_attention_split.py [CONTEXT ...] [--json PATH]
"""

import argparse
import json
import time

import int8kv.ops.cpu as cpu
from int8kv.engine import LLM, SamplingParams
from int8kv.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("contexts", nargs="*", type=int, default=[512, 7000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tok = load_model(quiet=True)
    ids = tok(open("/usr/share/common-licenses/GPL-3").read())["input_ids"]
    spent = [0.0]

    def timed(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    if hasattr(cpu, "prepare"):  # ops.PreparedAttention runs what `cpu.prepare` returns, once per layer
        prepare = cpu.prepare
        cpu.prepare = lambda *a, **k: timed(prepare(*a, **k))
    else:  # older checkouts: ops.attention looks the backend's `attend` up at each call
        cpu.attend = timed(cpu.attend)

    def run(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, float]:
        spent[0] = 0.0
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start, spent[0]

    results = {}
    for ctx in args.contexts:
        llm = LLM(model, max_num_batched_tokens=ctx)
        prompt = ids[:ctx]
        run(llm, prompt, 2)  # compiles, and fills the prefix cache
        rounds = []
        for _ in range(args.rounds):
            short, long = run(llm, prompt, 2), run(llm, prompt, 18)
            rounds.append({"step_ms": (long[0] - short[0]) / 16 * 1e3, "attention_ms": (long[1] - short[1]) / 16 * 1e3})
        results[ctx] = rounds
        print(ctx, " ".join(f"step {r['step_ms']:.2f} ms (attention {r['attention_ms']:.2f})" for r in rounds))
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
