"""Next-token choice from logits: logit bias and penalties, then greedy or temperature with min-p, top-k and top-p
cuts, each request with its own generator."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

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


def probabilities(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                  min_p: float = 0.0) -> torch.Tensor:
    """float64 `[vocab]` distribution of one row of `logits [vocab]` after temperature and the cuts: min_p (a
    token whose probability is below min_p x the largest), top_k (the k most likely; ties at the k-th value all
    stay), then top_p (SamplingParams).

    The max is subtracted before dividing, so a tiny temperature drives every non-maximal logit to -inf
    (probability 0) instead of overflowing: temperature -> 0 becomes argmax (ties share the mass).
    """
    scaled = (logits.double() - logits.max().double()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    cut = False
    if min_p > 0:
        probs, cut = probs.masked_fill(probs < min_p * probs.max(), 0), True
    if 0 < top_k < probs.numel():
        probs, cut = probs.masked_fill(probs < probs.topk(top_k).values[-1], 0), True
    if top_p < 1:
        if cut:  # top_p is a share of what the other cuts left
            probs = probs / probs.sum()
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is < top_p: the smallest prefix reaching top_p (at least one).
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return probs


def adjust(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[tuple[Seq[int], Seq[int]]]
           ) -> torch.Tensor:
    """`logits [batch, vocab]` after each row's logit_bias and penalties (SamplingParams), as a new tensor; the
    input itself when no row has any. `histories[b]`: row b's (prompt, output) token ids. One pass over the
    rows that adjust: the output tokens' counts and the seen mask are built for all of them at once."""
    rows = [b for b, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    n, vocab = len(rows), logits.shape[-1]
    picked = [params[b] for b in rows]
    sub = logits[rows].float()
    bias = [(i, t, v) for i, p in enumerate(picked) for t, v in (p.logit_bias or ())]
    if bias:
        at, tok, val = zip(*bias, strict=True)
        sub.index_put_((torch.tensor(at), torch.tensor(tok)), torch.tensor(val, dtype=sub.dtype), accumulate=True)
    outputs = [list(histories[b][1]) for b in rows]
    counts = torch.zeros(n, vocab, dtype=sub.dtype)
    lengths = torch.tensor([len(o) for o in outputs])
    if int(lengths.sum()):
        ids = torch.tensor([t for o in outputs for t in o])
        counts.index_put_((torch.arange(n).repeat_interleave(lengths), ids), torch.ones(len(ids), dtype=sub.dtype),
                          accumulate=True)
    repetition = torch.tensor([p.repetition_penalty for p in picked], dtype=sub.dtype).unsqueeze(1)
    if bool((repetition != 1).any()):
        seen = counts > 0
        prompts = [list(histories[b][0]) for b in rows]
        plens = torch.tensor([len(q) for q in prompts])
        seen[torch.arange(n).repeat_interleave(plens), torch.tensor([t for q in prompts for t in q],
                                                                    dtype=torch.long)] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    frequency = torch.tensor([p.frequency_penalty for p in picked], dtype=sub.dtype).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in picked], dtype=sub.dtype).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    out = logits.clone()
    out[rows] = sub.to(out.dtype)
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    histories: Seq[tuple[Seq[int], Seq[int]]] | None = None,
) -> list[int | NonFiniteError]:
    """One token per row of `logits [batch, vocab]` (row b follows params[b] with generators[b]; `histories[b]`,
    its (prompt, output) token ids, is needed when a row has penalties).

    A row holding NaN or +inf (or only -inf) gets a NonFiniteError in its place instead of a token, so the
    caller can fail that request alone. Greedy rows share one argmax over the batch.
    """
    if histories is None:
        if any(p.adjusts_logits for p in params):
            raise ValueError("sample: penalties or logit_bias need each row's history")
    else:
        logits = adjust(logits, params, histories)
    # One pass gives both: max propagates NaN, and a row whose max is +-inf has no usable distribution
    # (a -inf logit among finite ones is fine: probability 0).
    top, greedy_t = logits.max(dim=-1)
    finite = torch.isfinite(top).tolist()
    greedy = greedy_t.tolist()
    out: list[int | NonFiniteError] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not finite[row]:
            out.append(NonFiniteError("the model's logits for this request hold NaN or inf"))
        elif p.temperature == 0:
            out.append(greedy[row])
        else:
            probs = probabilities(logits[row], p.temperature, p.top_p, p.top_k, p.min_p)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its logits: before temperature and top-p) and
    the `k` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token_ids: Seq[int], k: int) -> list[TokenLogprob]:
    """Row r of `logits [rows, vocab]` scores `token_ids[r]`; the top `k` alternatives of each row. float64
    log-softmax, so a token far down the distribution still gets a finite, exact value (a -inf logit, which
    sampling allows, gives -inf). NonFiniteError for a row holding NaN or +inf, or only -inf (the rows `sample`
    refuses: there is no distribution to report)."""
    if not bool(torch.isfinite(logits.max(dim=-1).values).all()):
        raise NonFiniteError("the model's logits hold NaN or inf; no log-probabilities to report")
    lp = torch.log_softmax(logits.double(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [256, 49,152] rows: log-softmax + topk 0.13 s, a full sort 1.7 s
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp = top_ids = [[] for _ in chosen]
    return [TokenLogprob(int(t), c, tuple(zip(i, v, strict=True)))
            for t, c, i, v in zip(ids.tolist(), chosen, top_ids, top_lp, strict=True)]
