"""Any transformers decoder on the engine's paged cache: the model's own forward over one packed row of tokens.

A step (prefill chunks and decode tokens of many sequences side by side, `Batch`) is handed to the model as
one row: ``input_ids [1, tokens]`` with ``position_ids [1, tokens]``, so embeddings, norms, RoPE, MLPs, biases,
activations and logit softcapping are the model's own modules and nothing is approximated. Two hooks connect
the row to the paged cache:

- :class:`StepCache`, passed as the model's ``cache``: ``update(k, v, layer_idx)`` writes the layer's rows at the
  step's slots through the one write path (:func:`int8kv.ops.write.append_rows`: checks, one encode, store) and
  returns the drop-in's empty handles tagged with the layer (:class:`int8kv.hf.attention.KvHandle`: any use
  but the int8kv attention raises);
- the attention function registered with transformers as ``"int8kv_engine"``: it takes the tagged handles, the
  step's :class:`~int8kv.ops.plan.AttentionPlan` (built once per step, shared by every layer) and the layer's
  window, chunk, softcap and sinks, and runs the plan's :class:`int8kv.ops.PreparedAttention` (prepared once per
  step for the layers sharing those options). Its mask function returns None:
  the packed row has no 4-D mask (the plan says which keys each query sees).

The model's config is switched to ``"int8kv_engine"`` only for the duration of each forward and switched back
after it, so the user's model object is left as it was between steps and whenever the engine refuses it.

Never silently wrong: every layer must write its K/V once and read them once through the int8kv attention in
each forward (a model that changes K/V after ``cache.update`` or runs its own attention on the handles fails
with `AttentionBypassed`, an `UnsupportedAttention`); probe forwards at construction refuse such models up
front, and a model whose logits for two sequences packed into one step differ from each sequence's alone (in
place of transformers' ``_supports_attention_backend`` flag: `TransformersModel._check_packing`). What the engine
does not implement is refused by name: KV sharing, multimodal and encoder-decoder models, a forward that fails
under the interface, state kept where the engine cannot give each sequence its own (`UnsupportedModel`); MLA,
ALiBi, sparse attention (`UnsupportedAttention`, from `int8kv.hf.layers`).

Layers whose K/V differ in shape (Gemma 4) are held in one pool per shape, all indexed by the same block ids
(`PagedKvCache.with_groups`); each layer writes to and attends over its group's pool.

Layers of one shape whose attention spans differ (sliding windows beside full attention: Gemma 2 / 3, gpt-oss,
Cohere2) are split into table groups of equal size (`table_groups`): a block of the pool holds one group's layers,
each sequence has one block table per group, and a sliding group's blocks wholly before its window go back to the
shared free list (`PagedKvCache.release_outside_windows`); each layer writes at and attends over its group's table.

Hybrids (linear-attention, Mamba, conv or RG-LRU layers beside attention) run one sequence per forward, each
through its own state (`SequenceStates`, `SequenceRunner`; docs/design.md, "Engine: the model").
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .. import ops
from ..cache.paged import PagedKvCache
from ..cache.state import KvLayout, group_layers
from ..errors import (
    AttentionBypassed,
    KvCacheError,
    NonFiniteError,
    ShapeMismatch,
    UnknownSequence,
    UnsupportedAttention,
    UnsupportedModel,
)
from ..formats import KvStorageFormat
from ..hf.attention import TAG, make_handle
from ..hf.layers import LayerSpec, attention_options, layer_specs, prepared_attention
from ..ops import write
from ..ops.plan import AttentionPlan
from .model import Batch, plan_tables
from .runner import ModelRunner
from .scheduler import Scheduled

ATTN_IMPLEMENTATION = "int8kv_engine"


def engine_layer_specs(config: Any) -> list[LayerSpec]:
    """The config's per-layer attention (:func:`int8kv.hf.layers.layer_specs`, which refuses MLA, ALiBi and
    sparse attention by name); UnsupportedModel for KV sharing (a layer reading another layer's K/V)."""
    specs = layer_specs(config)
    modes = getattr(config.get_text_config(decoder=True), "kv_sharing_modes", None) or []
    for i, mode in enumerate(modes):
        if mode == "reuse":
            raise UnsupportedModel(
                f"layer {i} reuses another layer's K/V (KV sharing), which the engine does not implement: its paged "
                "attention reads only the layer's own K/V"
            )
    return specs


def table_groups(kv_layers: list[LayerSpec]) -> tuple[tuple[int | None, ...], list[tuple[int, int]], int]:
    """Table groups of the K/V layers: the layers of each attention span (None: full, which keeps every key; else
    a sliding window W, or a chunk C, whose queries see no key at or before their position - C), in order of first
    use, cut into groups of ``size`` layers, ``size`` being the fewest layers any span has (vLLM's hybrid cache
    does the same): the last group of a span is padded. Returns each group's window, each layer's (group, layer
    within the group) and ``size``, the layers a block holds. One span gives one group of every layer."""
    # A chunked layer's query sees keys from its chunk's start, all later than its position - chunk: for storage
    # that is a window of the chunk's size (the kernels still apply the chunk, counted from the sequence's start).
    spans = [spec.window if spec.kind == "sliding" else spec.chunk if spec.kind == "chunked" else None
             for spec in kv_layers]  # fmt: skip
    order = list(dict.fromkeys(spans))
    size = min(spans.count(span) for span in order)
    windows: list[int | None] = []
    first: dict[int | None, int] = {}  # the span's first group
    for span in order:
        first[span] = len(windows)
        windows += [span] * -(-spans.count(span) // size)
    seen = dict.fromkeys(order, 0)
    where = []
    for span in spans:
        where.append((first[span] + seen[span] // size, seen[span] % size))
        seen[span] += 1
    return tuple(windows), where, size


def sliding_only_window(layers: list[LayerSpec]) -> int | None:
    """The widest window when every layer holding K/V slides (then keys older than it are never read again),
    else None. State layers and layers without attention keep no K/V, so they do not count."""
    kv = [la for la in layers if la.has_kv]
    if kv and all(la.window is not None for la in kv):
        return max(la.window for la in kv)
    return None


class _Step:
    """What every layer of one forward shares: the pools (one per group of layers with the same K/V shape), the
    plans (one per block table, and per softmax scale and pool), and which layers wrote and read (each exactly
    once, checked after the forward)."""

    def __init__(
        self, cache: PagedKvCache, plans: tuple[AttentionPlan, ...], layers: list[LayerSpec], backend: str | None,
        where: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        self.pools = cache.pools
        # Per model layer (pool group, block table, layer in the pool) when the cache is not laid out by table
        # groups (the 4-bit format's one full table: TransformersModel.one_table); None: the step layers' own.
        self.where = where
        self.backend = ops.resolve_backend(cache.pool, backend)
        self.tables = plans  # the step's plan over each block table (one per table group)
        self.plan = plans[0]
        self.layers = layers
        # By (scaling as the layer passes it, pool group, table group); None: the first pool's head_dim**-0.5, the
        # table's plan.
        self.plans: dict[tuple[float | None, int, int], AttentionPlan] = {}
        for t, plan in enumerate(plans):
            self.plans[(None, 0, t)] = self.plans[(plan.softmax_scale, 0, t)] = plan
        # By (plan, pool group, query heads, window, chunk, softcap): the plan's attention prepared once per step
        # for the layers that share them (ops.PreparedAttention); the plans it names live as long as the step.
        self.prepared: dict[tuple, ops.PreparedAttention] = {}
        self.written = [0] * len(layers)
        self.read = [0] * len(layers)

    def attention_for(self, plan: AttentionPlan, group: int, num_q_heads: int, opts: Any) -> ops.PreparedAttention:
        """``plan``'s attention prepared for a layer of pool ``group`` with ``num_q_heads`` and the options
        ``opts`` (window, chunk, softcap, sinks), built by the first such layer of the step (`prepared_attention`)."""
        key = (id(plan), group, num_q_heads, opts.window, opts.chunk, opts.softcap)
        sinks = None if opts.sinks is None else opts.sinks.detach()
        return prepared_attention(self.prepared, key, self.pools[group], plan, num_q_heads, self.backend, opts, sinks)

    def plan_for(self, scaling: float | None, group: int, table: int = 0) -> AttentionPlan:
        """The plan for a layer of pool ``group`` and block table ``table`` attending with ``scaling`` (None: that
        pool's head_dim**-0.5)."""
        plan = self.plans.get((scaling, group, table))
        if plan is None:
            scale = self.pools[group].head_dim**-0.5 if scaling is None else float(scaling)
            if not math.isfinite(scale) or scale <= 0:
                raise NonFiniteError(f"the model's attention scaling must be finite and > 0, got {scaling!r}")
            # Same metadata, another scale (Gemma's query_pre_attn_scalar) or pool (another K/V shape: the CPU
            # backend's work items depend on its heads); backend data is derived afresh.
            plan = self.plans[(scaling, group, table)] = dataclasses.replace(self.tables[table], softmax_scale=scale,
                                                                             _memo={})  # fmt: skip
        return plan

    def locate(self, layer: _StepLayer) -> tuple[int, int, int]:
        """``(group, table, kv)`` of ``layer`` in this step's cache: its pool group, block table and layer in the
        pool."""
        if self.where is None:
            return layer.group, layer.table, layer.kv
        return self.where[layer.layer_idx]

    def check_complete(self) -> None:
        for i, (w, r) in enumerate(zip(self.written, self.read, strict=True)):
            if self.layers[i].has_kv and (w != 1 or r != 1):
                raise AttentionBypassed(
                    f"layer {i} wrote its K/V {w} time(s) and read them through the int8kv attention {r} time(s) in "
                    "one forward (each must be once): this model does not run its attention through transformers' "
                    "attention interface on the cache it is given"
                )


class _StepLayer(CacheLayerMixin):
    """One layer of :class:`StepCache`: writes the step's rows into layer ``kv`` of pool ``group`` at the slots of
    block table ``table``, hands out tagged empty handles."""

    is_compileable = False
    is_sliding = False
    book = None  # the drop-in's per-forward state, which KvHandle aborts on misuse; the engine checks per step

    def __init__(self, owner: StepCache, index: int, group: int, table: int, kv: int) -> None:
        CacheLayerMixin.__init__(self)
        self.owner = owner
        self.layer_idx = index  # the model's layer
        self.group = group  # its pool: the group of layers with its K/V shape
        self.table = table  # its block table: the table group of layers with its attention span
        self.kv = kv  # its layer in that pool (which holds only the group's layers, or a table group's)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        step = self.owner.active()
        n = step.plan.num_queries
        rows = []
        for name, t in (("keys", key_states), ("values", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != n:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeMismatch(f"layer {self.layer_idx}: {name} must be [1, kv_heads, {n}, head_dim], got {got}")
            rows.append(t[0].transpose(0, 1))  # [tokens, kv_heads, head_dim]
        # The plan's slots were checked once for the step (in the pool, distinct); the rows are checked here.
        group, table, kv = step.locate(self)
        pool, plan = step.pools[group], step.tables[table]
        if getattr(pool, "writes_by_step", False):  # cache/pool_q4w.py: the step's rows go in with the plan
            write.append_paged_kv(pool, kv, rows[0], rows[1], plan=plan, backend=step.backend)
        else:
            write.append_rows(pool, kv, rows[0], rows[1], plan.slots, backend=step.backend)
        step.written[self.layer_idx] += 1
        # Handles the drop-in's way (int8kv.hf.attention.KvHandle): any use but this attention raises.
        return make_handle(key_states, self), make_handle(value_states, self)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # no mask is built (the mask function returns None)

    def get_seq_length(self) -> int:
        return 0  # a packed row of many sequences has no single length; positions come from position_ids

    def get_max_length(self) -> int:
        return -1


class _NoKvLayer(DummyLayer):
    """A layer without attention (transformers' "dummy": an MLP / MoE-only layer): nothing to store."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedModel(
            f"the model writes K/V to layer {self.layer_idx}, which its config declares as a layer without attention"
        )


class _StepStateLayer(LinearAttentionLayer, _StepLayer):
    """A "hybrid" layer of one sequence: its linear-attention state (transformers' own code, as in the drop-in's
    `Int8KvHybridLayer`) beside K/V written to the paged pool."""

    def __init__(
        self, owner: StepCache, index: int, group: int, table: int, kv: int, number_of_states: int = 1
    ) -> None:
        _StepLayer.__init__(self, owner, index, group, table, kv)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    is_compileable = False
    get_max_length = _StepLayer.get_max_length


class StepCache(Cache):
    """The ``cache`` the engine passes to the model, bound to the step in progress (``step``, set by
    `TransformersModel` for the forward's duration). ``layers``: a :class:`_StepLayer` per layer with K/V, a
    :class:`_NoKvLayer` per layer without attention and, in a forward of one sequence of a model with state
    layers, that sequence's state layers (`SequenceStates`), on which transformers' own Cache methods run."""

    def __init__(self, layers: list[Any]) -> None:
        super().__init__(layers=layers)
        self.step: _Step | None = None

    def active(self) -> _Step:
        if self.step is None:
            raise UnsupportedAttention("the engine's cache was used outside an engine step")
        return self.step

    def _state_layer(self, layer_idx: int) -> None:
        if not isinstance(self.layers[layer_idx], LinearAttentionCacheLayerMixin):
            raise UnsupportedModel(
                f"the model keeps a recurrent / convolution state in layer {layer_idx}, which its config declares as "
                f"{type(self.layers[layer_idx]).__name__}: the engine keeps state only for the config's state layers"
            )

    def get_conv_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        self._state_layer(layer_idx)
        return super().get_conv_state(layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._state_layer(layer_idx)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def get_recurrent_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        self._state_layer(layer_idx)
        return super().get_recurrent_state(layer_idx, *args, **kwargs)

    def update_recurrent_state(self, states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._state_layer(layer_idx)
        return super().update_recurrent_state(states, layer_idx, *args, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is not None:
            self._state_layer(layer_idx)
        elif not any(isinstance(la, LinearAttentionCacheLayerMixin) for la in self.layers):
            raise UnsupportedModel("the model asks for a recurrent state, but its config declares no state layer")
        return super().has_previous_state(layer_idx, state_idx)

    def update_indexer(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedModel("this model keeps a sparse-attention indexer in its cache, which the engine does not")


def engine_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface over the engine's paged cache: ``query [1, q_heads, tokens, dim]``
    (the packed row) -> ``[1, tokens, q_heads, dim]``."""
    layer = getattr(key, TAG, None)
    if not isinstance(layer, _StepLayer) or getattr(value, TAG, None) is not layer:
        raise AttentionBypassed(
            "the engine's attention received keys or values that are not the handles its cache returned: this "
            "model changes K/V after cache.update() (or attends without the engine's cache), which the paged "
            "kernels cannot follow"
        )
    if dropout and module.training:
        raise UnsupportedAttention("attention dropout is not supported by the engine (use eval mode)")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttention("the engine's attention is causal only")
    step = layer.owner.active()
    spec = step.layers[layer.layer_idx]
    # No mask says which keys a query sees, so the config's window is the judge: a kwarg must agree with it
    # (the released blocks of a sliding table are outside it).
    opts = attention_options(kwargs, spec)
    if opts.window != spec.window:
        raise UnsupportedAttention(
            f"layer {layer.layer_idx} attends with sliding_window={opts.window}, but its config says {spec.window}"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ShapeMismatch(f"the packed query must be [1, q_heads, tokens, head_dim], got {tuple(query.shape)}")
    q = query[0].transpose(0, 1)  # [tokens, q_heads, dim]
    group, table, kv = step.locate(layer)
    plan = step.plan_for(scaling, group, table)
    out = step.attention_for(plan, group, q.shape[1], opts).run(step.pools[group], kv, q)
    step.read[layer.layer_idx] += 1
    return out.unsqueeze(0).to(query.dtype), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The packed row gets no 4-D mask: which keys each query sees is in the plan (masking_utils calls this
    in place of building one)."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, engine_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)

SHAPES_IMPLEMENTATION = "int8kv_engine_shapes"
_SHAPES: contextvars.ContextVar[list[tuple[int, int, int]] | None] = contextvars.ContextVar("shapes", default=None)


def _record_shapes(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """The shape probe's attention: records (kv_heads, key dim, value dim) of the call and attends to nothing
    (zeros ``[batch, tokens, q_heads, value dim]``: only the shapes of this forward are used)."""
    shapes = _SHAPES.get()
    if shapes is None:
        raise UnsupportedAttention("the engine's shape probe attention was called outside the shape probe")
    shapes.append((int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1])))
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


AttentionInterface.register(SHAPES_IMPLEMENTATION, _record_shapes)
AttentionMaskInterface.register(SHAPES_IMPLEMENTATION, _no_mask)


@contextlib.contextmanager
def _attention_implementation(config: Any, name: str) -> Iterator[None]:
    """The config (and its sub-configs) switched to attention implementation ``name`` for the block only."""
    previous = {"": config._attn_implementation}
    previous.update({k: getattr(config, k)._attn_implementation for k in config.sub_configs
                     if getattr(config, k, None) is not None})  # fmt: skip
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@torch.inference_mode()
def discover_kv_dims(hf_model: torch.nn.Module, num_kv_layers: int) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each attention layer, from the K/V the model's own forward computes (a two-token
    forward without cache through a recording attention): configs name them in many ways or not at all (GPT-2's
    n_head, per-layer head_dim in Gemma 4), and only the tensors are certain. UnsupportedModel, by name, when
    values have another head_dim than keys."""
    device = next(hf_model.parameters()).device
    shapes: list[tuple[int, int, int]] = []
    token = _SHAPES.set(shapes)
    try:
        with _attention_implementation(hf_model.config, SHAPES_IMPLEMENTATION):
            hf_model(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device),
                     position_ids=torch.arange(2, device=device)[None], use_cache=False)  # fmt: skip
    except KvCacheError:
        raise
    except Exception as e:  # noqa: BLE001 - its own attention code met what the interface gives (falcon: mask None)
        raise UnsupportedModel(
            f"{type(hf_model).__name__}'s forward fails when its attention goes through transformers' attention "
            f"interface with no mask ({type(e).__name__}: {e}): it does not run its attention through the interface "
            "alone, which the engine cannot serve"
        ) from e
    finally:
        _SHAPES.reset(token)
    if len(shapes) != num_kv_layers:
        raise AttentionBypassed(
            f"the model's config declares {num_kv_layers} attention layer(s) but its forward called transformers' "
            f"attention interface {len(shapes)} time(s): it does not attend once per layer through the interface (it "
            "changes K/V after cache.update or attends itself), which the engine cannot serve"
        )
    for i, (_, key_dim, value_dim) in enumerate(shapes):
        if key_dim != value_dim:
            raise UnsupportedModel(
                f"the engine's pool does not implement values of another head_dim than the keys' (attention layer {i}: "
                f"{key_dim}, {value_dim})"
            )
    return [(heads, key_dim) for heads, key_dim, _ in shapes]


def kv_groups(shapes: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The distinct (kv_heads, head_dim) of ``shapes`` in order of first use (one pool each), and for each layer
    its (group, index within the group): `cache.state.group_layers`' grouping, which the drop-in's export uses."""
    groups = group_layers(shapes)
    where: list[tuple[int, int]] = [(0, 0)] * len(shapes)
    for g, layers in enumerate(groups):
        for j, i in enumerate(layers):
            where[i] = (g, j)
    return [tuple(shapes[layers[0]]) for layers in groups], where  # type: ignore[misc]


def check_architecture(hf_model: torch.nn.Module) -> list[LayerSpec]:
    """Refuse (UnsupportedModel, by name) what the generic path cannot run, and return the model's layer specs;
    nothing on the model changes."""
    config = getattr(hf_model, "config", None)
    name = type(hf_model).__name__
    if config is None or not hasattr(hf_model, "get_decoder"):
        raise UnsupportedModel(f"{name} is not a transformers model")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model; the engine runs decoder-only models")
    text = config.get_text_config(decoder=True)
    if text is not config:
        raise UnsupportedModel(f"{name} has a separate text config (multimodal); the engine runs text decoders")
    specs = engine_layer_specs(config)
    if not any(spec.has_kv for spec in specs):
        raise UnsupportedModel(f"{name} has no layer with K/V of its own (no attention layer) for the paged cache")
    dropout = [n for n, m in hf_model.named_modules() if m.training and isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout:
        raise UnsupportedModel(f"{name} is in training mode with active dropout ({dropout[0]}): call model.eval()")
    if "logits_to_keep" not in inspect.signature(hf_model.forward).parameters:
        raise UnsupportedModel(f"{name}.forward takes no logits_to_keep (an older model interface)")
    return specs


# State modules that need more than the cache's state layers, by class: the attributes holding a state the module
# keeps on itself instead of in the cache (dotted paths), and whether its forward of several tokens continues
# from a previous state. Where it does not, a sequence's chunks after the first run one token per forward, which
# the single-token path continues exactly. On tiny models a prompt run in two chunks changed the last-token
# logits against one run for Jamba (its selective scan is called without the previous state) and RecurrentGemma
# (its multi-token forward restarts the convolution state), not for Qwen3-Next, Bamba, LFM3, Zamba2 or
# Nemotron-H; one token at a time matched for all. The bool is a floor, not the judge: the
# construction probe (TransformersModel._check_continuation) turns chunks off for any model it catches restarting.
STATE_MODULES: dict[str, tuple[tuple[str, ...], bool]] = {
    "RecurrentGemmaRecurrentBlock": (("conv1d_state", "rg_lru.recurrent_states"), False),
    "JambaMambaMixer": ((), False),
    "ZambaMambaMixer": ((), False),  # the same scan call as Jamba's (read in its code)
}


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set_path(obj: Any, path: str, value: Any) -> None:
    *head, last = path.split(".")
    setattr(_get_path(obj, ".".join(head)) if head else obj, last, value)


class _SeqState:
    """One sequence's state: its cache layers (its own state layers, the shared K/V layers) and the values of
    the state its modules hold themselves (`STATE_MODULES`; None before its first forward)."""

    def __init__(self, layers: list[Any], module_values: list[torch.Tensor | None]) -> None:
        self.layers = layers
        self.module_values = module_values


class SequenceStates:
    """The recurrent / convolution state of each running sequence of a model with state layers.

    Per sequence: transformers' own state layer classes (those `DynamicCache` and the drop-in build: a
    `LinearAttentionLayer` per linear-attention, Mamba or conv layer, a `_StepStateLayer` per "hybrid" layer),
    created at the sequence's first chunk (`begin`), advanced in place by each of its forwards, copied by `fork`
    and dropped by `free` (the scheduler calls both: finish, failure, abort, preemption; a preempted sequence
    begins again from its first token). The K/V of its attention layers stay in the paged pool."""

    def __init__(self, model: TransformersModel) -> None:
        self.owner = model.step_cache
        self.specs = model.attention
        self.shared = model.step_layers  # K/V layers and layers without attention: the same for every sequence
        self.modules = [(module, STATE_MODULES[type(module).__name__]) for module in model.hf.modules()
                        if type(module).__name__ in STATE_MODULES]  # fmt: skip
        # Whether a later chunk of several tokens may run in one forward: what the modules' classes say, and what
        # the model shows at construction (TransformersModel._check_continuation).
        self.continues_chunks = all(cont for _, (_, cont) in self.modules)
        self._states: dict[Any, _SeqState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, seq_id: Any) -> bool:
        return seq_id in self._states

    def begin(self, seq_id: Any) -> _SeqState:
        """A fresh state for `seq_id` (replacing any it had), before its first token."""
        layers = []
        for i, spec in enumerate(self.specs):
            kwargs = dict(spec.layer_kwargs)
            if spec.kind == "state":
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[spec.layer_type](**kwargs))
            elif spec.state:
                shared = self.shared[i]
                states = kwargs.get("number_of_states", 1)
                layers.append(_StepStateLayer(self.owner, i, shared.group, shared.table, shared.kv, states))
            else:
                layers.append(self.shared[i])
        state = self._states[seq_id] = _SeqState(layers, [None] * sum(len(paths) for _, (paths, _) in self.modules))
        return state

    def get(self, seq_id: Any) -> _SeqState:
        state = self._states.get(seq_id)
        if state is None:
            raise UnknownSequence(
                f"sequence {seq_id!r} has no recurrent state: a model with state layers computes every sequence "
                "from its first token (no prefix-cache hit can skip a state layer)"
            )
        return state

    @torch.inference_mode()
    def fork(self, src: Any, dst: Any) -> None:
        """`dst` continues from a copy of `src`'s state (nothing if `src` has not run yet)."""
        state = self._states.get(src)
        if state is None:
            return
        memo = {id(self.owner): self.owner}  # a hybrid layer's link to the step cache is shared, not copied
        layers = [copy.deepcopy(la, memo) if isinstance(la, LinearAttentionCacheLayerMixin) else la
                  for la in state.layers]  # fmt: skip
        values = [None if t is None else t.clone() for t in state.module_values]
        self._states[dst] = _SeqState(layers, values)

    def free(self, seq_id: Any) -> None:
        self._states.pop(seq_id, None)

    def enter(self, state: _SeqState) -> list[Any]:
        """Put `state`'s module-held values on the modules; returns what they held (for `leave`)."""
        held, i = [], 0
        for module, (paths, _) in self.modules:
            for path in paths:
                held.append(_get_path(module, path))
                _set_path(module, path, state.module_values[i])
                i += 1
        return held

    def leave(self, state: _SeqState, held: list[Any]) -> None:
        """Keep the modules' values as `state`'s and give the modules back what they held before `enter`."""
        i = 0
        for module, (paths, _) in self.modules:
            for path in paths:
                state.module_values[i] = _get_path(module, path)
                _set_path(module, path, held[i])
                i += 1

    def check_used(self, state: _SeqState) -> None:
        """After a forward: every state layer's state went through the cache, unless the model keeps its state
        on its modules (`STATE_MODULES`); anything else keeps state the engine cannot give each sequence."""
        if any(paths for _, (paths, _) in self.modules):
            return
        for i, layer in enumerate(state.layers):
            if self.specs[i].state and not (
                any(layer.is_conv_states_initialized.values()) or any(layer.is_recurrent_states_initialized.values())
            ):
                raise UnsupportedModel(
                    f"layer {i} ({self.specs[i].layer_type!r}) kept no state in the cache during a forward: the model "
                    "keeps its recurrent state somewhere the engine cannot give each sequence its own"
                )


_PROBE = object()  # the probe forward's sequence


def _one_token(batch: Batch, i: int) -> Batch:
    """Token `i` of a one-sequence `batch` as a decode batch of its own."""
    n = int(batch.input_ids.shape[0])
    cu = torch.arange(2, dtype=torch.int32, device=batch.cu_seqlens_q.device)
    return Batch(batch.input_ids[i : i + 1], batch.positions[i : i + 1], batch.slots[..., i : i + 1], cu,
                 batch.block_tables, batch.context_lens - (n - 1 - i), is_decode=True)  # fmt: skip


class TransformersModel:
    """The engine's model on any transformers decoder (module docs); the same interface as `DecoderModel`.

    A model with state layers (linear attention, Mamba, conv: `states` is then a `SequenceStates`) runs one
    sequence per forward (`forward_sequence`, through `SequenceRunner`): a recurrent state cannot be packed with
    other sequences' tokens. Its pool holds only the layers with K/V (`kv_layers`); layers whose K/V differ in
    shape are held in one pool per shape (`layouts`, one per group of layers: `PagedKvCache.with_groups`), on one
    block table; layers of one shape with different attention spans get a block table per table group
    (`windows`, `table_groups`), one pool holding a table group's layers per block."""

    def __init__(self, hf_model: torch.nn.Module, backend: str | None = None) -> None:
        self.attention = check_architecture(hf_model)
        self.hf = hf_model
        self.backend = backend  # the ops dispatcher's backend (None: from the cache's device)
        self.config = hf_model.config
        if len(self.attention) != self.config.num_hidden_layers:
            raise UnsupportedModel(f"{len(self.attention)} layer types for {self.config.num_hidden_layers} layers")
        self.kv_layers = [i for i, spec in enumerate(self.attention) if spec.has_kv]
        groups, shaped = kv_groups(discover_kv_dims(hf_model, len(self.kv_layers)))
        if len(groups) == 1:
            # One shape: a block table per table group of layers with one attention span, one pool whose blocks
            # each hold one table group's layers; a sliding group's blocks before its window are given back.
            self.windows, tables, size = table_groups([self.attention[i] for i in self.kv_layers])
            self.layouts = (KvLayout(size, *groups[0]),)
            where = [(0, t, kv) for t, kv in tables]
            # The layers each table group writes (the last group of a span may hold fewer than `size`).
            self.table_layers = tuple(sum(t == g for t, _ in tables) for g in range(len(self.windows)))
        else:
            # One layout per group of K/V layers with the same (kv_heads, head_dim), in order of first use, all on one
            # block table: keys older than the window are released only when every K/V layer slides.
            self.windows = (sliding_only_window(self.attention),)
            self.layouts = tuple(KvLayout(sum(g == i for g, _ in shaped), *shape) for i, shape in enumerate(groups))
            where = [(g, 0, kv) for g, kv in shaped]
            self.table_layers = None
        # A stateful format (the 4-bit one: cache/paged_q4w.py) keeps every page of every layer, its stored form
        # being the whole sequence's, so its cache holds each shape's K/V layers on one block table of full
        # attention: no block goes back past a window, and each layer's window or chunk is applied by the attention
        # (its kwargs, as on a table group). `full_layouts`: that cache's layouts; `one_table`: each model layer's
        # (group, table 0, layer in the pool) in it.
        self.full_layouts = (KvLayout(len(self.kv_layers), *groups[0]),) if len(groups) == 1 else self.layouts
        full_where = [(0, 0, k) for k in range(len(self.kv_layers))] if len(groups) == 1 else where
        self.one_table = {layer: full_where[k] for k, layer in enumerate(self.kv_layers)}
        # The format is the engine's choice per cache (make_cache). num_kv_heads / head_dim: the first group's.
        self.layout = self.layouts[0]
        self.num_layers, (self.num_kv_heads, self.head_dim) = len(self.kv_layers), groups[0]
        head = hf_model.get_output_embeddings()  # a Linear, or a converted / packed one (int8kv.models)
        self.vocab_size = int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])
        self.max_positions = int(self.config.max_position_embeddings)
        self.step_cache = StepCache([])
        kv = {layer: k for k, layer in enumerate(self.kv_layers)}
        self.step_layers = [_StepLayer(self.step_cache, i, *where[kv[i]]) if i in kv else _NoKvLayer(i)
                            for i in range(len(self.attention))]  # fmt: skip
        self.states = SequenceStates(self) if any(spec.state for spec in self.attention) else None
        self._probe()

    def layouts_for(self, format) -> tuple[KvLayout, ...]:
        """The layouts of a cache of ``format`` (:meth:`make_cache`): one per table group's pool, or for a stateful
        format every K/V layer of each shape on one table (`full_layouts`)."""
        layouts = self.full_layouts if KvStorageFormat(format).is_stateful else self.layouts
        return tuple(layout.with_format(format) for layout in layouts)

    def make_cache(self, num_blocks: int, block_size: int, format, **pool: int) -> PagedKvCache:
        """The engine's cache (``pool``: a stateful format's window_pages and sink_slots, PagedKvCache.with_groups);
        a stateful format's on one block table of full attention (`full_layouts`)."""
        device = next(self.hf.parameters()).device
        if KvStorageFormat(format).is_stateful:
            return PagedKvCache.with_groups(num_blocks, block_size, self.layouts_for(format), device=device, **pool)
        return PagedKvCache.with_groups(num_blocks, block_size, self.layouts_for(format), device=device,
                                        windows=self.windows, table_layers=self.table_layers, **pool)  # fmt: skip

    def plan(self, cache: PagedKvCache, batch: Batch, validate: bool = True) -> tuple[AttentionPlan, ...]:
        """The step's plan over each block table of `cache` (one with a single table)."""
        return plan_tables(cache, batch, self.max_positions, validate)

    def forward(
        self, cache: PagedKvCache, batch: Batch, all_logits: bool = False,
        plan: AttentionPlan | tuple[AttentionPlan, ...] | None = None,
    ) -> torch.Tensor:
        """Logits of each sequence's last token in the batch [batch, vocab] (or of every token [tokens, vocab])."""
        if self.states is not None:
            raise UnsupportedModel(
                "this model has state layers: its sequences cannot be packed into one forward (forward_sequence)"
            )
        return self._run(cache, batch, all_logits, plan, self.step_layers)

    def forward_sequence(
        self, cache: PagedKvCache, batch: Batch, seq_id: Any, start: int, all_logits: bool = False
    ) -> torch.Tensor:
        """The next tokens of one sequence (`batch` holds only them, from position `start`) through that
        sequence's state: the logits of its last token [1, vocab] (of every token [tokens, vocab] with
        all_logits). `start == 0` begins a fresh state; a later chunk continues the one its earlier forwards left."""
        states = self.states
        state = states.begin(seq_id) if start == 0 else states.get(seq_id)
        n = int(batch.input_ids.shape[0])
        if start == 0 or n == 1 or states.continues_chunks:
            return self._run(cache, batch, all_logits, None, state.layers, state)
        rows = [self._run(cache, _one_token(batch, i), all_logits, None, state.layers, state) for i in range(n)]
        return torch.cat(rows) if all_logits else rows[-1]

    @torch.inference_mode()
    def _run(
        self, cache: PagedKvCache, batch: Batch, all_logits: bool,
        plan: AttentionPlan | tuple[AttentionPlan, ...] | None, layers: list[Any], state: _SeqState | None = None,
    ) -> torch.Tensor:
        plans = self.plan(cache, batch) if plan is None else (plan,) if isinstance(plan, AttentionPlan) else plan
        step = _Step(cache, tuple(plans), self.attention, self.backend, self._where(cache))
        keep = 0 if all_logits else batch.cu_seqlens_q[1:].to(torch.int64) - 1
        held = None if state is None else self.states.enter(state)
        self.step_cache.layers = layers
        self.step_cache.step = step
        try:
            with _attention_implementation(self.config, ATTN_IMPLEMENTATION):
                out = self.hf(
                    input_ids=batch.input_ids[None], position_ids=batch.positions[None], cache=self.step_cache,
                    use_cache=True, logits_to_keep=keep,
                )  # fmt: skip
        finally:
            self.step_cache.step = None
            if held is not None:
                self.states.leave(state, held)
        step.check_complete()
        return out.logits[0].float()

    def _where(self, cache: PagedKvCache) -> dict[int, tuple[int, int, int]] | None:
        """Where each layer writes and reads in ``cache``: None (the step layers' table groups) for a cache with a
        table per group, `one_table` for one holding every layer on one table (a stateful format's)."""
        if cache.num_tables == len(self.windows):
            return None
        if cache.num_tables == 1:
            return self.one_table
        raise ShapeMismatch(f"the cache has {cache.num_tables} block tables; this model's table groups are "
                            f"{len(self.windows)} (or one for every layer)")

    def _probe(self) -> None:
        """Probe forwards on a four-block cache, before any pool is allocated: a model that does not write and read
        every layer through the engine's hooks (or, with state layers, keeps no state in them) is refused here, and
        so is one whose packed steps would not be what each sequence gives alone (`_check_packing`)."""
        from ..formats import KvStorageFormat

        cache = self.make_cache(4 * len(self.windows), 4, KvStorageFormat.F16)  # 4 sequences of one block per table
        try:
            if self.states is None:
                self._check_packing(cache)
            else:
                try:
                    self.forward_sequence(cache, _probe_batch(cache, [(_PROBE, [0, 0], 0)]), _PROBE, 0)
                    self.states.check_used(self.states.get(_PROBE))
                finally:
                    self.states.free(_PROBE)
                    cache.free(_PROBE)
                self._check_continuation(cache)
        except NonFiniteError:
            pass  # a property of the weights or of the probe's tokens, not of the architecture: requests will say so

    @torch.inference_mode()
    def _own_logits(self, tokens: list[int]) -> torch.Tensor:
        """The model's own forward over one sequence of `tokens`, without a cache: float32 ``[tokens, vocab]``."""
        device = next(self.hf.parameters()).device
        return self.hf(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0].float()

    def _tolerance(self, floor: float) -> float:
        """A probe's tolerance: `floor`, or 4 ulps of the weights' dtype where that is coarser."""
        return max(floor, 4 * torch.finfo(next(self.hf.parameters()).dtype).eps)

    def _check_continuation(self, cache: PagedKvCache) -> None:
        """A model with state layers: a sequence's later tokens, run one per forward after a two-token first
        chunk, must give the model's own forward without a cache (UnsupportedModel, by name, otherwise); and when
        its later chunk of three tokens in one forward does not give the same (a multi-token forward that
        restarts the state instead of continuing it), later chunks run one token per forward
        (`SequenceStates.continues_chunks`), whatever `STATE_MODULES` says of its modules."""
        v = self.vocab_size
        tokens = [t % v for t in (1, 2, 3, 4, 5)]
        states = self.states
        rows = {}
        try:
            for seq, chunks in ((0, [tokens[:2], tokens[2:]]), (1, [tokens[:2], *([t] for t in tokens[2:])])):
                state, start, out = states.begin(seq), 0, []
                for chunk in chunks:
                    batch = _probe_batch(cache, [(seq, chunk, start)])
                    out.append(self._run(cache, batch, True, None, state.layers, state))
                    start += len(chunk)
                rows[seq] = torch.cat(out[1:])
        finally:
            for seq in (0, 1):
                states.free(seq)
                if seq in cache.allocator:
                    cache.free(seq)
        off = _relative_error(rows[1], self._own_logits(tokens)[2:])
        if off > self._tolerance(OWN_TOLERANCE):
            raise UnsupportedModel(
                f"{type(self.hf).__name__}'s logits for tokens fed one per forward after a first chunk differ from "
                f"its own forward's by {off:.3g} of their range: its state does not continue across forwards"
            )
        if _relative_error(rows[0], rows[1]) > self._tolerance(PACKED_TOLERANCE):
            states.continues_chunks = False

    def _check_packing(self, cache: PagedKvCache) -> None:
        """What transformers' ``_supports_attention_backend`` promises, checked on the model's own forward instead of
        taken from the flag: sequence A's first two tokens, then one step packing A's third token (position 2, its
        first two keys read from the cache) beside sequence B's two-token prompt, must give the logits A and B give
        each alone, in one forward each (a model that mixes tokens of the row outside attention or takes positions
        from anything but position_ids fails this), and A's must be the model's own forward's without a cache (a
        mask or input the engine's plan does not follow fails this). UnsupportedModel, by name, otherwise."""
        v = self.vocab_size
        a, b = [1 % v, 2 % v, 3 % v], [4 % v, 5 % v]
        first = self.forward(cache, _probe_batch(cache, [(0, a[:2], 0)]), all_logits=True)
        packed = self.forward(cache, _probe_batch(cache, [(0, a[2:], 2), (1, b, 0)]), all_logits=True)
        alone = [self.forward(cache, _probe_batch(cache, [(2 + i, seq, 0)]), all_logits=True)
                 for i, seq in enumerate((a, b))]  # fmt: skip
        own = self._own_logits(a)  # A's three tokens show a mask the plan contradicts (B adds nothing to that)
        name = type(self.hf).__name__
        off = _relative_error(torch.cat([first, packed]), torch.cat([alone[0], alone[1]]))
        if off > self._tolerance(PACKED_TOLERANCE):
            raise UnsupportedModel(
                f"{name} gives other logits for two sequences packed into one step than for each alone (off by "
                f"{off:.3g} of their range): its forward mixes the row's tokens outside the attention or takes "
                "positions from somewhere other than position_ids, which the engine's packed steps cannot serve"
            )
        off = _relative_error(alone[0], own)
        if off > self._tolerance(OWN_TOLERANCE):
            raise UnsupportedModel(
                f"{name}'s logits through the engine's cache differ from its own forward's by {off:.3g} of their "
                "range: its attention follows a mask or inputs the engine's plan does not implement"
            )


# The probe's tolerances, as a fraction of the logits' range, measured over the 100 tiny coverage models
# (tests/models_coverage.py, float32). Packed against alone: the same kernels and F16 storage, only the matmuls'
# rounding at another row count differs (worst 3.9e-4, HRM-Text; 2.1e-4 BitNet, below 1e-4 the rest), while a
# Llama whose RoPE takes the row's token index instead of position_ids is off by 8.2e-3 with transformers'
# initialisation and by 0.65 with peaked attention. The engine against the model's own forward without a cache:
# F16 storage of K/V against none (worst 2.3e-3, HRM-Text).
PACKED_TOLERANCE = 2e-3
OWN_TOLERANCE = 2e-2


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def _probe_batch(cache: PagedKvCache, items: list[tuple[Any, list[int], int]]) -> Batch:
    """One step of (sequence, tokens, first position) items on `cache` (a sequence starting at 0 is added)."""
    ids, positions, slots, cu = [], [], [], [0]
    for seq, tokens, start in items:
        if start == 0:
            cache.add_sequence(seq, 0)
        slots.append(cache.grow(seq, len(tokens)))
        ids += tokens
        positions += range(start, start + len(tokens))
        cu.append(cu[-1] + len(tokens))
    tables, lens = cache.batch_tensors([seq for seq, _, _ in items])
    device = cache.device
    return Batch(torch.tensor(ids, device=device), torch.tensor(positions, device=device), torch.cat(slots, -1),
                 torch.tensor(cu, dtype=torch.int32, device=device), tables, lens,
                 is_decode=all(len(tokens) == 1 for _, tokens, _ in items))  # fmt: skip


class SequenceRunner(ModelRunner):
    """The runner of a model with state layers: one forward per scheduled sequence (`forward_sequence`), each
    through that sequence's own state. A failure fails only its sequence, and no sequence is run twice in a step
    (a state advances in place: a retry would advance it again)."""

    def _one(self, item: Scheduled, all_logits: bool = False) -> torch.Tensor:
        seq = item.seq
        return self.model.forward_sequence(self.cache, self.prepare([item]), seq.seq_id, seq.num_cached, all_logits)

    def forward(self, scheduled: list[Scheduled], all_logits: bool = False) -> torch.Tensor:
        return torch.cat([self._one(item, all_logits) for item in scheduled])

    def run(self, scheduled: list[Scheduled]) -> tuple[torch.Tensor, list[Exception | None]]:
        rows: list[torch.Tensor] = []
        errors: list[Exception | None] = []
        for item in scheduled:
            try:
                rows.append(self._one(item)[0])
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - reported for this sequence only
                rows.append(torch.full((self.vocab_size,), float("nan"), device=self.cache.device))
                errors.append(e)
        return torch.stack(rows), errors
