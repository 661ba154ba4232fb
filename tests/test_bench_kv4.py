"""bench kv4's fake-quantizing caches: the chosen candidate's rows are the frozen codec's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from int8kv import quant4
from int8kv.bench import kv4


def test_chosen_candidate_stores_what_quant4_decodes():
    scheme = next(s for s in kv4.SCHEMES if s.name == kv4.CHOSEN)
    cache = kv4.make_cache(scheme, 16)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 150, 16, generator=gen) * 3 + torch.randn(1, 2, 1, 16, generator=gen) * 5
    v = torch.randn(1, 2, 150, 16, generator=gen)
    for lo, hi in [(0, 37), (37, 48), (48, 49), (49, 150)]:  # chunks across and onto block boundaries
        got_k, got_v = cache.update(k[:, :, lo:hi], v[:, :, lo:hi], 0)
        rows = quant4.encode_sequence(k[0, :, :hi].transpose(0, 1).numpy(), v[0, :, :hi].transpose(0, 1).numpy())
        want_k, want_v = quant4.decode_sequence(rows)
        assert np.array_equal(got_k[0].transpose(0, 1).numpy(), want_k)
        assert np.array_equal(got_v[0].transpose(0, 1).numpy(), want_v)


def test_bytes_per_row_counts_scales():
    chosen = next(s for s in kv4.SCHEMES if s.name == kv4.CHOSEN)
    for d in (64, 128):
        # 5d/4 + 4 bytes per position and head (keys and values) against F16's 4d.
        assert kv4.bytes_per_row(chosen, d) == quant4.bytes_per_position(d) == 5 * d / 4 + 4
        assert kv4.bytes_per_row(None, d) == 4 * d


def test_open_block_agreement_sees_what_single_steps_see():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    scheme = next(s for s in kv4.SCHEMES if s.name == kv4.CHOSEN)
    prompt = [3, 17, 40, 9, 22]
    # Greedy one token at a time through the candidate's own cache: the decode steps the cut forwards stand for.
    cache, ref, ids = kv4.make_cache(scheme, 8), [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(40):  # crosses two seals (positions 16 and 32)
            ref.append(int(model(input_ids=ids, cache=cache).logits[0, -1].argmax()))
            ids = torch.tensor([[ref[-1]]])
    assert kv4.agreement(model, scheme, prompt, ref, 8) == len(ref)


def test_kv4_attention_refuses_threads_numba_lacks():
    import numba

    from int8kv.bench import kv4_attention
    from int8kv.cli_common import CliError

    for bad in ("0", str(numba.config.NUMBA_NUM_THREADS + 1)):
        with pytest.raises(CliError, match="--threads"):
            kv4_attention.main(["--threads", bad, "--repeat", "1"])
