"""load_kv: a KV file read with every check and handed to a cache through its public ``import_state``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.contiguous import QuantizedKvCache
from ..cache.paged import PagedKvCache
from ..cache.state import GroupedKvState, KvState
from ..cache.state_q4w import TENSOR_NAMES, Q4WState
from ..errors import KvCacheError, KvPoolExhausted
from ..formats import KvStorageFormat
from ._util import int8kv_cache_class
from .errors import CorruptKvFile, IncompatibleCache, ModelMismatch
from .files import check_path, open_for_reading
from .fingerprint import ModelFingerprint, as_fingerprint
from .format import Header, read_data, read_header

__all__ = ["LoadedKv", "load_kv"]


@dataclass(frozen=True)
class LoadedKv:
    """What :func:`load_kv` restored."""

    cache: Any  # the cache now holding the state (the one passed in, or a new QuantizedKvCache)
    token_ids: torch.Tensor | None  # [batch, seq_len] int64, the tokens the state was computed from
    seq_len: int
    batch: int
    format: KvStorageFormat
    model: ModelFingerprint | None
    metadata: dict[str, Any]
    seq_id: Any = None  # the new sequence, for a PagedKvCache


def load_kv(
    path: str | os.PathLike[str],
    cache: Any = None,
    *,
    model: Any = None,
    weights_id: str | None = None,
    seq_id: Any = None,
    device: torch.device | str | None = None,
) -> LoadedKv:
    """Restore a state written by :func:`save_kv` into ``cache``; on any error ``cache`` is left untouched.

    Args:
        cache: where to load. A :class:`QuantizedKvCache` or an ``int8kv.hf.Int8KvCache`` is overwritten
            with the file's state (its previous tokens are dropped). A :class:`PagedKvCache` gets a new
            sequence ``seq_id`` holding the state, in freshly allocated blocks. None: a new
            :class:`QuantizedKvCache` of exactly the file's length is created on ``device`` (a file of the 4-bit
            format with sinks and a window, which that cache does not hold, is refused by name).
        model: the model (or config, or :class:`ModelFingerprint`) the state is loaded for; the file's
            fingerprint must equal it field by field. None skips the check (the target's shapes are still
            checked). Pass a precomputed fingerprint to avoid re-hashing the weights on every load.
        weights_id: with a model/config, the id given to :func:`save_kv` instead of the weight hash.
        device: where new storage goes when the target has none yet (a new cache, an Int8KvCache before its
            first forward); default: the device of ``model`` if it is a torch module, else the CPU.

    Raises (all :class:`~int8kv.errors.StoreError`, except a full paged pool): KvPathError, UnsupportedKvFile,
    CorruptKvFile (TruncatedKvFile, ChecksumMismatch, HeaderShapeMismatch), ModelMismatch, IncompatibleCache,
    KvFileUnreadable; KvPoolExhausted when the paged pool lacks the blocks.
    """
    name = check_path(path)
    expected = as_fingerprint(model, weights_id)
    if device is None and isinstance(model, torch.nn.Module):
        param = next(model.parameters(), None)
        device = param.device if param is not None else None
    with open_for_reading(name) as (f, size):
        header = read_header(f, size)
        if expected is not None:
            _check_model(header, expected)
        # Everything that can refuse is checked before the data is read and before the target changes.
        commit = _plan(header, cache, seq_id, device)
        tensors = read_data(f, header, keep={t.name for t in header.tensors})
    target = commit(_to_state(header, tensors))
    token_ids = tensors["token_ids"].clone() if header.has_token_ids else None
    return LoadedKv(target, token_ids, header.seq_len, header.batch, header.fmt, header.model, header.metadata, seq_id)


def _check_model(header: Header, expected: ModelFingerprint) -> None:
    if header.model is None:
        raise ModelMismatch("the file records no model fingerprint; load it with model=None to skip the check")
    diffs = header.model.differences(expected)
    if diffs:
        raise ModelMismatch("the KV state was computed by another model (file != model): " + "; ".join(diffs))


def _to_state(header: Header, t: dict[str, torch.Tensor]) -> KvState | GroupedKvState | Q4WState:
    """The checked tensors as a KvState (a GroupedKvState for a version-2 file): per layer
    ``[batch, seq_len, heads, ...]`` parts (views, no copy); a Q4WState for the 4-bit format with sinks and a
    window (copies, every sequence's stored form checked)."""
    try:
        if header.fmt.is_stateful:  # its stored form's arrays (values checked: rows_problem per sequence)
            return Q4WState.from_arrays(header.layouts[0], header.batch, header.seq_len,
                                        {name: t[name] for name in TENSOR_NAMES})
        names = header.fmt.spec.tensor_names()
        suffix = [f".{g}" if header.grouped else "" for g in range(len(header.layouts))]
        sections = [
            KvState.from_parts(la, {name: list(t[name + suffix[g]].unbind(0)) for name in names})
            for g, la in enumerate(header.layouts)
        ]
        return GroupedKvState.of(sections, header.layers) if header.grouped else sections[0]
    except KvCacheError as exc:  # cannot happen for a header read_header accepted; kept typed regardless
        raise CorruptKvFile(f"the file's tensors do not form a KV state: {exc}") from exc


def _check_fits(header: Header, what: str, layouts: tuple[Any, ...]) -> None:
    if layouts[0].format != header.fmt:
        raise IncompatibleCache(f"the file stores {header.fmt.value} but the {what} holds {layouts[0].format.value}")
    got, want = [la.dims for la in header.layouts], [la.dims for la in layouts]
    if got != want:
        per = " of each group of K/V shapes" if len(got) + len(want) > 2 else ""
        what_dims = f"(layers, kv heads, head_dim){per}"
        raise IncompatibleCache(
            f"the file holds {what_dims} {got if len(got) > 1 else got[0]} but the {what} has "
            f"{want if len(want) > 1 else want[0]}"
        )


def _plan(header: Header, cache: Any, seq_id: Any, device: torch.device | str | None) -> Callable[[KvState], Any]:
    """Check that the state fits ``cache`` and return the function that imports it there. The caches'
    import_state methods are atomic and check again; checking here first refuses before the data is read,
    with the store's own errors."""
    if seq_id is not None and not isinstance(cache, PagedKvCache):
        raise IncompatibleCache("seq_id is only meaningful when loading into a PagedKvCache")
    if header.fmt.is_stateful and (cache is None or isinstance(cache, QuantizedKvCache)):
        raise IncompatibleCache(
            f"the file stores the {header.fmt.value} format, which a QuantizedKvCache does not hold: load it into "
            "the engine's cache of that format (seq_id=) or an Int8KvCache(config, format='int4')")
    if cache is None or isinstance(cache, QuantizedKvCache):
        if header.batch != 1:
            raise IncompatibleCache(f"the file holds a batch of {header.batch}; load it into an Int8KvCache")
        if header.grouped:
            raise IncompatibleCache(
                f"the file holds K/V of {len(header.layouts)} shapes {[la.dims for la in header.layouts]}; a "
                "QuantizedKvCache holds one: load it into a PagedKvCache of these layouts or an Int8KvCache"
            )
        if cache is None:
            return lambda state: _into_new_cache(state, device)
        _check_fits(header, "cache", (cache.layout,))
        if header.seq_len > cache.capacity:
            raise IncompatibleCache(
                f"the file holds {header.seq_len} tokens but the cache's capacity is {cache.capacity}"
            )
        return lambda state: _imported(cache, cache.import_state, state)
    if isinstance(cache, PagedKvCache):
        if header.batch != 1:
            raise IncompatibleCache(f"the file holds a batch of {header.batch}; a paged sequence holds one")
        if seq_id is None:
            raise IncompatibleCache("loading into a PagedKvCache needs seq_id= (the new sequence to create)")
        _check_fits(header, "paged cache", cache.layouts)
        if seq_id in cache.allocator:
            raise IncompatibleCache(f"sequence {seq_id!r} already exists in the paged cache")
        need = cache.allocator.blocks_for_tokens(header.seq_len)
        if need > cache.num_free_blocks:
            raise KvPoolExhausted(f"the state needs {need} block(s), only {cache.num_free_blocks} are free")
        return lambda state: _imported(cache, cache.import_state, seq_id, state)
    hf_cache = int8kv_cache_class()
    if hf_cache is not None and isinstance(cache, hf_cache):
        if cache.format.value != header.fmt.value:  # the 4-bit format is a format object there, not a member
            raise IncompatibleCache(
                f"the file stores {header.fmt.value} but the Int8KvCache holds {cache.format.value}"
            )
        layers = len(cache.layers)
        if layers and layers != header.num_layers:
            raise IncompatibleCache(f"the file holds {header.num_layers} layers but the cache has {layers}")
        # Heads and head_dim of layers already filled are checked by import_state (atomic, nothing changed).
        return lambda state: _imported(cache, cache.import_state, state, device=device)
    raise IncompatibleCache(
        f"cannot load into a {type(cache).__name__}: expected QuantizedKvCache, PagedKvCache, Int8KvCache or None"
    )


def _into_new_cache(state: KvState, device: torch.device | str | None) -> QuantizedKvCache:
    layout = state.layout
    cache = QuantizedKvCache(
        layout.num_layers, state.length, layout.num_kv_heads, layout.head_dim, layout.format, device or "cpu"
    )
    return _imported(cache, cache.import_state, state)


def _imported(cache: Any, import_state: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a cache's import_state; a refusal it makes (the cache unchanged) becomes IncompatibleCache, except a
    full pool, which stays KvPoolExhausted."""
    try:
        import_state(*args, **kwargs)
    except KvPoolExhausted:
        raise
    except KvCacheError as exc:
        raise IncompatibleCache(f"the {type(cache).__name__} refused the state: {exc}") from exc
    return cache
