"""The decode-every-token run of eval_decode_precision.py and eval_decode_noise.py (imported by both).

The 2,048 scored tokens of `int8kv eval`'s default run (its text, 8 windows of 512 tokens, the second half of
each scored), the 8 windows decoded as one batch: the first half of each prefilled in chunks of 128, then one
token per forward, so every scored token goes through the decode kernels. Torch and numba on one thread.
"""

import os
from collections.abc import Iterator

import numba
import torch

from int8kv.eval import cache_kinds, read_text, windows
from int8kv.models import load_model
from int8kv.ops import cpu_simd


def setup(command: str) -> tuple:
    """``(model, fp32 kind, INT8 kind, windows [8, 512], half, result dict)``, one thread for torch and numba."""
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    model, tok = load_model(None, quiet=True)
    base, _, int8 = cache_kinds(include_fp8=False)
    wins = torch.tensor(windows(tok(read_text(None))["input_ids"], 512, 8))
    half = wins.shape[1] // 2
    result = {
        "command": command, "windows": wins.shape[0], "scored_tokens": wins.shape[0] * half, "dot": cpu_simd.DOT,
        "load_average_before": os.getloadavg(), "rows": [],
    }
    return model, base, int8, wins, half, result


@torch.inference_mode()
def decode_logits(model, make, wins: torch.Tensor, half: int) -> Iterator[torch.Tensor]:
    """The logits ``[windows, 1, vocab]`` that score positions half..end, in order, over a cache ``make(config)``:
    the prefix's last ones after its prefill, then one per decode step."""
    cache = make(model.config)
    for start in range(0, half, 128):
        logits = model(input_ids=wins[:, start : start + 128], cache=cache, use_cache=True).logits[:, -1:]
    yield logits
    for pos in range(half, wins.shape[1] - 1):
        yield model(input_ids=wins[:, pos : pos + 1], cache=cache, use_cache=True).logits
