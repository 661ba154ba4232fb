"""What the tests of the 4-bit sink-and-window pool share: for its kernels (tests/test_cpu_q4w.py,
tests/test_triton_q4w.py) seeded generators, the relative error against the reference, and a ragged batch of
sequences written into a pool step by step, each backend's test attending it its own way; for the engine over it
(tests/test_engine_q4w*.py) a tiny random Llama whose greedy choices do not hinge on rounding."""

from __future__ import annotations

import zlib

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from int8kv import ops
from int8kv.cache.pool_q4w import Int4SinkWindowPool
from int8kv.ops.plan import AttentionPlan, plan_attention

# 2 layers, 2 KV heads of head_dim 64 (the cpu kernel reads the codes in place).
LLAMA = dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=0)


def sharp_llama(seed: int) -> LlamaForCausalLM:
    """A random Llama of ``LLAMA``'s shape with norms away from 1 and a sharp output layer (logits x 30)."""
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(**LLAMA, rope_theta=10000.0, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        m.lm_head.weight.mul_(30)
    return m


def seeded(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (float32 ``out``, finite, of ``ref``'s shape; either on any device)."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    return float((out.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


class PoolBatch:
    """Sequences of up to ``capacity[b]`` positions in an Int4SinkWindowPool of ``layers`` layers on ``device``
    (block ids a random permutation), ``heads`` KV heads of ``heads * group`` query heads x ``dim``; ``starts``:
    kv_starts, ``variant``: the attention variant each step's attention takes."""

    def __init__(self, heads, group, dim, capacity, gen, layers, starts=None, device="cpu", **variant):
        pages = [-(-n // 64) for n in capacity]
        self.device = torch.device(device)
        self.pool = Int4SinkWindowPool(layers, heads, dim, sum(pages), sum(pages), len(capacity), self.device)
        ids = torch.randperm(sum(pages), generator=gen).tolist()
        self.tables = [ids[sum(pages[:b]) : sum(pages[: b + 1])] for b in range(len(pages))]
        self.lens = [0] * len(capacity)
        self.heads, self.group, self.dim, self.gen, self.starts, self.variant = heads, group, dim, gen, starts, variant
        self.layers = layers
        self.offsets = torch.randn(heads, dim, generator=gen) * 3  # per-channel key offsets, as real keys have

    def plan(self, new: list[int]) -> AttentionPlan:
        """The plan of a step that adds ``new[b]`` positions to sequence ``b`` (the lengths advanced)."""
        self.lens = [n + m for n, m in zip(self.lens, new, strict=True)]
        width = max(map(len, self.tables))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32)
        starts = None if self.starts is None else torch.tensor(self.starts, dtype=torch.int32).to(self.device)
        lens = torch.tensor(self.lens, dtype=torch.int32)
        return plan_attention(self.pool, bt.to(self.device), lens.to(self.device), cu_seqlens_q=cu.to(self.device),
                              kv_starts=starts)  # fmt: skip

    def write(self, plan: AttentionPlan, layer: int, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh K/V rows ``[num_queries, heads, dim]`` (CPU, float32) for ``layer``, written through the write path
        (``options``: append_paged_kv's, e.g. the backend); returned for the caller's own checks."""
        rows = plan.num_queries
        k = torch.randn(rows, self.heads, self.dim, generator=self.gen) + self.offsets
        v = torch.randn(rows, self.heads, self.dim, generator=self.gen) * torch.rand(
            rows, self.heads, 1, generator=self.gen
        ).add(0.2)
        ops.append_paged_kv(self.pool, layer, k.to(self.device), v.to(self.device), plan=plan, **options)
        return k, v

    def query(self, plan: AttentionPlan) -> torch.Tensor:
        """Fresh query rows ``[num_queries, heads * group, dim]`` on the pool's device."""
        q = torch.randn(plan.num_queries, self.heads * self.group, self.dim, generator=self.gen)
        return q.to(self.device)
