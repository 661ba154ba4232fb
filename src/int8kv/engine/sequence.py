"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p < 1 samples from the nucleus; generation stops at max_tokens or EOS."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")


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
    # Cache slots reserved for the tokens scheduled in the current step.
    slots: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached
