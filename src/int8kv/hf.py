"""transformers drop-in: an INT8 (or F16) KV cache and the attention function that reads it.

    cache = Int8KvCache(model.config)                  # V1 INT8 storage; F16 with format=KvStorageFormat.F16
    out = model.generate(**inputs, cache=cache)       # ``past_key_values=`` works too (deprecated in 5.x)

How it fits into transformers 5.x
---------------------------------
A decoder layer calls ``cache.update(k, v, layer_idx)`` and passes whatever comes back, untouched, to
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. ``Int8KvCache.update`` encodes the new rows into
its own storage and returns two *empty* tensors tagged with the layer object. The attention function
registered here as ``"int8kv"`` recognises the tag and runs the paged kernels of :mod:`int8kv.ops` on the
stored codes, so no dequantized copy of the context is ever built. Untagged keys (any other cache, or no
cache) are handed to transformers' own SDPA attention, which makes the switch harmless for other caches.

Why the constructor switches ``config._attn_implementation``: transformers reads the attention
implementation from the model's config object at every forward, and ``Int8KvCache(model.config)`` receives
that very object, so setting it there is the one hook that makes ``generate(..., cache=Int8KvCache(cfg))``
work without a second call. Pass ``attach=False`` to leave the config alone and call
:func:`enable_int8kv_attention` yourself. The mask function registered for ``"int8kv"`` is SDPA's, so the
masks transformers builds stay valid for the SDPA fallback.

Storage
-------
Each layer is a paged pool in the layout of docs/design.md in which batch row ``b`` owns block ``b`` and
the block size is the allocated capacity (grown by reallocation in chunks). The kernels therefore see
``block_tables = arange(batch)[:, None]``, ``context_lens = seq_len`` for every row and left padding as
``kv_starts`` taken from the attention mask.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError("int8kv.hf needs transformers>=5: pip install 'int8kv[hf]'") from exc

from . import codec, ops
from .cache.paged import PagedKvCache
from .cache.state import KvLayout, KvState
from .errors import PositionOutOfRange, ShapeMismatch, UnsupportedAttention
from .formats import KvStorageFormat

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Int8KvCache",
    "Int8KvLayer",
    "UnsupportedAttention",
    "disable_int8kv_attention",
    "enable_int8kv_attention",
    "int8kv_attention_forward",
]

ATTN_IMPLEMENTATION = "int8kv"
_TAG = "_int8kv_layer"  # attribute carried by the tensors update() returns
_DEFAULT_CHUNK = 256


def _parse_format(fmt: KvStorageFormat | str) -> KvStorageFormat:
    if isinstance(fmt, KvStorageFormat):
        return fmt
    try:
        return KvStorageFormat.parse(str(fmt))
    except ValueError:
        return KvStorageFormat.from_dtype(str(fmt))


class _LayerPool(PagedKvCache):
    """A one-layer :class:`PagedKvCache` over tensors owned by an :class:`Int8KvLayer`: block ``b`` is batch row
    ``b`` and the block size is the layer's capacity. It exists so the ops backends, written for paged pools,
    serve this cache unchanged (their argument checks are PagedKvCache methods)."""

    def __init__(
        self, fmt: KvStorageFormat, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None
    ) -> None:
        # PagedKvCache.__init__ is not called on purpose: it would allocate a pool and an allocator of its own.
        self.format = fmt
        self.num_layers = 1
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = (int(d) for d in k.shape)
        self.device = k.device
        self.allocator = None
        self.k_codes: list[torch.Tensor] = [k]
        self.v_codes: list[torch.Tensor] = [v]
        self.k_scales: list[torch.Tensor | None] = [ks]
        self.v_scales: list[torch.Tensor | None] = [vs]


# ---------------------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------------------
class Int8KvLayer(CacheLayerMixin):
    """One decoder layer's K/V, stored as codes (+ scales) in a one-layer paged pool (:attr:`pool`).

    ``pool.k_codes[0]``/``pool.v_codes[0]`` are ``[batch, capacity, num_kv_heads, head_dim]`` (int8 or float16),
    ``pool.k_scales[0]``/``pool.v_scales[0]`` ``[batch, capacity, num_kv_heads]`` float32 (None for F16).
    ``keys``/``values`` stay None: there is no float copy to expose (see :meth:`dequantize`).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        chunk_size: int = _DEFAULT_CHUNK,
        max_cache_len: int | None = None,
        owner: Int8KvCache | None = None,
    ) -> None:
        super().__init__()
        if chunk_size <= 0:
            raise ShapeMismatch(f"chunk_size must be > 0, got {chunk_size}")
        if max_cache_len is not None and max_cache_len <= 0:
            raise ShapeMismatch(f"max_cache_len must be > 0 (or None), got {max_cache_len}")
        self.format = _parse_format(format)
        self.chunk_size = int(chunk_size)
        self.max_cache_len = max_cache_len
        self.owner = owner
        self.seq_len = 0
        self.pool: _LayerPool | None = None

    def __repr__(self) -> str:
        if self.pool is None:
            return f"Int8KvLayer(format={self.format}, empty)"
        p = self.pool
        return (
            f"Int8KvLayer(format={self.format}, batch={p.num_blocks}, seq_len={self.seq_len}, "
            f"capacity={p.block_size}, num_kv_heads={p.num_kv_heads}, head_dim={p.head_dim})"
        )

    @property
    def batch_size(self) -> int:
        return self.pool.num_blocks if self.pool is not None else 0

    @property
    def capacity(self) -> int:
        return self.pool.block_size if self.pool is not None else 0

    # -- allocation ------------------------------------------------------------------------------------
    def _round_up(self, n: int) -> int:
        return -(-n // self.chunk_size) * self.chunk_size

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or tuple(key_states.shape) != tuple(value_states.shape):
            raise ShapeMismatch(
                f"keys and values must both be [batch, kv_heads, tokens, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        batch, heads, _, dim = (int(d) for d in key_states.shape)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.seq_len = 0
        # A known final length is reserved exactly; otherwise start with one chunk.
        self._allocate(batch, heads, dim, self.max_cache_len or self.chunk_size)
        self.is_initialized = True

    def _allocate(self, batch: int, heads: int, dim: int, capacity: int) -> None:
        """(Re)allocate to ``capacity`` tokens, keeping the stored prefix; old storage survives a failure."""
        shape = (batch, capacity, heads, dim)
        # Zero-filled rather than empty: a kernel that multiplies masked lanes by 0 must not meet NaN garbage.
        k = torch.zeros(shape, dtype=self.format.code_dtype, device=self.device)
        v = torch.zeros_like(k)
        ks = vs = None
        if self.format.is_quantized:
            ks = torch.ones(shape[:3], dtype=torch.float32, device=self.device)
            vs = torch.ones_like(ks)
        n, old = self.seq_len, self.pool
        if n and old is not None:
            for dst, src in ((k, old.k_codes[0]), (v, old.v_codes[0]), (ks, old.k_scales[0]), (vs, old.v_scales[0])):
                if dst is not None and src is not None:
                    dst[:, :n] = src[:, :n]
        self.pool = _LayerPool(self.format, k, v, ks, vs)

    def set_storage(
        self, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None, length: int
    ) -> None:
        """Take ``[batch, length, heads, dim]`` codes (and ``[batch, length, heads]`` scales) as the layer's
        contents, with room to grow; the tensors' device becomes the layer's."""
        batch, n, heads, dim = (int(d) for d in k.shape)
        self.device = k.device
        if not self.is_initialized:
            self.dtype = torch.float32
        self.seq_len = 0
        self._allocate(batch, heads, dim, self._round_up(max(n, 1)))
        p = self.pool
        p.k_codes[0][:, :n] = k
        p.v_codes[0][:, :n] = v
        if ks is not None and vs is not None:
            p.k_scales[0][:, :n] = ks
            p.v_scales[0][:, :n] = vs
        self.seq_len = n
        self.is_initialized = True

    def _ensure_capacity(self, needed: int) -> None:
        p = self.pool
        assert p is not None
        if needed <= p.block_size:
            return
        # Grow by a quarter at least, so a long generation reallocates O(log n) times, not once per chunk.
        capacity = self._round_up(max(needed, p.block_size + p.block_size // 4))
        self._allocate(p.num_blocks, p.num_kv_heads, p.head_dim, capacity)

    # -- writing ---------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.pool
        assert p is not None
        expected = (p.num_blocks, p.num_kv_heads, p.head_dim)
        for name, t in (("keys", key_states), ("values", value_states)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                raise ShapeMismatch(
                    f"{name} must be [{expected[0]}, {expected[1]}, tokens, {expected[2]}] for this cache, "
                    f"got {tuple(t.shape)}"
                )
        if key_states.shape[2] != value_states.shape[2]:
            raise ShapeMismatch(f"keys hold {key_states.shape[2]} tokens but values {value_states.shape[2]}")
        # Encode first: NonFiniteError (or any codec error) leaves this layer untouched.
        k_codes, k_scales = codec.encode(self.format, key_states.transpose(1, 2).to(self.device))
        v_codes, v_scales = codec.encode(self.format, value_states.transpose(1, 2).to(self.device))
        start, end = self.seq_len, self.seq_len + int(key_states.shape[2])
        self._ensure_capacity(end)
        p = self.pool
        p.k_codes[0][:, start:end] = k_codes
        p.v_codes[0][:, start:end] = v_codes
        if self.format.is_quantized:
            p.k_scales[0][:, start:end] = k_scales
            p.v_scales[0][:, start:end] = v_scales
        self.seq_len = end
        return self._handle(key_states), self._handle(value_states)

    def _handle(self, like: torch.Tensor) -> torch.Tensor:
        # An empty tensor: if a model ever routes it to another attention function, that one sees zero keys and
        # fails loudly instead of silently attending to something wrong.
        handle = like.new_empty((like.shape[0], like.shape[1], 0, like.shape[3]))
        setattr(handle, _TAG, self)
        return handle

    # -- reading ---------------------------------------------------------------------------------------
    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``[batch, kv_heads, seq_len, head_dim]`` copies of K and V, for inspection and tests only."""
        p = self.pool
        if p is None:
            raise PositionOutOfRange("the layer holds no tokens yet")
        n = self.seq_len
        ks = None if p.k_scales[0] is None else p.k_scales[0][:, :n]
        vs = None if p.v_scales[0] is None else p.v_scales[0][:, :n]
        k = codec.decode(self.format, p.k_codes[0][:, :n], ks)
        v = codec.decode(self.format, p.v_codes[0][:, :n], vs)
        return k.transpose(1, 2), v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    # -- editing ---------------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.seq_len:
            raise PositionOutOfRange(f"cannot truncate to {n}: stored length is {self.seq_len}")
        self.seq_len = n

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-k)`` drops the last ``k`` tokens (transformers 5 semantics, ``crop(0)`` is a no-op);
        ``crop(n)`` with ``n > 0`` keeps the first ``n`` (the 4.x ``max_length`` form; no-op if ``n >= seq_len``)."""
        if tokens_to_remove > 0:
            self.truncate(min(tokens_to_remove, self.seq_len))
        elif tokens_to_remove < 0:
            if -tokens_to_remove > self.seq_len:
                raise PositionOutOfRange(f"cannot remove {-tokens_to_remove} tokens: only {self.seq_len} stored")
            self.truncate(self.seq_len + tokens_to_remove)

    def reset(self) -> None:
        # Storage is kept for reuse; only the length goes back to zero.
        self.seq_len = 0

    def _select_rows(self, index: torch.Tensor) -> None:
        p = self.pool
        if p is None:
            return
        index = index.to(device=self.device, dtype=torch.long)
        if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= p.num_blocks)):
            raise ShapeMismatch(f"batch indices must be a 1-D tensor in [0, {p.num_blocks}), got {index.tolist()}")

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            # index_select copies, so a row picked twice (beam search) gives two independent rows.
            return None if t is None else t.index_select(0, index)

        self.pool = _LayerPool(
            self.format, pick(p.k_codes[0]), pick(p.v_codes[0]), pick(p.k_scales[0]), pick(p.v_scales[0])
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = torch.nonzero(indices).flatten()
        self._select_rows(indices)

    def offload(self) -> None:  # transformers' offloading moves .keys/.values, which this layer does not have
        raise UnsupportedAttention("Int8KvCache does not support offloading")

    prefetch = offload

    # -- accounting ------------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of the stored tokens (every batch row, padding included), codes and scales, K and V."""
        p = self.pool
        if p is None:
            return 0
        return p.num_blocks * self.seq_len * 2 * p.num_kv_heads * self.format.bytes_per_row(p.head_dim)

    def allocated_bytes(self) -> int:
        p = self.pool
        if p is None:
            return 0
        tensors = p.k_codes + p.v_codes + p.k_scales + p.v_scales
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- attention -------------------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        """Causal attention of ``query [batch, q_heads, n, head_dim]`` (the last ``n`` stored positions) over
        the stored codes. Returns ``[batch, n, q_heads, head_dim]`` in the query's dtype (rows of queries that
        sit on padding are zeros)."""
        p = self.pool
        batch, q_heads, n, dim = query.shape
        if p is None or batch != p.num_blocks or dim != p.head_dim:
            raise ShapeMismatch(f"query {tuple(query.shape)} does not fit the cache ({self!r})")
        if n > self.seq_len:
            raise ShapeMismatch(f"{n} queries but only {self.seq_len} positions stored")
        length = self.seq_len
        kv_starts, valid = _padding_from_mask(attention_mask, batch, n, length, self.owner)
        block_tables, context_lens = _batch_tables(batch, length, p.device)
        if kv_starts is not None:
            kv_starts = kv_starts.to(p.device)
        q = query.transpose(1, 2).to(torch.float32)  # [batch, n, q_heads, dim]
        backend = self.owner.backend if self.owner is not None else None
        if n == 1:
            out = ops.paged_decode_attention(
                p, 0, q[:, 0].contiguous(), block_tables, context_lens, scaling, kv_starts, backend=backend
            )
            out = out.unsqueeze(1)
        else:
            # Queries on left padding are left out of the packed batch: the kernels define the n_b queries of a
            # sequence as its last n_b positions, which are exactly the non-padding ones.
            if valid is None:
                packed = q.reshape(batch * n, q_heads, dim)
                cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=q.device)
            else:
                valid = valid.to(q.device)
                packed = q[valid]
                cu = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
                cu[1:] = torch.cumsum(valid.sum(dim=1), 0)
            res = ops.paged_prefill_attention(
                p, 0, packed, cu, block_tables, context_lens, scaling, kv_starts, backend=backend
            )
            if valid is None:
                out = res.reshape(batch, n, q_heads, dim)
            else:
                out = res.new_zeros((batch, n, q_heads, dim))
                out[valid] = res
        if self.owner is not None:
            self.owner.attention_calls += 1
        return out.to(query.dtype)


@functools.lru_cache(maxsize=64)
def _batch_tables_cached(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    block_tables = torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)
    context_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return block_tables, context_lens


def _batch_tables(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch_tables_cached(batch, length, torch.device(device))


def _padding_from_mask(
    mask: torch.Tensor | None, batch: int, n: int, length: int, owner: Int8KvCache | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(kv_starts [batch] int32, valid_queries [batch, n] bool)`` from transformers' 4-D mask, or
    ``(None, None)`` for no mask. Every layer of one forward sees the same mask object, so the result is
    memoised on the cache for that object."""
    if mask is None:
        return None, None
    memo = owner._mask_memo if owner is not None else None
    if memo is not None and memo[0] is mask and memo[1] == (batch, n, length):
        return memo[2], memo[3]
    result = _derive_padding(mask, batch, n, length)
    if owner is not None:
        # Holding the mask keeps its id from being reused by another tensor while the memo refers to it.
        owner._mask_memo = (mask, (batch, n, length), *result)
    return result


def _derive_padding(mask: torch.Tensor, batch: int, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise UnsupportedAttention(
            f"the int8kv attention needs a 4-D attention mask (or none), got {type(mask).__name__}"
            + (f" of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else "")
        )
    if mask.shape[0] not in (1, batch) or mask.shape[-2] != n or mask.shape[-1] != length:
        raise ShapeMismatch(
            f"attention mask {tuple(mask.shape)} does not fit batch {batch}, {n} queries and {length} keys"
        )
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        # Additive float mask: 0 where allowed, a huge negative where masked; anything else is a bias
        # the kernels cannot apply.
        allowed = mask > torch.finfo(mask.dtype).min / 2
        if bool((mask[allowed] != 0).any()):
            raise UnsupportedAttention("the int8kv attention cannot apply an additive attention bias")
    allowed = allowed.expand(batch, -1, -1, -1)
    last = allowed[:, 0, -1, :]  # what the newest query may see: every non-padding key
    any_key = last.any(dim=1)
    first = torch.where(any_key, last.int().argmax(dim=1), torch.full_like(any_key, length, dtype=torch.long))
    # Check that the mask is exactly "causal from kv_start", the only pattern the kernels implement; this also
    # rejects padding with holes, sliding windows and bidirectional masks instead of silently ignoring them.
    key_pos = torch.arange(length, device=mask.device)
    query_pos = torch.arange(length - n, length, device=mask.device)
    expected = (key_pos[None, None, :] >= first[:, None, None]) & (key_pos[None, None, :] <= query_pos[None, :, None])
    if not bool((allowed == expected[:, None]).all()):
        raise UnsupportedAttention(
            "the int8kv attention supports causal masks with left padding only (no holes, windows or custom patterns)"
        )
    valid = query_pos[None, :] >= first[:, None]
    return first.to(torch.int32), valid


# ---------------------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------------------
class Int8KvCache(Cache):
    """A ``transformers.Cache`` holding K/V as INT8 codes + float32 scales per (token, KV head) (format V1),
    or as float16 (``format=KvStorageFormat.F16``), read directly by the ``"int8kv"`` attention function.

    Args:
        config: the model's config. It sizes the cache (one layer per decoder layer) and, unless
            ``attach=False``, switches ``config._attn_implementation`` to ``"int8kv"`` (see module docs).
            Without a config, layers are created on first use and attention must be enabled by hand.
        format: a :class:`KvStorageFormat` or its name / a dtype alias (``"int8"``, ``"f16"``).
        chunk_size: allocation granularity in tokens.
        max_cache_len: tokens to reserve up front (avoids reallocation when the final length is known).
        backend: forwarded to the :mod:`int8kv.ops` dispatcher (None: chosen from the device).
        attach: whether to switch the config's attention implementation.

    ``crop(-k)`` drops the last ``k`` tokens and ``crop(n > 0)`` keeps the first ``n``. Beam search works
    through ``reorder_cache``. If encoding a step raises (``NonFiniteError`` on NaN/inf), or the attention
    rejects the step, every layer is rolled back to where the step began before the error propagates.
    """

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        *,
        chunk_size: int = _DEFAULT_CHUNK,
        max_cache_len: int | None = None,
        backend: str | None = None,
        attach: bool = True,
    ) -> None:
        self.format = _parse_format(format)
        self.backend = backend
        self.attention_calls = 0  # int8kv kernel launches, for checking the kernels really serve the model
        self._mask_memo: tuple[Any, ...] | None = None
        make_layer = functools.partial(
            Int8KvLayer, self.format, chunk_size=chunk_size, max_cache_len=max_cache_len, owner=self
        )
        self._text_config: PreTrainedConfig | None = None
        if config is None:
            super().__init__(layer_class_to_replicate=make_layer)
            return
        text_config = self._text_config = config.get_text_config(decoder=True)
        num_layers = int(text_config.num_hidden_layers)
        layer_types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers)
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedAttention(
                f"Int8KvCache stores full-attention layers only; this model also has {other} layers"
            )
        super().__init__(layers=[make_layer() for _ in range(num_layers)])
        if attach:
            enable_int8kv_attention(config)

    def __repr__(self) -> str:
        return (
            f"Int8KvCache(format={self.format}, layers={len(self.layers)}, seq_len={self.get_seq_length()}, "
            f"memory_bytes={self.memory_bytes()})"
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = self._text_config
        if config is not None and config._attn_implementation != ATTN_IMPLEMENTATION:
            # Any other attention function would read the empty handles update() returns as zero keys.
            raise UnsupportedAttention(
                f"the model attends with {config._attn_implementation!r}; Int8KvCache needs the int8kv attention: "
                "call int8kv.hf.enable_int8kv_attention(model) (or construct the cache with attach=True)"
            )
        start = self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except Exception:
            self.rollback_to(start)
            raise

    def rollback_to(self, length: int) -> None:
        """Truncate every layer holding more than ``length`` tokens to ``length`` (undo a partial step)."""
        for layer in self.layers:
            if layer.get_seq_length() > length:
                layer.truncate(length)

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n)

    # -- state (see int8kv/cache/state.py) ----------------------------------------------------------------
    def export_state(self) -> KvState:
        """Every layer's stored tokens (all batch rows) as a :class:`KvState` (CPU copies)."""
        layers = list(self.layers)
        if not layers or not all(isinstance(la, Int8KvLayer) and la.is_initialized for la in layers):
            raise ShapeMismatch("the Int8KvCache holds nothing yet: run the prompt through the model first")
        lengths = {la.seq_len for la in layers}
        shapes = {(la.pool.num_blocks, la.pool.num_kv_heads, la.pool.head_dim) for la in layers}
        if len(lengths) != 1 or len(shapes) != 1:
            raise ShapeMismatch(f"the layers disagree (lengths {sorted(lengths)}, batch/heads/dim {sorted(shapes)})")
        (n,), ((_, heads, dim),) = lengths, shapes
        layout = KvLayout(len(layers), heads, dim, self.format)

        def group(which: str) -> list[torch.Tensor] | None:
            tensors = [getattr(la.pool, which)[0] for la in layers]
            return None if tensors[0] is None else [t[:, :n] for t in tensors]

        return KvState.build(layout, group("k_codes"), group("v_codes"), group("k_scales"), group("v_scales"))

    def import_state(self, state: KvState, device: torch.device | str | None = None) -> None:
        """Replace every layer's contents with ``state`` (creating the layers if the cache has none yet).
        Atomic: on any error every layer is as it was."""
        if not isinstance(state, KvState):
            raise ShapeMismatch(f"expected a KvState, got {type(state).__name__}")
        if state.format != self.format:
            raise ShapeMismatch(f"the state stores {state.format.value} but the cache holds {self.format.value}")
        created = not self.layers
        if created and getattr(self, "layer_class_to_replicate", None) is None:
            raise ShapeMismatch("the Int8KvCache has no layers and cannot create any")
        layers = [self.layer_class_to_replicate() for _ in range(state.layout.num_layers)] if created else list(
            self.layers
        )
        if len(layers) != state.layout.num_layers:
            raise ShapeMismatch(f"the state holds {state.layout.num_layers} layers but the cache has {len(layers)}")
        for i, la in enumerate(layers):
            if not isinstance(la, Int8KvLayer) or la.format != state.format:
                raise ShapeMismatch(f"layer {i} is not an Int8KvLayer of format {state.format.value}")
            if la.is_initialized and (la.pool.num_kv_heads, la.pool.head_dim) != (
                state.layout.num_kv_heads, state.layout.head_dim
            ):
                raise ShapeMismatch(
                    f"the state holds {state.layout.num_kv_heads} kv heads of {state.layout.head_dim} but layer {i} "
                    f"holds {la.pool.num_kv_heads} of {la.pool.head_dim}"
                )
        new = []
        for i, la in enumerate(layers):
            dev = torch.device(device) if device is not None else (la.device if la.is_initialized else "cpu")
            new.append(
                [None if g is None else g[i].to(dev) for g in (state.k_codes, state.v_codes, state.k_scales,
                                                                 state.v_scales)]
            )
        # Everything is on its device: the assignment below cannot fail part-way for a checkable reason.
        for la, (k, v, ks, vs) in zip(layers, new, strict=True):
            la.set_storage(k, v, ks, vs, state.length)
        if created:
            self.layers.extend(layers)

    def memory_bytes(self) -> int:
        """Bytes of the stored tokens across layers (codes + scales, K and V, padding rows included)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes actually allocated (capacity is grown in chunks, so this is >= memory_bytes())."""
        return sum(layer.allocated_bytes() for layer in self.layers)


# ---------------------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------------------
def int8kv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: INT8/F16 kernels for :class:`Int8KvCache` keys, SDPA for the rest."""
    layer = getattr(key, _TAG, None)
    if layer is None:
        if key.shape[-2] == 0 and query.shape[-2] > 0:
            raise UnsupportedAttention(
                "the attention received an empty key tensor without an Int8KvCache tag: this model transforms the "
                "keys between cache.update() and attention, which Int8KvCache does not support"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    owner = layer.owner
    start = layer.seq_len - query.shape[-2]
    try:
        _check_supported(module, dropout, kwargs)
        return layer.attend(query, attention_mask, scaling), None
    except Exception:
        if owner is not None:
            owner.rollback_to(max(start, 0))
        raise


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout and module.training:
        raise UnsupportedAttention("attention dropout is not supported with Int8KvCache (use eval mode)")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"the int8kv attention does not implement {name}")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttention("the int8kv attention is causal only")


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, int8kv_attention_forward)
    # SDPA's boolean masks: kv_starts are read from them, and the SDPA fallback can use them unchanged.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


_register()


def _config_of(model_or_config: Any) -> PreTrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config


def enable_int8kv_attention(model_or_config: Any) -> None:
    """Route the model's attention through ``"int8kv"`` (Int8KvCache keys: int8kv kernels; others: SDPA)."""
    # The property setter propagates to sub-configs (multimodal models), which own their attention modules.
    _config_of(model_or_config)._attn_implementation = ATTN_IMPLEMENTATION


def disable_int8kv_attention(model_or_config: Any, implementation: str = "sdpa") -> None:
    """Switch the model back to ``implementation`` (the int8kv function already delegates to SDPA for other
    caches, so this is only needed for e.g. eager attention with ``output_attentions``)."""
    _config_of(model_or_config)._attn_implementation = implementation
