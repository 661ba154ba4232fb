"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list of choices or an EBNF
grammar, by masking the tokens the grammar cannot take next before each token is chosen.

The grammar engine is xgrammar (an optional dependency: `int8kv[serve]`), chosen over llguidance for its lower
cost a step at batch 16 (docs/performance.md, tools/grammar_backends.py). Masks are applied here, by unpacking
the bits in torch, which costs less than either library's CPU function.

`Guide` is what a request asks for (checked and compiled when the request is queued, so a bad schema is refused
before anything runs); `Grammars` is one engine's compiler and cache of compiled grammars; a sequence holds one
`GrammarMatcher` (its state after the tokens it has generated), advanced after every token it samples.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHE = 64  # compiled grammars kept per engine (a request reusing a schema skips its compile)


@dataclass(frozen=True)
class Guide:
    """What a request's output must match: `kind` in KINDS and its `spec` (a JSON schema as a JSON string for
    "json"; a regular expression; the choices joined as a JSON list for "choice"; EBNF in xgrammar's dialect
    for "grammar"; "" for "json_object", any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"a structured output kind is one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequest(f"a structured output's spec is a string, got {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Guide:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: Seq[str]) -> Guide:
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest("choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))


class Grammars:
    """One engine's grammar compiler (built at the first structured request: ~0.3 s for a 49k vocabulary) and its
    compiled grammars, least recently used dropped past _CACHE."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[Guide, Any] = OrderedDict()
        self._bits = torch.arange(32, dtype=torch.int32)
        self._batch: Any = None  # xgrammar's batch filler, made at the first mask and kept (the engine thread's)
        self._lock = threading.Lock()  # the server compiles on its tokenizer thread while the engine steps

    def _xgrammar(self) -> Any:
        try:
            import xgrammar
        except ImportError:
            raise InvalidRequest("structured outputs need the xgrammar package: pip install 'int8kv[serve]'") from None
        return xgrammar

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of `guide`; InvalidRequest naming what is wrong with a bad spec."""
        with self._lock:
            return self._compile(guide)

    def _compile(self, guide: Guide) -> Any:
        hit = self._compiled.get(guide)
        if hit is not None:
            self._compiled.move_to_end(guide)
            return hit
        xgr = self._xgrammar()
        if self.tokenizer is None:
            raise InvalidRequest("structured outputs need a tokenizer")
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            compiled = self._build(xgr, guide)
        except (RuntimeError, ValueError, TypeError, re.error) as e:  # xgrammar's (and re's) for a bad spec
            what = {"json": "JSON schema", "regex": "regular expression"}.get(guide.kind, guide.kind)
            raise InvalidRequest(f"invalid {what}: {_first_line(e)}") from None
        self._compiled[guide] = compiled
        if len(self._compiled) > _CACHE:
            self._compiled.popitem(last=False)
        return compiled

    def _build(self, xgr: Any, guide: Guide) -> Any:
        c = self._compiler
        # Compact JSON (one space after ',' and ':'): with any whitespace allowed, a small model sampling at
        # temperature 1 can spend its tokens on blanks and be cut off before the object closes.
        if guide.kind == "json":
            schema = json.loads(guide.spec)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object")
            return c.compile_json_schema(guide.spec, any_whitespace=False)
        if guide.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if guide.kind == "regex":
            re.compile(guide.spec)  # Python's reading first: a clearer message for a plain syntax error
            return c.compile_regex(guide.spec)
        if guide.kind == "choice":  # EBNF string literals take JSON's escapes
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                             for s in json.loads(guide.spec)))
        return c.compile_grammar(guide.spec)

    def matcher(self, guide: Guide) -> Any:
        """A fresh matcher (the state before any output) of `guide`'s grammar."""
        return self._xgrammar().GrammarMatcher(self.compile(guide))

    def mask(self, logits: torch.Tensor, matchers: Seq[Any]) -> tuple[torch.Tensor, list[int]]:
        """`logits [batch, vocab]` with each row that has a matcher (None: unconstrained) set to -inf at the tokens
        its grammar cannot take next (a new tensor; the input itself when no row has one), and the rows whose
        grammar takes no token of the vocabulary at all."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits, []
        xgr = self._xgrammar()
        vocab = logits.shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask)
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).bool().flatten(1)[:, :vocab]
        out = logits.clone()
        out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return out, [row for row, ok in zip(rows, allowed.any(dim=1).tolist(), strict=True) if not ok]


def accept(matcher: Any, token: int) -> bool:
    """Advance `matcher` by the chosen `token`; False if its grammar refuses it (a mask was not applied)."""
    return bool(matcher.accept_token(token))


def finished(matcher: Any) -> bool:
    """The grammar is complete and has taken its stop token: the output is whole."""
    return bool(matcher.is_terminated())


def _first_line(error: Exception) -> str:
    """The error's first line without xgrammar's "[time] file.cc:line: " prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(error).__name__
