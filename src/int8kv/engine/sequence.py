"""One request's state as it moves through the engine, and the sampling parameters it carries."""

from __future__ import annotations

import enum
import itertools
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequest
from .grammar import Guide


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"  # removed mid-step by an error; `Sequence.error` says why


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool (True is an int to Python, never a token id or a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(value: object, name: str, error: type[Exception] = InvalidRequest) -> int:
    """`value` as an int if it is an integer >= 1; otherwise `error` naming `name`."""
    if not is_int(value) or value < 1:
        raise error(f"{name} must be a positive int, got {value!r}")
    return int(value)


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias (OpenAI's limit)


def _real(value: object, name: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p < 1 samples from the nucleus; generation stops at max_tokens or EOS.

    The logits are adjusted first, as vLLM does and in its order: `logit_bias` added, then the repetition
    penalty (a token seen in the prompt or the output: a positive logit divided by it, a negative one
    multiplied), then `frequency_penalty` x its count in the output and `presence_penalty` if it is there at
    all, subtracted. Greedy takes the argmax of the adjusted logits. Sampling then divides by temperature and
    keeps the tokens that pass all of `min_p` (at least min_p x the most likely token's probability),
    `top_k` (the k most likely; 0 or -1: all) and `top_p` (the nucleus).

    Every field is checked here, so a request with bad parameters is refused before it is queued.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None  # None: the request's id seeds its generator (reproducible within one process)
    # Opt-in: each generated token's log-probability and this many most likely alternatives (0-20), from the
    # step's logits (log-softmax before temperature and top-p); None computes nothing.
    logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's range (0, 2]
    frequency_penalty: float = 0.0  # OpenAI's range [-2, 2]
    presence_penalty: float = 0.0
    # token id -> a value in [-100, 100] added to its logit (OpenAI's range); kept as sorted (id, value) pairs
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    # The output held to a JSON schema, regex, choices or grammar (engine/grammar.py); None: free text
    guide: Guide | None = None

    def __post_init__(self) -> None:
        positive_int(self.max_tokens, "max_tokens")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            _real(getattr(self, name), name)
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be an int >= 1, or 0 or -1 for every token, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must lie in [0, 1], got {self.min_p!r}")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequest(f"repetition_penalty must lie in (0, 2], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must lie in [-2, 2], got {getattr(self, name)!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise InvalidRequest(f"guide must be None or an int8kv.engine.Guide, got {type(self.guide).__name__}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            if not is_int(self.seed):
                raise InvalidRequest(f"seed must be None or an int, got {self.seed!r}")
            try:  # the range torch accepts ([-2**63, 2**64)) is the one that can seed a generator later
                torch.Generator().manual_seed(int(self.seed))
            except (RuntimeError, OverflowError, ValueError) as e:
                raise InvalidRequest(f"seed {self.seed!r} cannot seed a torch.Generator: {e}") from None
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Any of logit_bias and the three penalties is set: the logits change before the choice."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 or bool(self.frequency_penalty) or bool(
            self.presence_penalty)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """A logit_bias mapping (or its pairs) as sorted (token id, value) pairs; InvalidRequest naming a bad entry.
    Token ids are checked against the vocabulary when the request is queued (the model knows its size)."""
    if bias is None:
        return None
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, Iterable) or isinstance(pairs, str | bytes):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidRequest(f"logit_bias must map token ids to numbers, got an entry {pair!r}")
        token, value = pair
        if not is_int(token) or token < 0:
            raise InvalidRequest(f"logit_bias: {token!r} is not a token id (an int >= 0)")
        if not -100 <= _real(value, f"logit_bias[{token}]") <= 100:
            raise InvalidRequest(f"logit_bias[{token}] must lie in [-100, 100], got {value!r}")
        out[int(token)] = float(value)
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias holds {len(out)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    return tuple(sorted(out.items())) or None


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose K/V sit in the cache; a preempted sequence drops back to 0 and is recomputed.
    num_cached: int = 0
    num_preemptions: int = 0
    # Cache slots reserved for the tokens scheduled in the current step (int64 [tokens]).
    slots: torch.Tensor | None = None
    # The runner's int32 copy of this sequence's block table; the first `num_table_blocks` entries are current.
    # Blocks are only appended while a sequence runs, so the copy grows by its tail; a preemption resets it.
    block_table: torch.Tensor | None = None
    num_table_blocks: int = 0
    # "stop" (EOS), "length" (max_tokens) or "error" (then `error` holds the message); None while running.
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None  # this request's sampling randomness (None when greedy)
    # Prefix-cache keys of the full blocks of `tokens` computed so far (cache/prefix.py); they depend on the
    # tokens only, so they are kept across preemption. The first `num_registered` blocks of the current
    # admission are keyed in the allocator (hit, loaded from a store, or computed and registered since).
    block_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    # A forked group (LLM.add_forked_request): one sequence prefills the prompt for all n choices; the other
    # n - 1 wait in its `forks` (each with `fork_of` pointing back) until that prefill ends, then are forked off
    # its blocks copy-on-write (Scheduler.fork) and run as ordinary sequences. Both are empty/None otherwise.
    forks: list[Sequence] = field(default_factory=list)
    fork_of: Sequence | None = field(default=None, repr=False)
    # With params.logprobs: one TokenLogprob (engine/sampler.py) per output token.
    logprobs: list = field(default_factory=list)
    # Prompt tokens found in the prefix cache (pool or block store) when first admitted (before any preemption).
    num_cached_prompt: int = 0
    # time.perf_counter() when the scheduler first ran it (a fork: its parent's); None while it has not run
    admitted_at: float | None = None
    # With params.guide: its grammar's matcher, advanced by each sampled token (LLM._retire)
    matcher: Any = field(default=None, repr=False)

    @property
    def group_size(self) -> int:
        """Seats this sequence takes in the running batch once its forks have joined it: 1 + pending forks."""
        return 1 + len(self.forks)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole prompt + output list."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached

    @property
    def is_decoding(self) -> bool:
        """Its whole prompt is cached and only the last generated token is not: the next step decodes it."""
        return bool(self.output) and self.num_uncached == 1 and self.num_cached >= len(self.prompt)

    def append(self, token: int, eos_ids: tuple[int, ...], complete: bool = False) -> bool:
        """Add a sampled token; True (and `finish_reason` set) when the request is complete: EOS, max_tokens, or
        `complete` (its grammar has ended)."""
        self.output.append(token)
        if complete or (not self.params.ignore_eos and token in eos_ids):
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
