"""Next-token choice from logits: greedy, temperature, nucleus (top-p), each request with its own generator."""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .sequence import SamplingParams


def make_generator(params: SamplingParams, default_seed: int) -> torch.Generator | None:
    """The request's private generator (None for greedy): its seed, or `default_seed` when it has none."""
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else default_seed)
    return gen


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """float64 `[vocab]` distribution of one row of `logits [vocab]` after temperature and the top-p cut.

    The max is subtracted before dividing, so a tiny temperature drives every non-maximal logit to -inf
    (probability 0) instead of overflowing: temperature -> 0 becomes argmax (ties share the mass).
    """
    scaled = (logits.double() - logits.max().double()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is < top_p: the smallest prefix reaching top_p (at least one).
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | NonFiniteError]:
    """One token per row of `logits [batch, vocab]` (row b follows params[b] with generators[b]).

    A row holding NaN or inf gets a NonFiniteError in its place instead of a token, so the caller can fail
    that request alone. Greedy rows share one argmax over the batch.
    """
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int | NonFiniteError] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not finite[row]:
            out.append(NonFiniteError("the model's logits for this request hold NaN or inf"))
        elif p.temperature == 0:
            out.append(greedy[row])
        else:
            probs = probabilities(logits[row], p.temperature, p.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
