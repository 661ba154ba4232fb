"""Block keys for automatic prefix caching: one SHA-256 chain per token sequence.

The key of full block ``i`` of a sequence is

    key[i] = SHA-256(key[i-1] || token ids of block i, each as little-endian uint64)
    key[-1] = root = SHA-256("int8kv.prefix.v1" || length-prefixed extra keys)

where the extra keys are everything besides the tokens that changes the stored bytes: the storage format's
name and version, the model fingerprint (a string the caller chooses: two models with equal fingerprints must
produce equal K/V), the layout (layers, KV heads, head_dim; with several K/V shapes, each further group's after
the first's), the block size and the KV head range a rank holds.
Because a key covers its parent, equal keys mean equal *prefixes*, not just equal blocks, so a lookup may walk a
chain from its start and trust every block it finds. Only full blocks have keys (a partial block is still being
written). Keys are plain digests, never Python's ``hash()``: they are equal across processes and machines, and
the block store uses them as its keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from ..errors import HeadOutOfRange, PrefixKeyError, ShapeMismatch
from .state import KvLayout

KEY_BYTES = 32  # SHA-256 digest size
_DOMAIN = b"int8kv.prefix.v1"


def _field(value: str | int) -> bytes:
    """One extra key, length-prefixed so no two field lists encode to the same bytes."""
    data = value.encode() if isinstance(value, str) else str(int(value)).encode()
    return struct.pack("<I", len(data)) + data


def _int_pair(value: object) -> tuple[int, int]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise HeadOutOfRange(f"head_range must be a (start, end) pair of ints, got {value!r}")
    return int(value[0]), int(value[1])


class PrefixHasher:
    """Computes the key chain of a token sequence for one (layout, model, block size, head range)."""

    def __init__(
        self,
        layout: KvLayout | Sequence[KvLayout],
        model_id: str,
        block_size: int,
        head_range: tuple[int, int] | None = None,
    ) -> None:
        # Several layouts: a cache with one pool per K/V shape (PagedKvCache.layouts); the first is `layout`.
        more: tuple[KvLayout, ...] = ()
        if isinstance(layout, (list, tuple)) and layout:
            layout, *rest = layout
            more = tuple(rest)
        if not isinstance(layout, KvLayout) or not all(isinstance(la, KvLayout) for la in more):
            raise ShapeMismatch(f"layout must be a KvLayout or a non-empty sequence of them, got {layout!r}")
        if more and head_range is not None:
            raise ShapeMismatch("a head range of a cache with several K/V shapes is not implemented")
        if not isinstance(model_id, str) or not model_id:
            raise PrefixKeyError(f"model_id must be a non-empty string, got {model_id!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ShapeMismatch(f"block_size must be a positive int, got {block_size!r}")
        start, end = (0, layout.num_kv_heads) if head_range is None else _int_pair(head_range)
        if not 0 <= start < end <= layout.num_kv_heads:
            raise HeadOutOfRange(f"head range [{start}, {end}) is not a non-empty part of [0, {layout.num_kv_heads})")
        self.layout = layout
        self.model_id = model_id
        self.block_size = block_size
        self.head_range = (start, end)
        fields = (
            layout.format.value,
            layout.format.version,
            model_id,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            block_size,
            start,
            end,
            *(n for la in more for n in la.dims),
        )
        self.root = hashlib.sha256(_DOMAIN + b"".join(_field(f) for f in fields)).digest()
        self._pack = struct.Struct(f"<{block_size}Q").pack

    def __repr__(self) -> str:
        return (
            f"PrefixHasher({self.layout}, model_id={self.model_id!r}, block_size={self.block_size}, "
            f"head_range={self.head_range})"
        )

    def block_key(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        """Key of one full block (``block_size`` token ids) whose predecessor has key ``parent`` (or root)."""
        if len(block_tokens) != self.block_size:
            raise PrefixKeyError(f"a block holds {self.block_size} tokens, got {len(block_tokens)}")
        try:
            data = self._pack(*block_tokens)
        except struct.error:
            raise PrefixKeyError("token ids must be ints in [0, 2**64)") from None
        return hashlib.sha256(parent + data).digest()

    def block_keys(self, token_ids: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """Keys of every full block of ``token_ids`` (a trailing partial block gets none).

        ``known``: keys this hasher already returned for a prefix of the same tokens (e.g. the list from the
        previous step of a growing sequence); they are reused as they are, so only the new blocks are hashed.
        The caller vouches that they belong to these tokens: they are not recomputed to check.
        """
        bs = self.block_size
        full = len(token_ids) // bs
        if len(known) > full:
            raise PrefixKeyError(f"{len(known)} known keys but {len(token_ids)} tokens fill only {full} blocks")
        keys = list(known)
        for key in keys:
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise PrefixKeyError(f"a known key must be {KEY_BYTES} bytes, got {key!r:.60}")
        parent = keys[-1] if keys else self.root
        for i in range(len(keys), full):
            parent = self.block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys
