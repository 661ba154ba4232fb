"""``Int8KvCache`` and ``Int8KvLayer``: transformers' Cache/layer pair over INT8 (or F16) codes.

Storage: each layer is a one-layer :class:`~int8kv.cache.pool.KvPool` in the layout of docs/design.md in
which block ``b`` is batch row ``b`` and the block size is the allocated capacity (grown by reallocation in
chunks). The kernels therefore see ``block_tables = arange(batch)[:, None]`` and ``context_lens = seq_len``
for every row; left padding becomes ``kv_starts`` (see :mod:`int8kv.hf.attention`).

A layer holds no reference to its cache (transformers' own split): what belongs to one forward (the plan
built from the attention mask, the layers written so far for a rollback) lives in that forward's plan.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import codec
from ..cache.pool import KvPool
from ..cache.state import KvLayout, KvState, as_format
from ..errors import PositionOutOfRange, ShapeMismatch, UnsupportedAttention
from ..formats import KvStorageFormat
from ..ops import resolve_backend, write
from .attention import ATTN_IMPLEMENTATION, TAG, enable_int8kv_attention

__all__ = ["Int8KvCache", "Int8KvLayer"]

_DEFAULT_CHUNK = 256


@functools.lru_cache(maxsize=256)
def _slots(batch: int, capacity: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 slots ``[batch * n]`` of positions ``[start, start + n)`` of every row (row ``b`` = block ``b``):
    the same for every layer of a step, so built once (a decode step of 30 layers asks 30 times)."""
    rows = torch.arange(batch, dtype=torch.int64)[:, None] * capacity
    return (rows + torch.arange(start, start + n, dtype=torch.int64)[None, :]).reshape(-1).to(device)


class Int8KvLayer(CacheLayerMixin):
    """One decoder layer's K/V, stored as codes (+ scales) in a one-layer pool (:attr:`pool`).

    ``pool.k_codes[0]``/``pool.v_codes[0]`` are ``[batch, capacity, num_kv_heads, head_dim]`` (int8 or float16),
    ``pool.k_scales[0]``/``pool.v_scales[0]`` ``[batch, capacity, num_kv_heads]`` float32 (None for F16).
    ``keys``/``values`` stay None: there is no float copy to expose (see :meth:`dequantize`).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        chunk_size: int = _DEFAULT_CHUNK,
        max_cache_len: int | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if chunk_size <= 0:
            raise ShapeMismatch(f"chunk_size must be > 0, got {chunk_size}")
        if max_cache_len is not None and max_cache_len <= 0:
            raise ShapeMismatch(f"max_cache_len must be > 0 (or None), got {max_cache_len}")
        self.format = as_format(format)
        self.chunk_size = int(chunk_size)
        self.max_cache_len = max_cache_len
        self.backend = backend
        self.seq_len = 0
        self.attention_calls = 0  # int8kv kernel launches on this layer (counted by int8kv.hf.attention)
        self.pool: KvPool | None = None

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
        self.pool = self._new_pool(batch, heads, dim, self.max_cache_len or self.chunk_size, self.device)
        self.is_initialized = True

    def _new_pool(self, batch: int, heads: int, dim: int, capacity: int, device: torch.device | str) -> KvPool:
        return KvPool(KvLayout(1, heads, dim, self.format), batch, capacity, device)

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions (the stored prefix is kept; the old storage survives a failure)."""
        p = self.pool
        if p is None:
            raise ShapeMismatch("the layer holds no storage yet")
        if needed <= p.block_size:
            return
        # Grow by a quarter at least, so a long generation reallocates O(log n) times, not once per chunk.
        self.pool = p.resized(self._round_up(max(needed, p.block_size + p.block_size // 4)), self.seq_len)


    def storage_from(
        self, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None
    ) -> KvPool:
        """A pool holding ``[batch, length, heads, dim]`` codes (and ``[batch, length, heads]`` scales) with room
        to grow, on the tensors' device; the layer is unchanged until :meth:`adopt`."""
        batch, n, heads, dim = (int(d) for d in k.shape)
        pool = self._new_pool(batch, heads, dim, self._round_up(max(n, 1)), k.device)
        kc, vc, kss, vss = pool.layer_tensors(0)
        kc[:, :n] = k
        vc[:, :n] = v
        if ks is not None and vs is not None and kss is not None and vss is not None:
            kss[:, :n] = ks
            vss[:, :n] = vs
        return pool

    def adopt(self, pool: KvPool, length: int) -> None:
        """Take ``pool`` (from :meth:`storage_from`) holding ``length`` positions as this layer's storage."""
        self.pool = pool
        self.device = pool.device
        if not self.is_initialized:
            self.dtype = torch.float32
        self.seq_len = length
        self.is_initialized = True

    # -- writing ---------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[batch, kv_heads, tokens, head_dim]`` keys and values after the stored ones, through the write
        path (checks, one encode for K and V); returns tagged empty handles for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.pool
        assert p is not None
        expected = (p.num_blocks, p.num_kv_heads, p.head_dim)
        for name, t in (("keys", key_states), ("values", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeMismatch(
                    f"{name} must be [{expected[0]}, {expected[1]}, tokens, {expected[2]}] for this cache, got {got}"
                )
        n = int(key_states.shape[2])
        if value_states.shape[2] != n:
            raise ShapeMismatch(f"keys hold {n} tokens but values {value_states.shape[2]}")
        start = self.seq_len
        self.reserve(start + n)
        p = self.pool
        # [batch, heads, n, dim] -> rows [batch * n, heads, dim] in slot order (row b's block, positions start..).
        k = key_states.transpose(1, 2).reshape(-1, p.num_kv_heads, p.head_dim)
        v = value_states.transpose(1, 2).reshape(-1, p.num_kv_heads, p.head_dim)
        slots = _slots(p.num_blocks, p.block_size, start, n, p.device)
        # Raises (NonFiniteError, device, shape) before anything is stored: the layer stays as it was.
        write.append_rows(p, 0, k, v, slots, backend=resolve_backend(p, self.backend))
        self.seq_len = start + n
        return self._handle(key_states), self._handle(value_states)

    def _handle(self, like: torch.Tensor) -> torch.Tensor:
        # An empty tensor: if a model ever routes it to another attention function, that one sees zero keys and
        # fails loudly instead of silently attending to something wrong.
        handle = like.new_empty((like.shape[0], like.shape[1], 0, like.shape[3]))
        setattr(handle, TAG, self)
        return handle

    # -- reading ---------------------------------------------------------------------------------------
    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Views of the stored positions: codes ``[batch, seq_len, heads, dim]``, scales ``[batch, seq_len, heads]``."""
        if self.pool is None:
            raise PositionOutOfRange("the layer holds no tokens yet")
        n = self.seq_len
        return tuple(None if t is None else t[:, :n] for t in self.pool.layer_tensors(0))  # type: ignore[return-value]

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``[batch, kv_heads, seq_len, head_dim]`` copies of K and V, for inspection and tests only."""
        kc, vc, ks, vs = self.stored()
        k = codec.decode(self.format, kc, ks)
        v = codec.decode(self.format, vc, vs)
        return k.transpose(1, 2), v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    # -- editing ---------------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.seq_len:
            raise PositionOutOfRange(f"cannot truncate to {n!r}: stored length is {self.seq_len}")
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
        index = index.to(device=p.device, dtype=torch.long)
        if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= p.num_blocks)):
            raise ShapeMismatch(f"batch indices must be a 1-D tensor in [0, {p.num_blocks}), got {index.tolist()}")
        # Copies: a row picked twice (beam search) gives two independent rows.
        self.pool = p.select_blocks(index)

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
        return p.num_blocks * self.seq_len * p.layout.bytes_per_token

    def allocated_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.memory_bytes()


class Int8KvCache(Cache):
    """A ``transformers.Cache`` holding K/V as INT8 codes + float32 scales per (token, KV head) (format V1),
    or as float16 (``format=KvStorageFormat.F16``), read directly by the ``"int8kv"`` attention function.

    Args:
        config: the model's config. It sizes the cache (one layer per decoder layer) and, unless
            ``attach=False``, switches ``config._attn_implementation`` to ``"int8kv"`` (see int8kv.hf).
            Without a config, layers are created on first use and attention must be enabled by hand.
        format: a :class:`KvStorageFormat` or its name / a dtype alias (``"int8"``, ``"f16"``).
        chunk_size: allocation granularity in tokens.
        max_cache_len: tokens to reserve up front (avoids reallocation when the final length is known).
        backend: forwarded to the :mod:`int8kv.ops` dispatcher (None: chosen from the device).
        attach: whether to switch the config's attention implementation.

    ``crop(-k)`` drops the last ``k`` tokens and ``crop(n > 0)`` keeps the first ``n``. Beam search works
    through ``reorder_cache``. If encoding a step raises (``NonFiniteError`` on NaN/inf), or the attention
    rejects the step, every layer is rolled back to where the step began before the error propagates.
    Works with autograd on: keys and values are detached on the way in (a KV cache stores values, not graphs).
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
        self.format = as_format(format)
        self.backend = backend
        make_layer = functools.partial(
            Int8KvLayer, self.format, chunk_size=chunk_size, max_cache_len=max_cache_len, backend=backend
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

    @property
    def attention_calls(self) -> int:
        """int8kv kernel launches over all layers, for checking the kernels really serve the model."""
        return sum(getattr(layer, "attention_calls", 0) for layer in self.layers)

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
            # A KV cache stores values, not graphs: with autograd on, the keys carry a grad_fn.
            return super().update(key_states.detach(), value_states.detach(), layer_idx, *args, **kwargs)
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
        ((_, heads, dim),) = shapes
        layout = KvLayout(len(layers), heads, dim, self.format)
        stored = [la.stored() for la in layers]

        def group(i: int) -> list[torch.Tensor] | None:
            return None if stored[0][i] is None else [s[i] for s in stored]

        return KvState.build(layout, group(0), group(1), group(2), group(3))

    def import_state(self, state: KvState, device: torch.device | str | None = None) -> None:
        """Replace every layer's contents with ``state`` (creating the layers if the cache has none yet).
        Atomic: every new storage is allocated and filled before the first layer changes, so an error
        (a bad state, or running out of memory part-way) leaves every layer as it was."""
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
        pools = []
        for i, la in enumerate(layers):
            dev = torch.device(device) if device is not None else (la.device if la.is_initialized else "cpu")
            parts = [None if g is None else g[i].to(dev) for g in (state.k_codes, state.v_codes, state.k_scales,
                                                                   state.v_scales)]  # fmt: skip
            pools.append(la.storage_from(*parts))
        # Every pool exists: adopting them allocates nothing and cannot fail part-way.
        for la, pool in zip(layers, pools, strict=True):
            la.adopt(pool, state.length)
        if created:
            self.layers.extend(layers)

    def memory_bytes(self) -> int:
        """Bytes of the stored tokens across layers (codes + scales, K and V, padding rows included)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes actually allocated (capacity is grown in chunks, so this is >= memory_bytes())."""
        return sum(layer.allocated_bytes() for layer in self.layers)
