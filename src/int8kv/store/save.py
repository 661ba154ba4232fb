"""save_kv: a cache's state (through its public ``export_state``) written as a KV file."""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..cache.contiguous import QuantizedKvCache
from ..cache.paged import PagedKvCache
from ..cache.state import GroupedKvState, KvState
from ..errors import KvCacheError
from ._util import int8kv_cache_class, raw_bytes
from .errors import ModelMismatch, SaveError
from .files import check_path, check_save_target, write_atomic
from .fingerprint import ModelFingerprint, as_fingerprint
from .format import encode, fingerprint_problem, metadata_problem, parse_header
from .inspect import describe

__all__ = ["save_kv"]


def save_kv(
    path: str | os.PathLike[str],
    cache: Any,
    *,
    model: Any = None,
    weights_id: str | None = None,
    token_ids: Any = None,
    seq_id: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the cache's KV state to ``path`` atomically; returns what :func:`inspect_kv` would report.

    Args:
        cache: a :class:`QuantizedKvCache`, an ``int8kv.hf.Int8KvCache``, or a :class:`PagedKvCache` with
            ``seq_id`` (that sequence's rows, in position order, whatever blocks hold them).
        model: the model (or its config, or a :class:`ModelFingerprint`) the state was computed by; it is
            recorded so that loading for another model is refused. None records no model.
        weights_id: with a model/config, identifies the weights instead of hashing them.
        token_ids: the ``[seq_len]`` or ``[batch, seq_len]`` token ids the state was computed from.
        metadata: JSON mapping stored as is (e.g. the prompt text), at most 32 levels deep.

    The file is written to a temporary file in the same directory, fsynced, renamed over ``path`` and the
    directory fsynced: a crash leaves either the old file or the complete new one, never a partial file at
    ``path``. Temporaries that killed saves to the same ``path`` left behind are removed first (see
    docs/kv_file_format.md). Only a regular file or a new name in an existing folder is replaced: anything else
    at ``path`` (directory, FIFO, device, socket, symlink), a missing folder or a path under a regular file
    raises KvFileUnwritable. A refused save (SaveError, ModelMismatch, KvPathError, KvFileUnwritable) touches
    no file.
    """
    name = check_path(path)
    check_save_target(name)  # before any work: a directory, FIFO, device, socket or symlink is never replaced
    if sys.byteorder != "little":
        raise SaveError("KV files are little-endian; this platform is big-endian")
    state, source = _export(cache, seq_id)
    fingerprint = as_fingerprint(model, weights_id)
    if fingerprint is not None:
        problem = fingerprint_problem(fingerprint, state.layouts)
        if problem is not None:
            held = state.layouts[0].dims if len(state.layouts) == 1 else [la.dims for la in state.layouts]
            raise ModelMismatch(f"{problem} the cache holds {held}: this state was not computed by this model")
    tokens = _check_token_ids(token_ids, state, fingerprint)
    user = {} if metadata is None else metadata
    problem = "it is not a mapping" if not isinstance(user, Mapping) else metadata_problem(user)
    if problem is not None:
        raise SaveError(f"metadata must be a JSON-serialisable mapping with string keys: {problem}")
    header, tensors, data_bytes = encode(state, tokens, fingerprint, user, source, _created_by())
    # The tensors' bytes are produced lazily, one tensor at a time, as the writer consumes them.
    write_atomic(Path(name), itertools.chain((header,), (raw_bytes(t) for t in tensors)))
    return describe(parse_header(header[8:].rstrip(b" ")), Path(name), len(header) + data_bytes, tokens)


def _export(cache: Any, seq_id: Any) -> tuple[KvState | GroupedKvState, str]:
    """The cache's state through its public export_state, and the name recorded as the file's source."""
    if seq_id is not None and not isinstance(cache, PagedKvCache):
        raise SaveError("seq_id is only meaningful for a PagedKvCache")
    if isinstance(cache, PagedKvCache):
        if seq_id is None:
            raise SaveError("saving a PagedKvCache needs seq_id= (the sequence whose blocks to save)")
        export, source = functools.partial(cache.export_state, seq_id), "PagedKvCache"
    elif isinstance(cache, QuantizedKvCache):
        export, source = cache.export_state, "QuantizedKvCache"
    else:
        hf_cache = int8kv_cache_class()
        if hf_cache is None or not isinstance(cache, hf_cache):
            raise SaveError(
                f"cannot save a {type(cache).__name__}: expected QuantizedKvCache, PagedKvCache (with seq_id) "
                "or int8kv.hf.Int8KvCache"
            )
        export, source = cache.export_state, "Int8KvCache"
    try:
        state = export()
    except KvCacheError as exc:  # e.g. an Int8KvCache that holds nothing yet, an unknown sequence
        raise SaveError(f"cannot save this {source}: {exc}") from exc
    return state, source


def _check_token_ids(
    token_ids: Any, state: KvState | GroupedKvState, fingerprint: ModelFingerprint | None
) -> torch.Tensor | None:
    """``[batch, length]`` int64 CPU token ids in [0, vocab), or SaveError."""
    if token_ids is None:
        return None
    try:
        t = token_ids if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SaveError(f"token_ids must be a tensor or nested list of ints: {exc}") from exc
    if t.numel() == 0:
        t = t.to(torch.int64)  # torch.as_tensor([]) is float32: an empty list has no dtype to check
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise SaveError(f"token_ids must be integers, got {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if tuple(t.shape) != (state.batch, state.length):
        raise SaveError(
            f"token_ids must be [{state.length}] or [{state.batch}, {state.length}] (batch, stored tokens), "
            f"got {tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else tuple(t.shape)}"
        )
    t = t.detach().to("cpu").contiguous().to(torch.int64)
    vocab = fingerprint.vocab_size if fingerprint is not None else None
    if t.numel() and (int(t.min()) < 0 or (vocab is not None and int(t.max()) >= vocab)):
        raise SaveError(
            f"token ids must lie in [0, {vocab if vocab is not None else 'vocab'}), got "
            f"[{int(t.min())}, {int(t.max())}]"
        )
    return t


@functools.lru_cache(maxsize=1)
def _created_by() -> str:
    try:
        from importlib.metadata import version

        return f"int8kv {version('int8kv')}"
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "int8kv"
