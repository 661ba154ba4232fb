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
  window, chunk, softcap and sinks, and calls :func:`int8kv.ops.attention`. Its mask function returns None:
  the packed row has no 4-D mask (the plan says which keys each query sees).

The model's config is switched to ``"int8kv_engine"`` only for the duration of each forward and switched back
after it, so the user's model object is left as it was between steps and whenever the engine refuses it.

Never silently wrong: every layer must write its K/V once and read them once through the int8kv attention in
each forward (a model that changes K/V after ``cache.update`` or runs its own attention on the handles fails
with `AttentionBypassed`, an `UnsupportedAttention`); a probe forward at construction refuses such models up
front. What the engine does not implement is refused by name: recurrent / linear-attention layers, KV sharing,
multimodal and encoder-decoder models, models whose attention ignores transformers' interface
(`UnsupportedModel`); MLA, ALiBi, sparse attention (`UnsupportedAttention`, from `int8kv.hf.layers`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .. import ops
from ..cache.paged import PagedKvCache
from ..cache.state import KvLayout
from ..errors import AttentionBypassed, NonFiniteError, ShapeMismatch, UnsupportedAttention, UnsupportedModel
from ..hf.attention import TAG, make_handle
from ..hf.layers import LayerSpec, attention_options, layer_specs
from ..ops import write
from ..ops.plan import AttentionPlan
from .model import Batch, plan_step

ATTN_IMPLEMENTATION = "int8kv_engine"


def engine_layer_specs(config: Any) -> list[LayerSpec]:
    """The config's per-layer attention (:func:`int8kv.hf.layers.layer_specs`, which refuses MLA, ALiBi and
    sparse attention by name); UnsupportedModel for a layer without K/V of its own or with recurrent state."""
    specs = layer_specs(config)
    for i, spec in enumerate(specs):
        if spec.state or not spec.has_kv:
            what = "shares another layer's K/V (or has no attention)" if spec.kind == "shared" else (
                "keeps a linear-attention / Mamba / conv state")
            raise UnsupportedModel(
                f"layer {i} ({spec.layer_type!r}) {what}: the engine keeps only attention K/V per sequence "
                "(per-sequence recurrent state under continuous batching is not implemented)"
            )
    return specs


def sliding_only_window(layers: list[LayerSpec]) -> int | None:
    """The widest window when every layer is sliding (then keys older than it are never read again), else None."""
    if layers and all(la.window is not None for la in layers):
        return max(la.window for la in layers)
    return None


class _Step:
    """What every layer of one forward shares: the pool, the plan (one per softmax scale), and which layers
    wrote and read (each exactly once, checked after the forward)."""

    def __init__(
        self, cache: PagedKvCache, plan: AttentionPlan, layers: list[LayerSpec], backend: str | None
    ) -> None:
        self.pool = cache.pool
        self.backend = ops.resolve_backend(cache.pool, backend)
        self.plan = plan
        self.layers = layers
        self.plans: dict[float, AttentionPlan] = {plan.softmax_scale: plan}
        self.written = [0] * len(layers)
        self.read = [0] * len(layers)

    def plan_for(self, scaling: float | None) -> AttentionPlan:
        if scaling is None:
            return self.plan
        plan = self.plans.get(scaling)
        if plan is None:
            scale = float(scaling)
            if not math.isfinite(scale) or scale <= 0:
                raise NonFiniteError(f"the model's attention scaling must be finite and > 0, got {scaling!r}")
            # Same metadata, another scale (Gemma's query_pre_attn_scalar); backend data is derived afresh.
            plan = self.plans[scaling] = dataclasses.replace(self.plan, softmax_scale=scale, _memo={})
        return plan

    def check_complete(self) -> None:
        for i, (w, r) in enumerate(zip(self.written, self.read, strict=True)):
            if w != 1 or r != 1:
                raise AttentionBypassed(
                    f"layer {i} wrote its K/V {w} time(s) and read them through the int8kv attention {r} time(s) in "
                    "one forward (each must be once): this model does not run its attention through transformers' "
                    "attention interface on the cache it is given"
                )


class _StepLayer(CacheLayerMixin):
    """One layer of :class:`StepCache`: writes the step's rows, hands out tagged empty handles."""

    is_compileable = False
    is_sliding = False
    book = None  # the drop-in's per-forward state, which KvHandle aborts on misuse; the engine checks per step

    def __init__(self, owner: StepCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = index

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
        write.append_rows(step.pool, self.layer_idx, rows[0], rows[1], step.plan.slots, backend=step.backend)
        step.written[self.layer_idx] += 1
        # Handles the drop-in's way (int8kv.hf.attention.KvHandle): any use but this attention raises.
        return make_handle(key_states, self), make_handle(value_states, self)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # no mask is built (the mask function returns None)

    def get_seq_length(self) -> int:
        return 0  # a packed row of many sequences has no single length; positions come from position_ids

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """The ``cache`` the engine passes to the model: one :class:`_StepLayer` per decoder layer, bound to the
    step in progress (``step``, set by `TransformersModel.forward` for the forward's duration)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_StepLayer(self, i) for i in range(num_layers)])
        self.step: _Step | None = None

    def active(self) -> _Step:
        if self.step is None:
            raise UnsupportedAttention("the engine's cache was used outside an engine step")
        return self.step

    def _recurrent(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedModel(
            "this model keeps recurrent, convolution or indexer state in its cache (a hybrid / linear-attention / "
            "sparse-indexer model); the engine keeps only attention K/V per sequence"
        )

    update_conv_state = update_recurrent_state = get_conv_state = get_recurrent_state = _recurrent
    has_previous_state = update_indexer = _recurrent


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
    # (the released blocks of a sliding-only model are outside it).
    opts = attention_options(kwargs, spec)
    if opts.window != spec.window:
        raise UnsupportedAttention(
            f"layer {layer.layer_idx} attends with sliding_window={opts.window}, but its config says {spec.window}"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ShapeMismatch(f"the packed query must be [1, q_heads, tokens, head_dim], got {tuple(query.shape)}")
    q = query[0].transpose(0, 1)  # [tokens, q_heads, dim]
    sinks = None if opts.sinks is None else opts.sinks.detach()
    out = ops.attention(step.pool, layer.layer_idx, q, step.plan_for(scaling), backend=step.backend,
                        window=opts.window, chunk=opts.chunk, softcap=opts.softcap, sinks=sinks)  # fmt: skip
    step.read[layer.layer_idx] += 1
    return out.unsqueeze(0).to(query.dtype), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The packed row gets no 4-D mask: which keys each query sees is in the plan (masking_utils calls this
    in place of building one)."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, engine_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def check_architecture(hf_model: torch.nn.Module) -> None:
    """Refuse (UnsupportedModel, by name) what the generic path cannot run; nothing on the model changes."""
    config = getattr(hf_model, "config", None)
    name = type(hf_model).__name__
    if config is None or not hasattr(hf_model, "get_decoder"):
        raise UnsupportedModel(f"{name} is not a transformers model")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model; the engine runs decoder-only models")
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise UnsupportedModel(
            f"{name} does not run its attention through transformers' attention interface "
            "(_supports_attention_backend is not set), so the engine cannot serve it"
        )
    text = config.get_text_config(decoder=True)
    if text is not config:
        raise UnsupportedModel(f"{name} has a separate text config (multimodal); the engine runs text decoders")
    dropout = [n for n, m in hf_model.named_modules() if m.training and isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout:
        raise UnsupportedModel(f"{name} is in training mode with active dropout ({dropout[0]}): call model.eval()")
    if "logits_to_keep" not in inspect.signature(hf_model.forward).parameters:
        raise UnsupportedModel(f"{name}.forward takes no logits_to_keep (an older model interface)")


class TransformersModel:
    """The engine's model on any transformers decoder (module docs); the same interface as `DecoderModel`."""

    def __init__(self, hf_model: torch.nn.Module, backend: str | None = None) -> None:
        check_architecture(hf_model)
        self.hf = hf_model
        self.backend = backend  # the ops dispatcher's backend (None: from the cache's device)
        self.config = hf_model.config
        self.attention = engine_layer_specs(self.config)
        self.layout = KvLayout.from_config(self.config)
        self.num_layers, self.num_kv_heads, self.head_dim = self.layout.dims
        if len(self.attention) != self.num_layers:
            raise UnsupportedModel(f"{len(self.attention)} layer types for {self.num_layers} layers")
        self.vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(self.config.max_position_embeddings)
        # Keys older than the window are never read when every layer slides (the scheduler frees their blocks).
        self.window = sliding_only_window(self.attention)
        self._cache = StepCache(self.num_layers)
        self._probe()

    def make_cache(self, num_blocks: int, block_size: int, format) -> PagedKvCache:
        device = next(self.hf.parameters()).device
        return PagedKvCache(num_blocks, block_size, *self.layout.dims, format, device=device)

    def plan(self, cache: PagedKvCache, batch: Batch, validate: bool = True) -> AttentionPlan:
        return plan_step(cache, batch, self.max_positions, validate)

    @torch.inference_mode()
    def forward(
        self, cache: PagedKvCache, batch: Batch, all_logits: bool = False, plan: AttentionPlan | None = None
    ) -> torch.Tensor:
        """Logits of each sequence's last token in the batch [batch, vocab] (or of every token [tokens, vocab])."""
        if plan is None:
            plan = self.plan(cache, batch)
        step = _Step(cache, plan, self.attention, self.backend)
        keep = 0 if all_logits else batch.cu_seqlens_q[1:].to(torch.int64) - 1
        config = self.config
        previous = {"": config._attn_implementation}
        previous.update({k: getattr(config, k)._attn_implementation for k in config.sub_configs
                         if getattr(config, k, None) is not None})  # fmt: skip
        self._cache.step = step
        config._attn_implementation = ATTN_IMPLEMENTATION
        try:
            out = self.hf(
                input_ids=batch.input_ids[None], position_ids=batch.positions[None], cache=self._cache,
                use_cache=True, logits_to_keep=keep,
            )  # fmt: skip
        finally:
            config._attn_implementation = previous
            self._cache.step = None
        step.check_complete()
        return out.logits[0].float()

    def _probe(self) -> None:
        """One two-token forward on a one-block cache: a model that does not write and read every layer through
        the engine's hooks is refused here, before any pool is allocated."""
        from ..formats import KvStorageFormat

        cache = self.make_cache(1, 2, KvStorageFormat.F16)
        slots = cache.add_sequence(0, 2)
        tables, lens = cache.batch_tensors([0])
        device = cache.device
        batch = Batch(torch.zeros(2, dtype=torch.int64, device=device), torch.arange(2, device=device), slots,
                      torch.tensor([0, 2], dtype=torch.int32, device=device), tables, lens, is_decode=False)
        try:
            self.forward(cache, batch)
        except NonFiniteError:
            pass  # a property of the weights or of token 0, not of the architecture: requests will say so
