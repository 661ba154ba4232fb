"""A decoder-only transformer (Llama family, Qwen3) that runs on the paged KV cache.

Weights are taken from a loaded transformers model, so whatever transformers can load (safetensors,
GGUF) runs here. One forward handles a packed batch of chunks: prefill chunks and decode steps of
different sequences side by side, each described by its slots and its block table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..cache.paged import PagedKvCache
from ..cache.state import KvLayout
from ..errors import UnsupportedModel
from ..formats import KvStorageFormat
from ..models.weights import embedding_table, fused_linear
from ..ops.plan import AttentionPlan, plan_attention
from ..ops.write import rms_norm

# The architectures the fused forward implements (by class, not model_type: EXAONE is a LlamaForCausalLM),
# checked against transformers in tests/test_engine.py, and the RoPE types whose tables are static (inv_freq
# and attention_scaling fixed at init, which `_rope_tables` reads): "dynamic" and "longrope" change with length.
SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def check_fused(hf_model: torch.nn.Module) -> str | None:
    """Why the fused forward cannot run `hf_model` exactly (the first config field or module it does not
    implement, by name), or None when it can."""
    name = type(hf_model).__name__
    if name not in SUPPORTED:
        return f"architecture {name} (the fused forward implements {', '.join(SUPPORTED)})"
    cfg = hf_model.config
    prefix = name.removesuffix("ForCausalLM")
    for field, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"),
                      ("pretraining_tp", 1)):  # fmt: skip
        value = getattr(cfg, field, ok)
        if value not in (ok, None):
            return f"config.{field}={value!r} (the fused forward implements {field}={ok!r})"
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if kinds or getattr(cfg, "use_sliding_window", False):
        return f"layer types {kinds or ['sliding_attention']} (the fused forward implements full attention only)"
    rope = getattr(hf_model.model.rotary_emb, "rope_type", None)
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} (the fused forward implements {', '.join(STATIC_ROPE)})"
    expected = {"": f"{prefix}Model", "model.norm": f"{prefix}RMSNorm", "model.rotary_emb": f"{prefix}RotaryEmbedding"}
    for i in range(cfg.num_hidden_layers):
        at = f"model.layers.{i}"
        expected.update({at: f"{prefix}DecoderLayer", f"{at}.self_attn": f"{prefix}Attention",
                         f"{at}.mlp": f"{prefix}MLP", f"{at}.input_layernorm": f"{prefix}RMSNorm",
                         f"{at}.post_attention_layernorm": f"{prefix}RMSNorm"})  # fmt: skip
    modules = dict(hf_model.named_modules())
    expected[""] = name
    for path, cls in expected.items():
        got = type(modules.get(path)).__name__
        if got != cls:
            return f"module {path or 'model'} is {got} (the fused forward implements {cls})"
    # A forward replaced on an instance or on the class is code the fused forward would not run (a model that
    # builds its own mask, or computes RoPE from something other than positions): the model's own path runs it.
    for path in (*expected, "model"):
        module = modules.get(path)
        if module is None:
            continue
        where = path or "model"
        if "forward" in vars(module):
            return f"module {where} has a forward of its own instance (the fused forward runs its class's, not it)"
        origin = getattr(type(module).forward, "__module__", None) or ""
        if not origin.startswith("transformers."):
            return f"module {where}'s forward comes from {origin or 'an unknown module'}, not transformers"
    return None


@dataclass
class Batch:
    """A packed step. Tokens of sequence b are input_ids[cu_seqlens_q[b]:cu_seqlens_q[b+1]]."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [tokens] int64 ([tables, tokens]: each block table's, with several)
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    block_tables: torch.Tensor  # [batch, max_blocks] int32 ([tables, batch, max_blocks] with several)
    context_lens: torch.Tensor  # [batch] int32, after this step's tokens are written
    is_decode: bool  # every sequence contributes exactly one token


def plan_step(cache: PagedKvCache, batch: Batch, max_position: int, validate: bool = True) -> AttentionPlan:
    """A step's attention plan (block tables, lengths, slots, positions < max_position), checked once for all
    layers (``validate=False``: the caller built the metadata itself)."""
    return plan_attention(
        cache.pool, batch.block_tables, batch.context_lens,
        cu_seqlens_q=None if batch.is_decode else batch.cu_seqlens_q,
        num_queries=int(batch.input_ids.shape[0]), slots=batch.slots, positions=batch.positions,
        max_position=max_position, validate=validate,
        max_query_len=None if validate or batch.is_decode else int(batch.cu_seqlens_q.diff().max()),
    )  # fmt: skip


def plan_tables(
    cache: PagedKvCache, batch: Batch, max_position: int, validate: bool = True
) -> tuple[AttentionPlan, ...]:
    """The step's plan over each block table of `cache` (`plan_step` on that table's block tables and slots)."""
    if cache.num_tables == 1:
        return (plan_step(cache, batch, max_position, validate),)
    return tuple(plan_step(cache, dataclasses.replace(batch, slots=batch.slots[t], block_tables=batch.block_tables[t]),
                           max_position, validate) for t in range(cache.num_tables))  # fmt: skip


@dataclass
class LayerWeights:
    """One layer's norms and matmuls; each matmul is a Linear in the model's weight precision
    (int8kv.models.weights: float32, or what `convert_weights` made of the model's Linear layers)."""

    input_norm: torch.Tensor
    qkv: torch.nn.Module  # hidden -> (q + 2 kv heads) * head_dim: one matmul, then the fused write path
    o: torch.nn.Module
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.nn.Module  # hidden -> 2 * intermediate
    down: torch.nn.Module


class DecoderModel:
    def __init__(self, hf_model: torch.nn.Module, backend: str | None = None) -> None:
        reason = check_fused(hf_model)
        if reason is not None:
            raise UnsupportedModel(f"the fused forward does not implement {reason}")
        cfg = hf_model.config
        self.config = cfg
        self.layout = KvLayout.from_config(cfg)  # format: the engine picks it per cache (make_cache)
        self.layouts = (self.layout,)  # one K/V shape for every layer
        self.num_layers, self.num_kv_heads, self.head_dim = self.layout.dims
        self.num_q_heads = cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = int(cfg.max_position_embeddings)
        self.windows = (None,)  # one block table, full attention on every layer: no block is ever out of reach
        self.backend = backend  # the ops dispatcher's backend (None: from the cache's device)
        base = hf_model.model
        with torch.no_grad():
            self.embed = embedding_table(base.embed_tokens)  # a GGUF embedding decodes only the rows looked up
            self.final_norm = base.norm.weight.detach().float()
            self.lm_head = fused_linear([hf_model.lm_head])
            self.layers = [self._layer(layer) for layer in base.layers]
            self.cos, self.sin = self._rope_tables(base.rotary_emb, cfg.max_position_embeddings)
        self.vocab_size = int(self.lm_head.out_features)

    @staticmethod
    def _layer(layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach().float(),
            qkv=fused_linear([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=fused_linear([attn.o_proj]),
            q_norm=None if q_norm is None else q_norm.weight.detach().float(),
            k_norm=None if k_norm is None else k_norm.weight.detach().float(),
            post_norm=layer.post_attention_layernorm.weight.detach().float(),
            gate_up=fused_linear([mlp.gate_proj, mlp.up_proj]),
            down=fused_linear([mlp.down_proj]),
        )

    @staticmethod
    def _rope_tables(rotary: torch.nn.Module, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' rotary module already applied the config's scaling to inv_freq; reuse it.
        inv_freq = rotary.inv_freq.detach().to(torch.float64)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
        return (angles.cos() * scaling).float(), (angles.sin() * scaling).float()

    def layouts_for(self, format) -> tuple[KvLayout, ...]:
        """The layouts of a cache of ``format`` (:meth:`make_cache`): the one layout of every layer."""
        return (self.layout.with_format(format),)

    def make_cache(self, num_blocks: int, block_size: int, format, **pool: int) -> PagedKvCache:
        """The engine's cache (``pool``: a stateful format's window_pages and sink_slots, PagedKvCache.with_groups)."""
        if pool or KvStorageFormat(format).is_stateful:
            return PagedKvCache.with_groups(num_blocks, block_size, [self.layout.with_format(format)], **pool)
        return PagedKvCache(num_blocks, block_size, *self.layout.dims, format)

    def plan(self, cache: PagedKvCache, batch: Batch, validate: bool = True) -> AttentionPlan:
        """The step's attention plan (block tables, lengths, slots, positions), checked once for all layers."""
        return plan_step(cache, batch, int(self.cos.shape[0]), validate)

    @torch.inference_mode()
    def forward(
        self, cache: PagedKvCache, batch: Batch, all_logits: bool = False, plan: AttentionPlan | None = None
    ) -> torch.Tensor:
        """Logits of each sequence's last token in the batch [batch, vocab] (or of every token [tokens, vocab]).

        ``plan``: the step's plan if the caller built it (:meth:`plan`); otherwise it is built here, once."""
        if plan is None:
            plan = self.plan(cache, batch)
        x = self.embed[batch.input_ids]
        attention = ops.PreparedAttention(cache, plan, self.num_q_heads, backend=self.backend)  # once for all layers
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, self.eps)
            qkv = w.qkv(h)
            q = ops.paged_write(
                cache, i, qkv, None, None, self.cos, self.sin, self.num_q_heads,
                q_norm_weight=w.q_norm, k_norm_weight=w.k_norm, eps=self.eps, plan=plan, backend=self.backend,
            )  # fmt: skip
            # q was checked (shape, finiteness) by the write path.
            attn = attention.run(cache, i, q, check_q=False)
            x = x + w.o(attn.reshape(x.shape[0], -1))
            h = rms_norm(x, w.post_norm, self.eps)
            gate, up = w.gate_up(h).chunk(2, dim=-1)
            x = x + w.down(F.silu(gate) * up)
        if not all_logits:
            x = x[batch.cu_seqlens_q[1:].long() - 1]
        return self.lm_head(rms_norm(x, self.final_norm, self.eps))
