"""A request's growing token list as text deltas, cut at the first stop string.

Every call decodes the whole output (detokenizers merge bytes across tokens, so decoding token by token would
split multi-byte characters) and hands out only what is new and final: a trailing U+FFFD (bytes of a character
still arriving) and the last `longest stop - 1` characters (maybe the start of a stop string) are held back
until the next tokens or the end. Concatenated deltas therefore equal the non-streamed text.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # handed out so far
        self.stopped = False  # a stop string was found: the request is complete

    def feed(self, new_ids: list[int], final: bool) -> str:
        """The text that `new_ids` add (everything left when `final`); sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(full)
        if cut is not None:
            full, final, self.stopped = full[:cut], True, True
        end = len(full)
        if not final:
            while end > len(self.text) and full[end - 1] == "\ufffd":
                end -= 1
            end = max(len(self.text), end - self.hold)
        delta = full[len(self.text):end]
        self.text += delta
        return delta

    def _first_stop(self, full: str) -> int | None:
        # Only text from just before what was already handed out can hold a new match.
        start = max(0, len(self.text) - self.hold)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None


CONTEXT = 6  # tokens of left context a token is decoded in (a character's bytes span at most 4 tokens)


def token_texts(tokenizer: Any, ids: list[int], before: list[int] | None = None,
                alternatives: list[list[int]] | None = None) -> tuple[list[str], list[list[str]]]:
    """The text each of `ids` adds after the tokens before it (`before`, then the earlier ids), decoded in a
    window of CONTEXT tokens so that a tokenizer's leading-space rules and byte merges see their context; and
    for each position the text each of its `alternatives` would have added there. Special tokens are shown."""
    seq = list(before or []) + list(ids)
    start = len(seq) - len(ids)
    texts: list[str] = []
    alts: list[list[str]] = []
    for j, token in enumerate(ids):
        ctx = seq[max(0, start + j - CONTEXT) : start + j]
        head = len(tokenizer.decode(ctx)) if ctx else 0
        texts.append(tokenizer.decode([*ctx, token])[head:])
        alts.append([tokenizer.decode([*ctx, a])[head:] for a in (alternatives[j] if alternatives else [])])
    return texts, alts
