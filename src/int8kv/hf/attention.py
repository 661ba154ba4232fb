"""The ``"int8kv"`` attention function for transformers: plans shared per forward, the paged kernels per layer.

A forward through an N-layer model calls this function once per attention layer, with one mask object per
attention pattern (full, sliding, chunked). The first call for a (mask, pattern, sizes) derives what the
kernels need from the mask (left padding as ``kv_starts``, which queries are padding), checks that the mask is
exactly the pattern the kernels will apply (causal, window, chunk, left padding) and plans once; the other
layers of that pattern reuse the plan. What one forward shares lives in a :class:`Forward`, owned by the
cache's :class:`Book` (one per :class:`~int8kv.hf.cache.Int8KvCache`): the plans, and which layers it wrote
from which length, so an error in any layer rolls every one of them back.

Never silently wrong: ``Int8KvLayer.update`` returns :class:`KvHandle` tensors, empty and tagged with the
layer, whose ``__torch_function__`` refuses every operation but metadata (shape, dtype, device): a model that
reshapes, casts or multiplies the K/V it got back from the cache (its own attention, or a change made after
``cache.update``) fails with :class:`~int8kv.errors.AttentionBypassed` instead of computing on empty tensors.
A layer written but not read by this function before the next layer is written (or the next forward starts)
fails the same way.

No side effects: attaching (``Int8KvCache(model.config)``) records each config's own attention
implementation; other caches passed to the same model go to that implementation with its own mask function
(SDPA for implementations whose masks the int8kv path cannot read: flash, flex). Any refusal
(:class:`~int8kv.errors.UnsupportedAttention`) puts every config back as it was before it propagates.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .. import ops
from ..errors import AttentionBypassed, UnsupportedAttention
from ..ops.plan import AttentionPlan, plan_attention
from .layers import AttentionOptions, attention_options, prepared_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Book",
    "Forward",
    "KvHandle",
    "TAG",
    "attach",
    "detach",
    "disable_int8kv_attention",
    "enable_int8kv_attention",
    "int8kv_attention_forward",
    "original_implementation",
]

ATTN_IMPLEMENTATION = "int8kv"
TAG = "_int8kv_layer"  # attribute carried by the (empty) handles Int8KvLayer.update returns
# Implementations whose masks the int8kv path reads (boolean SDPA masks, additive eager masks); a model that
# attends with another one (flash, flex) gets SDPA's mask and SDPA for its other caches.
_READABLE = ("sdpa", "eager")


# ---------------------------------------------------------------------------------------------------------
# handles
# ---------------------------------------------------------------------------------------------------------
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__repr__, torch.Tensor.__format__,
    torch.Tensor.__len__,
}  # fmt: skip


class KvHandle(torch.Tensor):
    """The empty ``[batch, kv_heads, 0, head_dim]`` tensor ``Int8KvLayer.update`` returns for keys or values.

    Only the int8kv attention function reads it (its tag); any other operation but metadata raises
    :class:`AttentionBypassed` (and rolls the forward back), because whatever it computed would be computed on
    zero keys instead of the stored ones."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        handle = next((a for a in args if isinstance(a, KvHandle)), None)
        layer = getattr(handle, TAG, None)
        name = getattr(func, "__name__", repr(func))
        error = AttentionBypassed(
            f"the model ran {name!r} on the K/V handle Int8KvCache.update returned"
            + (f" (layer {layer.layer_idx})" if layer is not None else "")
            + ": it computes attention itself or changes K/V after cache.update, which Int8KvCache cannot serve"
        )
        if layer is not None and layer.book is not None:
            layer.book.abort(error)
        raise error


def make_handle(like: torch.Tensor, layer: Any) -> KvHandle:
    with torch._C.DisableTorchFunctionSubclass():
        empty = like.new_empty((like.shape[0], like.shape[1], 0, like.shape[3]))
    handle = torch.Tensor._make_subclass(KvHandle, empty)
    setattr(handle, TAG, layer)
    return handle


# ---------------------------------------------------------------------------------------------------------
# attaching to a config (and putting it back)
# ---------------------------------------------------------------------------------------------------------
_ORIGINAL: dict[int, tuple[weakref.ref, str]] = {}  # id(config) -> (config, its implementation before int8kv)


def _config_of(model_or_config: Any) -> PreTrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config


def _config_tree(config: PreTrainedConfig) -> list[PreTrainedConfig]:
    out, todo = [], [config]
    while todo:
        c = todo.pop(0)
        if any(c is o for o in out):
            continue
        out.append(c)
        subs = (getattr(c, key, None) for key in getattr(c, "sub_configs", {}))
        todo.extend(s for s in subs if isinstance(s, PreTrainedConfig))
    return out


def original_implementation(config: Any) -> str:
    """The attention implementation ``config`` had before int8kv was attached ("sdpa" when unknown)."""
    entry = _ORIGINAL.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) and impl != ATTN_IMPLEMENTATION else "sdpa"


def attach(model_or_config: Any) -> list[tuple[PreTrainedConfig, str | None]]:
    """Switch ``model_or_config`` (and its sub-configs) to ``"int8kv"``, remembering each one's implementation;
    returns ``(config, previous implementation)`` for :func:`detach`."""
    configs = _config_tree(_config_of(model_or_config))
    before = [(c, c._attn_implementation) for c in configs]
    for c, impl in before:
        if impl != ATTN_IMPLEMENTATION:
            _ORIGINAL[id(c)] = (weakref.ref(c), impl if isinstance(impl, str) else "sdpa")
    for c in configs:
        c._attn_implementation_internal = ATTN_IMPLEMENTATION
    return before


def detach(before: list[tuple[PreTrainedConfig, str | None]]) -> None:
    """Put every config :func:`attach` switched back to the implementation it had."""
    for c, impl in before:
        c._attn_implementation_internal = impl


def enable_int8kv_attention(model_or_config: Any) -> None:
    """Route the model's attention through ``"int8kv"`` (Int8KvCache keys: int8kv kernels; others: the
    model's own implementation)."""
    attach(model_or_config)


def disable_int8kv_attention(model_or_config: Any, implementation: str | None = None) -> None:
    """Switch the model back to ``implementation`` (default: what it had before int8kv was enabled)."""
    for c in _config_tree(_config_of(model_or_config)):
        c._attn_implementation_internal = implementation or original_implementation(c)


def _fallback_name(config: Any) -> str:
    impl = original_implementation(config)
    return impl if impl in _READABLE else "sdpa"


_EAGER: dict[type, Any] = {}  # attention module class -> its modeling file's eager function


def _fallback(module: torch.nn.Module) -> Any:
    """The attention function a call without Int8KvCache keys goes to: the module's own implementation's.
    "eager" is not in transformers' registry: each modeling file passes its own eager function (softcap, sinks,
    dropout as that model does them) as the default of ``ALL_ATTENTION_FUNCTIONS.get_interface``, so it is the
    global named ``*eager_attention_forward`` that the module's forward refers to (in transformers 5.24, 455 of the
    460 ``get_interface`` calls of the modeling files pass ``eager_attention_forward``, the rest a ``simple_``,
    ``text_`` or ``vision_`` one)."""
    name = _fallback_name(getattr(module, "config", None))
    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name]
    cls = type(module)
    if cls not in _EAGER:
        forward = inspect.unwrap(cls.forward)
        names = [n for n in forward.__code__.co_names if n.endswith("eager_attention_forward")]
        found = [forward.__globals__.get(n) for n in dict.fromkeys(names)]
        if len(found) != 1 or not callable(found[0]):
            raise UnsupportedAttention(
                f"{cls.__name__} attends with transformers' eager implementation, but its forward names "
                f"{len(found)} eager attention functions ({', '.join(names) or 'none'}), so int8kv cannot tell "
                "which one to give a cache other than Int8KvCache: load the model with attn_implementation='sdpa'"
            )
        _EAGER[cls] = found[0]
    return _EAGER[cls]


def int8kv_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The mask function registered for ``"int8kv"``: the one of the model's own implementation (SDPA's
    boolean masks, eager's additive ones), so other caches get exactly the masks they always got."""
    return ALL_MASK_ATTENTION_FUNCTIONS[_fallback_name(config)](*args, config=config, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# one forward
# ---------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class SharedPlan:
    """A plan every layer of one pattern in one forward shares, and which queries are padding."""

    plan: AttentionPlan
    valid: torch.Tensor | None  # [batch, n] bool: queries that are not padding (None: all are)
    mask: Any  # held, so its identity cannot be reused by another tensor while the plan refers to it
    # (q heads, softcap, backend) -> the plan's attention prepared for the layers that share them
    calls: dict[tuple, ops.PreparedAttention] = field(default_factory=dict)


@dataclass(eq=False)
class Forward:
    """One forward in progress: the layers written (and their length before it), the shared plans."""

    # layer index -> (layer, length before), in the order written (a layer written again starts a new forward)
    starts: dict[int, tuple[Any, int]] = field(default_factory=dict)
    plans: dict[tuple, SharedPlan] = field(default_factory=dict)
    state_written: bool = False  # a transformers state layer (linear attention, conv) changed: no rollback


class Book:
    """What an :class:`~int8kv.hf.cache.Int8KvCache` knows across layers: the forward in progress and the
    configs it attached to (put back on a refusal). Its layers refer to it; it refers to no layer outside
    the forward in progress."""

    def __init__(self, strict: bool = True) -> None:
        # strict: a layer written must be read before the next is written (a cache serving a model). A cache
        # built without a config is also plain storage (update without attention), so it skips that check.
        self.strict = strict
        self.forward: Forward | None = None
        self.attached: list[tuple[PreTrainedConfig, str | None]] = []
        self.broken: str | None = None  # why the cache cannot continue (a failed step changed a state layer)

    def written(self, layer: Any, start: int) -> Forward:
        """Record that ``layer`` (index ``layer.layer_idx``) is written from ``start`` in this forward; a
        layer written twice starts a new forward. Earlier layers of the forward must have been read."""
        fw = self.forward
        if fw is not None and layer.layer_idx in fw.starts:
            self.finish()
            fw = None
        if fw is None:
            fw = self.forward = Forward()
        # Each write checks the layer written before it (the last in `starts`), so every earlier one was checked
        # when it was last; finish() checks them all. One check instead of one per layer written so far: 435 per
        # decode step of a 30-layer model.
        other = next(reversed(fw.starts.values()))[0] if fw.starts else None
        if self.strict and other is not None and not other.read_complete():
            error = AttentionBypassed(_unread(other.layer_idx))
            self.abort(error)
            raise error
        fw.starts[layer.layer_idx] = (layer, start)
        return fw

    def finish(self) -> None:
        """The forward in progress is over (the next one begins): every layer it wrote must have been read."""
        fw, self.forward = self.forward, None
        if fw is None:
            return
        for idx, (layer, _) in fw.starts.items():
            if self.strict and not layer.read_complete():
                error = AttentionBypassed(_unread(idx))
                self.forward = fw
                self.abort(error)
                raise error

    def abort(self, error: BaseException) -> None:
        """Undo the forward in progress (every layer back to its length before it) and, for a refusal, put
        the configs back as they were."""
        fw, self.forward = self.forward, None
        if fw is not None:
            for layer, start in fw.starts.values():
                if layer.get_seq_length() > start:
                    layer.truncate(start)
            if fw.state_written:
                self.broken = (
                    f"a step failed ({type(error).__name__}) after a linear-attention / conv state had changed; "
                    "call cache.reset() (or use a new cache) before the next step"
                )
        if isinstance(error, UnsupportedAttention) and self.attached:
            detach(self.attached)
            self.attached = []


def _unread(idx: int) -> str:
    return (
        f"layer {idx}'s K/V were written to Int8KvCache but the int8kv attention did not read them: this model "
        "computes that layer's attention outside transformers' attention interface"
    )


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
    """transformers attention interface: INT8/F16 kernels for :class:`Int8KvCache` keys, the model's own
    implementation for the rest.

    ``query [batch, q_heads, n, head_dim]`` are the last ``n`` stored positions; returns
    ``[batch, n, q_heads, head_dim]`` in the query's dtype (rows of queries on padding are zeros)."""
    layer = getattr(key, TAG, None)
    if layer is None:
        if key.shape[-2] == 0 and query.shape[-2] > 0:
            raise UnsupportedAttention(
                "the attention received an empty key tensor without an Int8KvCache tag: this model transforms the "
                "keys between cache.update() and attention, which Int8KvCache does not support"
            )
        fallback = _fallback(module)
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    book: Book = layer.book
    try:
        if getattr(value, TAG, None) is not layer:
            raise AttentionBypassed("the values passed to the attention are not the handles of the keys' layer")
        _check_supported(module, dropout, kwargs)
        opts = attention_options(kwargs, layer.spec)
        batch, q_heads, n, dim = query.shape
        p = layer.pool
        if p is None or batch != layer.batch_size or dim != p.head_dim or n > layer.held or q_heads % p.num_kv_heads:
            raise UnsupportedAttention(
                f"query {tuple(query.shape)} does not fit the cache ({layer!r}): the model's attention reads "
                "K/V of another shape than it stores"
            )
        if opts.sinks is not None and opts.sinks.shape[0] != q_heads:
            raise UnsupportedAttention(f"s_aux holds {opts.sinks.shape[0]} sinks for {q_heads} query heads")
        fw = book.forward
        if fw is None or fw.starts.get(layer.layer_idx, (None,))[0] is not layer:
            raise AttentionBypassed("the attention was called for a layer not written in this forward")
        shared = _shared_plan(fw, layer, attention_mask, batch, n, scaling, opts)
        if query.requires_grad:
            query = query.detach()
        # q as [queries, q_heads, dim]. One decode position: [batch, q_heads, 1, dim] already holds that order, so
        # one reshape instead of transpose + reshape (two torch calls per layer).
        if shared.valid is not None:
            q = query.transpose(1, 2)[shared.valid]
        elif n == 1:
            q = query.reshape(batch, q_heads, dim)
        else:
            q = query.transpose(1, 2).reshape(batch * n, q_heads, dim)
        out = _prepared(shared, layer, q_heads, opts).run(p, 0, q)
        if shared.valid is None:
            out = out.view(batch, n, q_heads, dim)
        else:
            # Queries on left padding are left out of the packed batch (the kernels define the n_b queries of a
            # sequence as its last n_b positions, exactly the non-padding ones); their rows are zeros.
            full = out.new_zeros((batch, n, q_heads, dim))
            full[shared.valid] = out
            out = full
        layer.mark_read()
        # A float32 model's output is the kernel's own tensor: `.to` of the same dtype is still a torch call.
        return (out if out.dtype == query.dtype else out.to(query.dtype)), None
    except Exception as e:
        book.abort(e)
        raise


def _prepared(shared: SharedPlan, layer: Any, q_heads: int, opts: AttentionOptions) -> ops.PreparedAttention:
    """The shared plan's attention prepared for this layer's options: built by the first layer with these query
    heads, softcap and backend and run by the others (the plan's key fixes the window and chunk)."""
    sinks = None if opts.sinks is None else opts.sinks.detach().to(device=layer.pool.device, dtype=torch.float32)
    key = (q_heads, opts.softcap, layer.backend)
    return prepared_attention(shared.calls, key, layer.pool, shared.plan, q_heads, layer.backend, opts, sinks)


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout and module.training:
        raise UnsupportedAttention("attention dropout is not supported with Int8KvCache (use eval mode)")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttention("the int8kv attention is causal only (this layer attends bidirectionally)")


def _shared_plan(
    fw: Forward, layer: Any, mask: Any, batch: int, n: int, scaling: Any, opts: AttentionOptions
) -> SharedPlan:
    p = layer.pool
    held = layer.held
    key = (id(mask), batch, n, held, layer.offset, layer.capacity, p.device, scaling, opts.window, opts.chunk)
    shared = fw.plans.get(key)
    if shared is not None and shared.mask is mask:
        return shared
    kv_starts, valid = _padding_from_mask(mask, batch, n, held, opts)
    block_tables, context_lens = _batch_tables(batch, held, p.device)
    paged = layer.block_tables()  # the 4-bit pool: row b's pages [b * P, (b + 1) * P)
    block_tables = block_tables if paged is None else paged
    if kv_starts is not None:
        kv_starts = kv_starts.to(p.device)
    if valid is None:
        cu = None if n == 1 else torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=p.device)
        num_queries = batch * n
    else:
        valid = valid.to(p.device)
        counts = valid.sum(dim=1)
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=p.device)
        cu[1:] = torch.cumsum(counts, 0)
        num_queries = int(cu[-1])
        if n == 1 and num_queries == batch:
            cu, valid = None, None  # every row has its one query: plain decode
    # A plain decode step over one block per batch row (no mask, no paging) has metadata that is valid by
    # construction once these two bounds hold: its plan skips the range checks' host read, most of its planning
    # cost (the plan is new every step, the lengths having grown).
    trusted = cu is None and kv_starts is None and paged is None and batch <= p.num_blocks and held <= p.block_size
    plan = plan_attention(
        p, block_tables, context_lens, cu_seqlens_q=cu, kv_starts=kv_starts, num_queries=num_queries,
        softmax_scale=scaling, validate=not trusted,
    )  # fmt: skip
    shared = fw.plans[key] = SharedPlan(plan, valid, mask)
    return shared


_TABLES: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _batch_tables(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_tables = arange(batch)[:, None]`` and ``context_lens = [length] * batch`` (row b = block b)."""
    key = (batch, length, torch.device(device))
    if key not in _TABLES:
        if len(_TABLES) > 64:
            _TABLES.clear()
        block_tables = torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)
        _TABLES[key] = (block_tables, torch.full((batch,), length, dtype=torch.int32, device=device))
    return _TABLES[key]


def _padding_from_mask(
    mask: torch.Tensor | None, batch: int, n: int, length: int, opts: AttentionOptions
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(kv_starts [batch] int32, valid_queries [batch, n] bool)`` from transformers' 4-D mask over the
    ``length`` stored keys, or ``(None, None)`` for no mask. The mask must be exactly the pattern the kernels
    apply: causal from ``kv_starts``, within ``opts.window``, within ``opts.chunk`` counted from ``kv_starts``."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise UnsupportedAttention(
            f"the int8kv attention needs a 4-D attention mask (or none), got {type(mask).__name__}"
            + (f" of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else "")
        )
    if mask.shape[0] not in (1, batch) or mask.shape[-2] != n or mask.shape[-1] != length:
        raise UnsupportedAttention(
            f"attention mask {tuple(mask.shape)} does not fit batch {batch}, {n} queries and {length} stored keys"
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
    # The first key any query may see is the row's first non-padding key (the newest query sees all of them
    # without a window; with one, the earliest query's window may already have cut the padding off).
    seen = allowed[:, 0].any(dim=1)  # [batch, length]
    any_key = seen.any(dim=1)
    first = torch.where(any_key, seen.int().argmax(dim=1), torch.full_like(any_key, length, dtype=torch.long))
    key_pos = torch.arange(length, device=mask.device)[None, None, :]
    query_pos = torch.arange(length - n, length, device=mask.device)[None, :, None]
    expected = (key_pos >= first[:, None, None]) & (key_pos <= query_pos)
    if opts.window is not None:
        expected &= key_pos > query_pos - opts.window
    if opts.chunk is not None:
        start = first[:, None, None]
        expected &= (key_pos - start) // opts.chunk == (query_pos - start) // opts.chunk
    if not bool((allowed == expected[:, None]).all()):
        raise UnsupportedAttention(
            "the attention mask is not the pattern the int8kv kernels apply (causal with left padding"
            + (f", window {opts.window}" if opts.window is not None else "")
            + (f", chunks of {opts.chunk}" if opts.chunk is not None else "")
            + "): holes, another window or a custom pattern"
        )
    valid = query_pos[:, :, 0] >= first[:, None]
    return first.to(torch.int32), valid


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, int8kv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, int8kv_mask)


_register()
