"""bench kv4's fake-quantizing caches: the chosen candidate's rows are the frozen codec's, bit for bit; the mixed
attention reads, for every query of a prefill, the rows a decode step would read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from int8kv import quant4
from int8kv.bench import kv4

CHOSEN = next(s for s in kv4.SCHEMES if s.name == kv4.CHOSEN)


def test_chosen_candidate_stores_what_quant4_decodes():
    cache = kv4.make_cache(CHOSEN, 16)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 150, 16, generator=gen) * 3 + torch.randn(1, 2, 1, 16, generator=gen) * 5
    v = torch.randn(1, 2, 150, 16, generator=gen)
    for lo, hi in [(0, 37), (37, 48), (48, 49), (49, 150)]:  # chunks across and onto block boundaries
        got_k, got_v = cache.update(k[:, :, lo:hi], v[:, :, lo:hi], 0)
        rows = quant4.encode_sequence(k[0, :, :hi].transpose(0, 1).numpy(), v[0, :, :hi].transpose(0, 1).numpy())
        want_k, want_v = quant4.decode_sequence(rows)
        # The quantized half: sealed blocks as the codec decodes them, the open block in F16 as it stores it.
        assert np.array_equal(got_k[0, :, :, 16:32].transpose(0, 1).numpy(), want_k)
        assert np.array_equal(got_v[0, :, :, 16:].transpose(0, 1).numpy(), want_v)
        f16 = k[0, :, :hi].half().float()
        assert torch.equal(got_k[0, :, :, :16], f16)


def test_bytes_per_row_counts_scales():
    for d in (64, 128):
        # 5d/4 + 4 bytes per position and head (keys and values) against F16's 4d.
        assert kv4.bytes_per_row(CHOSEN, d) == quant4.bytes_per_position(d) == 5 * d / 4 + 4
        assert kv4.bytes_per_row(None, d) == 4 * d
    windowed = kv4.Scheme("w", mode="asym", kivi=True, open_f16=True, window=64, sinks=4, vgroup=32)
    # 100 positions: the next step reads blocks 0-1 (minus the 4 sinks) quantized; 36 + 64 rows are F16.
    q = kv4.bytes_per_row(windowed, 64)
    assert q == 32 + 16 + 32 + 8
    assert kv4.bytes_at(windowed, 64, 100) == pytest.approx((28 * q + 72 * 256) / 100)
    assert kv4.bytes_at(windowed, 64, 10**6) == pytest.approx(q, rel=1e-3)
    channels = kv4.Scheme("c", mode="asym", kivi=True, open_f16=True, vchan=True, block=64)
    assert kv4.bytes_per_row(channels, 128) == 2 * (64 + 4 * 128 / 64)


def _tiny_model(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _decode_reference(scheme: kv4.Scheme):
    """A cache that does what a decode step does, one token at a time: append the row, seal each block that
    has ``window`` positions after it (its key groups leave the sinks out), return every row as stored."""
    from transformers import DynamicCache

    class Stepper(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.stored: dict[int, list[list[torch.Tensor]]] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            assert key_states.shape[-2] == 1
            rows = self.stored.setdefault(layer_idx, [[], []])
            rows[0].append(key_states.half().float())
            rows[1].append(value_states.half().float())
            n, b = len(rows[0]), scheme.block
            if n >= b + scheme.window and (n - scheme.window) % b == 0:
                s = n - scheme.window - b
                lo = min(max(s, scheme.sinks), s + b)
                if lo < s + b:
                    channels = [0, 1] if scheme.vchan else [0]
                    for part in channels:  # per channel over the block's rows
                        x = torch.cat(rows[part][lo : s + b], -2)
                        scale = ((x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)) / 15).half().float()
                        mn = x.amin(-2, keepdim=True).half().float()
                        scale = torch.where(scale > 0, scale, 1.0)
                        for i in range(lo, s + b):
                            rows[part][i] = mn + torch.round((rows[part][i] - mn) / scale).clamp(0, 15) * scale
                    for i in range(lo, s + b) if not scheme.vchan else ():  # values per position
                        v = rows[1][i]
                        vs = ((v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 15).half().float()
                        vm = v.amin(-1, keepdim=True).half().float()
                        vs = torch.where(vs > 0, vs, 1.0)
                        rows[1][i] = vm + torch.round((v - vm) / vs).clamp(0, 15) * vs
            super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return torch.cat(rows[0], -2), torch.cat(rows[1], -2)

    return Stepper()


@pytest.mark.parametrize("scheme", [
    CHOSEN,
    kv4.Scheme("sinks + window", mode="asym", kivi=True, open_f16=True, sinks=3, window=20),
    kv4.Scheme("sinks past a block", mode="asym", kivi=True, open_f16=True, block=8, sinks=11, window=8),
    kv4.Scheme("V per channel", mode="asym", kivi=True, open_f16=True, vchan=True, block=32, sinks=2, window=8),
], ids=lambda s: s.name)
def test_one_forward_reads_what_decode_steps_read(scheme):
    # One layer: its rows are the same bits both ways (in a second layer float noise of 1e-7 between the two
    # attentions' outputs can flip a code at a rounding boundary).
    model = _tiny_model(layers=1)
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        kv4.use_attention(model, None)
        plain = model(input_ids=ids, cache=kv4.make_cache(None, 8)).logits
        step, want = _decode_reference(scheme), []
        for i in range(ids.shape[1]):
            want.append(model(input_ids=ids[:, i : i + 1], cache=step).logits)
        kv4.use_attention(model, scheme)
        cache, got = kv4.make_cache(scheme, 8), []
        for lo, hi in [(0, 37), (37, 38), (38, 64), (64, 90)]:  # a prefill in chunks of any length
            got.append(model(input_ids=ids[:, lo:hi], cache=cache).logits)
    want, got = torch.cat(want, 1), torch.cat(got, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # the quantized rows were read


def test_mixed_attention_without_quantized_rows_is_sdpa_over_f16_rows():
    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(2))
    never = kv4.Scheme("all sinks", mode="asym", kivi=True, open_f16=True, sinks=10**6)
    with torch.inference_mode():
        kv4.use_attention(model, None)
        want = model(input_ids=ids, cache=kv4.make_cache(None, 8)).logits
        kv4.use_attention(model, never)
        got = model(input_ids=ids, cache=kv4.make_cache(never, 8)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_agreement_counts_steps_that_match():
    model = _tiny_model()
    prompt = [3, 17, 40, 9, 22]
    with torch.inference_mode():
        kv4.use_attention(model, CHOSEN)
        cache, ref, ids = kv4.make_cache(CHOSEN, 8), [], torch.tensor([prompt])
        for _ in range(40):  # greedy through the candidate's own cache: crosses two seals
            ref.append(int(model(input_ids=ids, cache=cache).logits[0, -1].argmax()))
            ids = torch.tensor([[ref[-1]]])
    assert kv4.agreement(model, CHOSEN, prompt, ref, 8) == len(ref)
    flipped = ref[:-1] + [(ref[-1] + 1) % 64]  # the last step's token is not the top-1
    assert kv4.agreement(model, CHOSEN, prompt, flipped, 8) == len(ref) - 1


def test_prerope_keys_quantize_the_keys_before_rotation():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), position_ids=torch.arange(64)[None])
    rope = (cos[0], sin[0])
    pre = kv4.Scheme("pre", mode="asym", kivi=True, open_f16=True, prerope=True)
    post = kv4.Scheme("post", mode="asym", kivi=True, open_f16=True)
    gen = torch.Generator().manual_seed(5)
    # Keys that are one vector per head before RoPE (what SmolLM2's outlier channels look like), and noise.
    base = torch.randn(1, 2, 1, 16, generator=gen) * 4 + 0.05 * torch.randn(1, 2, 48, 16, generator=gen)
    k = base * rope[0][:48] + kv4._rotate_half(base) * rope[1][:48]
    v = torch.randn(1, 2, 48, 16, generator=gen)
    err = {}
    for scheme in (pre, post):
        got, _ = kv4.make_cache(scheme, 16, rope).update(k, v, 0)
        err[scheme.name] = (got[..., 16:32] - k.half().float())[..., :32, :].abs().max()
    assert err["pre"] < 0.02 < err["post"]
    with pytest.raises(ValueError, match="before RoPE"):
        kv4.make_cache(pre, 16)


def test_nll_scores_a_candidate_against_the_baseline():
    from int8kv.progress import Bar

    model = _tiny_model()
    wins = torch.randint(0, 64, (3, 64), generator=torch.Generator().manual_seed(3)).tolist()
    keep: list = []
    with Bar("kv4 test", total=1) as bar, torch.inference_mode():
        kv4.use_attention(model, None)
        base = kv4.nll(model, lambda: kv4.make_cache("fp32", 8), wins, 2, 16, bar, None, keep)
        again = kv4.nll(model, lambda: kv4.make_cache("fp32", 8), wins, 2, 16, bar, keep)
        kv4.use_attention(model, CHOSEN)
        cand = kv4.nll(model, lambda: kv4.make_cache(CHOSEN, 8), wins, 2, 16, bar, keep)
    assert base.count == again.count == cand.count == 3 * 32  # the second half of each window
    assert again.kl == again.delta == 0.0 and again.nll == base.nll
    assert cand.kl > 0 and cand.delta_se() > 0
    assert cand.delta == pytest.approx(cand.nll - base.nll, rel=1e-9)  # the per-token changes sum to the NLL's


@pytest.mark.parametrize(("argv", "words"), [(["--agree-ctx", "-1"], "--agree-ctx >= 0"),
                                             (["--only", "no such candidate"], "unknown candidate")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, words):
    from int8kv.cli_common import CliError

    with pytest.raises(CliError, match=words):
        kv4.main(argv)


def test_kv4_attention_refuses_threads_numba_lacks():
    import numba

    from int8kv.bench import kv4_attention
    from int8kv.cli_common import CliError

    for bad in ("0", str(numba.config.NUMBA_NUM_THREADS + 1)):
        with pytest.raises(CliError, match="--threads"):
            kv4_attention.main(["--threads", bad, "--repeat", "1"])


def test_q4w_attention_takes_a_context_and_refuses_a_bad_one():
    from int8kv.bench import q4w_attention
    from int8kv.cli_common import CliError

    with pytest.raises(CliError, match="--context"):
        q4w_attention.main(["--context", "0", "--repeat", "1"])
    # 200 positions: one sealed page, the sinks and a window of 72 F16 rows; all three kernels called
    result = q4w_attention.main(["--preset", "smollm2", "--context", "200", "--repeat", "1"])
    (row,) = result["rows"]
    assert row["context"] == 200 and row["calls"]["q4w"] == row["calls"]["int8_paged"] == row["calls"]["f16_paged"] >= 1
    from int8kv import quant4w

    assert row["bytes_read"]["q4w"] == 3 * quant4w.stored_bytes(200, 64)  # 3 KV heads of 64
    assert 0 < row["max_rel_diff_vs_f16"]["q4w"] < 0.2
