"""Per-step cost of a JSON-schema token mask at batch 16 on SmolLM2's vocabulary: xgrammar against llguidance,
same run, same random walk through the grammar (the choice behind int8kv.engine.grammar).

    pip install llguidance   # not an int8kv dependency
    .venv/bin/python tools/grammar_backends.py [--batch 16] [--steps 48] [--json PATH]

Each step: fill the batch's bitmasks, apply them to [batch, vocab] logits, advance every matcher by a token its
mask allows (chosen at random, seeded, so the walk goes through the grammar's states). Printed: ms a step for
each part and each library, and llguidance's over xgrammar's.
"""

import argparse
import json
import random
import time
from importlib.metadata import version

import torch

from int8kv.models import load_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def walk(batch, steps, vocab, fill, apply, accept):
    """Mean ms a step of (fill, apply, accept)."""
    rng, logits = random.Random(0), torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    spent = [0.0, 0.0, 0.0]
    for _ in range(steps):
        row = logits.clone()
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        apply(row)
        t2 = time.perf_counter()
        tokens = []
        for i in range(batch):
            allowed = torch.isfinite(row[i]).nonzero().flatten()
            tokens.append(int(allowed[rng.randrange(len(allowed))]) if len(allowed) else 0)
        t3 = time.perf_counter()
        accept(tokens)
        t4 = time.perf_counter()
        for k, d in enumerate((t1 - t0, t2 - t1, t4 - t3)):
            spent[k] += d
    return [1e3 * s / steps for s in spent]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    model, tokenizer = load_model(None, quiet=True)
    vocab, b = model.config.vocab_size, args.batch
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)).compile_json_schema(
        json.dumps(SCHEMA))
    xms = [xgr.GrammarMatcher(compiled) for _ in range(b)]
    xmask = xgr.allocate_token_bitmask(b, vocab)
    x = walk(b, args.steps, vocab, lambda: xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask(xms, xmask),
             lambda row: xgr.apply_token_bitmask_inplace(row, xmask),
             lambda toks: [m.accept_token(t) for m, t in zip(xms, toks) if not m.is_terminated()])
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    lms = [llguidance.LLMatcher(lltok, grammar) for _ in range(b)]
    lmask, executor = lt.allocate_token_bitmask(b, vocab), llguidance.LLExecutor()
    g = walk(b, args.steps, vocab, lambda: lt.fill_next_token_bitmask_par(executor, list(zip(lms, range(b))), lmask),
             lambda row: lt.apply_token_bitmask_inplace(row, lmask),
             lambda toks: [m.consume_token(t) for m, t in zip(lms, toks) if not m.is_stopped()])
    print(f"ms a step at batch {b}: fill / apply / accept")
    print(f"  xgrammar    {x[0]:7.2f} {x[1]:8.2f} {x[2]:7.2f}")
    print(f"  llguidance  {g[0]:7.2f} {g[1]:8.2f} {g[2]:7.2f}")
    print(f"  llguidance / xgrammar: fill {g[0] / x[0]:.2f}x, apply {g[1] / x[1]:.2f}x, accept {g[2] / x[2]:.2f}x")
    if args.json:
        parts = ("fill_ms", "apply_ms", "accept_ms")
        with open(args.json, "w") as f:
            json.dump({"batch": b, "steps": args.steps, "vocab": vocab, "xgrammar": dict(zip(parts, x)),
                       "llguidance": dict(zip(parts, g)), "xgrammar_version": version("xgrammar"),
                       "llguidance_version": version("llguidance")}, f, indent=1)


if __name__ == "__main__":
    main()
