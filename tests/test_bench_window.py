"""bench window's pieces on a tiny Llama: the Mistral copy, the chunked scoring, the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from int8kv.bench.window import dynamic_bytes, feed, windowed_model
from int8kv.hf import Int8KvCache


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **overrides)
    return LlamaForCausalLM(config).eval()


def test_the_mistral_copy_is_the_llama_until_the_window_bites():
    llama = tiny_llama()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = llama(ids).logits
        wide = windowed_model(llama, 64)(ids).logits
        narrow = windowed_model(llama, 8)(ids).logits
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(narrow[:, :8], want[:, :8], rtol=1e-5, atol=1e-5)  # inside the first window
    assert float((narrow[:, 8:] - want[:, 8:]).abs().max()) > 1e-3  # later positions see fewer keys


def test_chunked_scoring_is_the_one_forward_nll_past_the_window():
    model = windowed_model(tiny_llama(), 8)
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = -sum(float(logp[p - 1, ids[p]]) for p in range(8, 40))
    nll, count = feed(model, DynamicCache(config=model.config), ids, 7, 8)
    assert count == 32 and nll == pytest.approx(want, rel=1e-5)
    f16, _ = feed(model, Int8KvCache(model.config, "f16"), ids, 7, 8)
    assert math.exp(f16 / count) == pytest.approx(math.exp(nll / count), rel=1e-3)


def test_memory_counts_and_refusals():
    model = windowed_model(tiny_llama(), 8)
    cache = DynamicCache(config=model.config)
    feed(model, cache, list(range(20)), 5, None)
    held = sum(layer.keys.shape[-2] for layer in cache.layers)  # transformers keeps window - 1 per layer
    assert dynamic_bytes(cache, 2) == 2 * 2 * held * 2 * 8  # K and V, 2 kv heads x head_dim 8, 2 bytes
    for bad in (dict(attention_bias=True), dict(mlp_bias=True)):
        with pytest.raises(ValueError, match="Llama model without biases"):
            windowed_model(tiny_llama(**bad), 8)
