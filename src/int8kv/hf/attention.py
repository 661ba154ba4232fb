"""The ``"int8kv"`` attention function for transformers: one plan per forward, the paged kernels per layer.

A forward through an N-layer model calls this function N times with the same attention mask object and the
same sizes. The first call derives everything the kernels need from the mask (left padding as ``kv_starts``,
which queries are padding) and checks it once into an :class:`~int8kv.ops.plan.AttentionPlan`; the other
N - 1 calls reuse it (:class:`ForwardPlan`, kept per thread for the forward in progress). A later call starts
a new forward when its mask, sizes or storage differ, or when its layer index does not follow the last one.

The forward's plan also records which layers this forward has written, so an error in any layer's
attention rolls every one of them back to where the forward began; the layers themselves hold no reference
to their cache.

The mask function registered for ``"int8kv"`` is SDPA's, so the masks transformers builds stay valid for the
SDPA fallback (keys that are not an Int8KvCache's go to transformers' SDPA attention).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .. import ops
from ..errors import ShapeMismatch, UnsupportedAttention
from ..ops.plan import AttentionPlan, plan_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ForwardPlan",
    "TAG",
    "disable_int8kv_attention",
    "enable_int8kv_attention",
    "int8kv_attention_forward",
]

ATTN_IMPLEMENTATION = "int8kv"
TAG = "_int8kv_layer"  # attribute carried by the (empty) tensors Int8KvLayer.update returns


@dataclass(eq=False)
class ForwardPlan:
    """What every layer of one forward shares: the attention plan and which queries are padding.

    key: (mask object, batch, queries, stored length, capacity, device, scaling); the mask is held, so its
    identity cannot be reused by another tensor while this plan refers to it."""

    key: tuple
    plan: AttentionPlan
    valid: torch.Tensor | None  # [batch, n] bool: queries that are not padding (None: all are)
    start: int  # stored length before this forward
    layer_idx: int | None = None  # the last layer index served
    written: list[Any] = field(default_factory=list)  # layers this forward wrote (rolled back on error)

    def rollback(self) -> None:
        for layer in self.written:
            if layer.get_seq_length() > self.start:
                layer.truncate(self.start)


_current = threading.local()  # .plan: the ForwardPlan of the forward in progress on this thread


def _forward_plan(layer: Any, module: torch.nn.Module, mask: Any, batch: int, n: int, scaling: Any) -> ForwardPlan:
    p = layer.pool
    length = layer.get_seq_length()
    key = (mask, batch, n, length, p.block_size, p.device, scaling)
    idx = getattr(module, "layer_idx", None)
    fp: ForwardPlan | None = getattr(_current, "plan", None)
    same = fp is not None and fp.key[0] is mask and fp.key[1:] == key[1:]
    if same and (idx is None or fp.layer_idx is None or idx > fp.layer_idx):
        fp.layer_idx = idx
        return fp
    _current.plan = None  # a failure below must not leave the previous forward's plan in place
    kv_starts, valid = _padding_from_mask(mask, batch, n, length)
    block_tables, context_lens = _batch_tables(batch, length, p.device)
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
    plan = plan_attention(
        p, block_tables, context_lens, cu_seqlens_q=cu, kv_starts=kv_starts, num_queries=num_queries,
        softmax_scale=scaling,
    )  # fmt: skip
    fp = ForwardPlan(key, plan, valid, length - n, idx)
    _current.plan = fp
    return fp


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
    """transformers attention interface: INT8/F16 kernels for :class:`Int8KvCache` keys, SDPA for the rest.

    ``query [batch, q_heads, n, head_dim]`` are the last ``n`` stored positions; returns
    ``[batch, n, q_heads, head_dim]`` in the query's dtype (rows of queries on padding are zeros)."""
    layer = getattr(key, TAG, None)
    if layer is None:
        if key.shape[-2] == 0 and query.shape[-2] > 0:
            raise UnsupportedAttention(
                "the attention received an empty key tensor without an Int8KvCache tag: this model transforms the "
                "keys between cache.update() and attention, which Int8KvCache does not support"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    fp = None
    try:
        _check_supported(module, dropout, kwargs)
        batch, q_heads, n, dim = query.shape
        p = layer.pool
        if p is None or batch != p.num_blocks or dim != p.head_dim or n > layer.get_seq_length():
            raise ShapeMismatch(f"query {tuple(query.shape)} does not fit the cache ({layer!r})")
        fp = _forward_plan(layer, module, attention_mask, batch, n, scaling)
        fp.written.append(layer)
        q = query.detach().transpose(1, 2)  # [batch, n, q_heads, dim]
        q = q.reshape(batch * n, q_heads, dim) if fp.valid is None else q[fp.valid]
        out = ops.attention(p, 0, q, fp.plan, backend=layer.backend)
        if fp.valid is None:
            out = out.view(batch, n, q_heads, dim)
        else:
            # Queries on left padding are left out of the packed batch (the kernels define the n_b queries of a
            # sequence as its last n_b positions, exactly the non-padding ones); their rows are zeros.
            full = out.new_zeros((batch, n, q_heads, dim))
            full[fp.valid] = out
            out = full
        layer.attention_calls += 1
        return out.to(query.dtype), None
    except Exception:
        if fp is not None:
            fp.rollback()
            _current.plan = None
        else:
            start = layer.get_seq_length() - query.shape[-2]
            if start >= 0:
                layer.truncate(start)
        raise


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout and module.training:
        raise UnsupportedAttention("attention dropout is not supported with Int8KvCache (use eval mode)")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"the int8kv attention does not implement {name}")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttention("the int8kv attention is causal only")


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
    mask: torch.Tensor | None, batch: int, n: int, length: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(kv_starts [batch] int32, valid_queries [batch, n] bool)`` from transformers' 4-D mask, or
    ``(None, None)`` for no mask."""
    if mask is None:
        return None, None
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
