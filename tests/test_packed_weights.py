"""GGUF blocks run packed (int8kv.ops.cpu_packed, int8kv.models.packed): the block kernels against a float64
reference on fresh random blocks, the recovery of Q4_1 / Q8_0 blocks from decoded float32 weights (exact or
refused), PackedLinear, `weights="model"` in the engine on both model paths, and SmolLM2's own layers."""

import numba
import numpy as np
import pytest
import torch
from test_engine import SMALL, hf_logits, tiny

from int8kv import KvStorageFormat
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import ShapeMismatch, UnsupportedWeights
from int8kv.models import convert_weights
from int8kv.models.packed import DENSE_ROWS, PackedLinear, pack_blocks, pack_weights
from int8kv.models.weights import fused_linear
from int8kv.ops import cpu_packed

F16 = KvStorageFormat.F16
EPS = 2.0**-24  # float32 unit roundoff


# ------------------------------------------------------------------------------------------------------------
# A reference quantizer, as ggml's reference code quantizes (written from its definition: per block of 32,
# Q4_1 d = (max - min) / 15, q = trunc((x - min) / d + 1/2) capped at 15; Q8_0 d = max|x| / 127, q = x / d
# rounded half away from zero; d and min stored as float16), and the float32 weights a loader decodes from it.
# ------------------------------------------------------------------------------------------------------------
def q4_1_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(decoded float32 (n, k), q (n, nb, 32) uint8, d, m) of w (n, k)."""
    b = w.reshape(w.shape[0], -1, 32).astype(np.float32)
    lo, hi = b.min(-1), b.max(-1)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(np.trunc((b - lo[..., None]) * inv[..., None] + np.float32(0.5)), 15).astype(np.uint8)
    d16 = d.astype(np.float16).astype(np.float32)
    m16 = lo.astype(np.float16).astype(np.float32)
    decoded = (d16[..., None] * q.astype(np.float32) + m16[..., None]).astype(np.float32)
    return decoded.reshape(w.shape), q, d16, m16


def q8_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decoded float32 (n, k), q (n, nb, 32) int8, d) of w (n, k)."""
    b = w.reshape(w.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(-1) / np.float32(127)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    scaled = b * inv[..., None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    d16 = d.astype(np.float16).astype(np.float32)
    return (d16[..., None] * q.astype(np.float32)).astype(np.float32).reshape(w.shape), q, d16


def nibbles(q: np.ndarray) -> np.ndarray:
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[:, :: max(1, k // 5)] *= 8  # a few large weights, as trained layers have
    return w


def assert_within_float32_of_float64(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """y (m, n) against x (m, k) @ w (n, k)^T in float64: each of the 32 lanes rounds k / 32 fused products and
    sums, the lanes add in 5 levels; the bound is that many roundings of sum |x| |w|."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    bound = (x.shape[1] / 32 + 6) * EPS * magnitude
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-300)).max())


SHAPES = [(1, 32, 1), (7, 96, 3), (130, 576, 5), (33, 1536, 16), (3, 64, 2)]  # (n, k, rows of x): ragged


@pytest.mark.parametrize("n, k, m", SHAPES)
def test_q4_1_kernel_within_float32_rounding_of_float64(n, k, m):
    rng = np.random.default_rng()
    decoded, q, d, lo = q4_1_blocks(weights(rng, n, k))
    codes = nibbles(q)
    assert np.array_equal(cpu_packed.decode_q4_1(codes, d, lo), decoded)  # the decoder's own float32 values
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert_within_float32_of_float64(cpu_packed.matmul_q4_1(x, codes, d, lo), x, decoded)


@pytest.mark.parametrize("n, k, m", SHAPES)
def test_q8_0_kernel_within_float32_rounding_of_float64(n, k, m):
    rng = np.random.default_rng()
    decoded, q, d = q8_0_blocks(weights(rng, n, k))
    codes = q.reshape(n, k)
    assert np.array_equal(cpu_packed.decode_q8_0(codes, d), decoded)
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert_within_float32_of_float64(cpu_packed.matmul_q8_0(x, codes, d), x, decoded)


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    rng = np.random.default_rng()
    decoded, q, d, lo = q4_1_blocks(weights(rng, 300, 192))
    codes = nibbles(q)
    x = rng.standard_normal((6, 192)).astype(np.float32)
    together = cpu_packed.matmul_q4_1(x, codes, d, lo)
    for i in range(6):
        assert np.array_equal(cpu_packed.matmul_q4_1(x[i : i + 1].copy(), codes, d, lo)[0], together[i])
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert np.array_equal(cpu_packed.matmul_q4_1(x, codes, d, lo), together)
    finally:
        numba.set_num_threads(threads)


def test_kernels_refuse_mismatched_shapes():
    codes, scale = np.zeros((4, 32), np.uint8), np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        cpu_packed.matmul_q4_1(np.zeros((1, 32), np.float32), codes, scale, scale)
    with pytest.raises(ValueError, match="x must be"):
        cpu_packed.matmul_q4_1(np.zeros((1, 64), np.float64), codes, scale, scale)
    with pytest.raises(ValueError, match="scales must be"):
        cpu_packed.matmul_q4_1(np.zeros((1, 64), np.float32), codes, scale[:, :1].copy(), scale[:, :1].copy())
    with pytest.raises(ValueError, match="codes must be"):
        cpu_packed.matmul_q8_0(np.zeros((1, 64), np.float32), np.zeros((4, 64), np.uint8), scale)


# ------------------------------------------------------------------------------------------------------------
# Recovering blocks from decoded weights
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(1, 32), (48, 576), (17, 1536)])
def test_decoded_blocks_are_recovered_exactly(n, k):
    rng = np.random.default_rng()
    for kind, blocks in (("q4_1", q4_1_blocks), ("q8_0", q8_0_blocks)):
        decoded = blocks(weights(rng, n, k))[0]
        found = pack_blocks(torch.from_numpy(decoded))
        assert found is not None and found[0] == kind
        layer = PackedLinear(found[0], found[1], None, k)
        assert torch.equal(layer.decoded(), torch.from_numpy(decoded))


def test_constant_and_zero_blocks_pack():
    w = np.zeros((4, 64), np.float32)
    w[1] = 0.5  # a constant block: Q4_1 with d = 0
    w[2, :32] = -1.25
    found = pack_blocks(torch.from_numpy(w))
    assert found is not None
    assert torch.equal(PackedLinear(found[0], found[1], None, 64).decoded(), torch.from_numpy(w))


def test_weights_that_are_not_blocks_stay_float():
    rng = np.random.default_rng()
    assert pack_blocks(torch.from_numpy(weights(rng, 8, 64))) is None  # trained-like float32 weights
    decoded = q4_1_blocks(weights(rng, 8, 64))[0]
    nudged = decoded.copy()
    nudged[3, 40] = np.nextafter(nudged[3, 40], np.float32(np.inf))  # one weight one ulp off its block
    assert pack_blocks(torch.from_numpy(nudged)) is None
    assert pack_blocks(torch.from_numpy(decoded).half()) is None  # another dtype holds no decoded blocks
    assert pack_blocks(torch.from_numpy(decoded[:, :48].copy())) is None  # no whole blocks
    bad = decoded.copy()
    bad[0, 0] = np.nan
    assert pack_blocks(torch.from_numpy(bad)) is None
    bad[0, 0] = np.inf
    assert pack_blocks(torch.from_numpy(bad)) is None


# ------------------------------------------------------------------------------------------------------------
# PackedLinear and whole models
# ------------------------------------------------------------------------------------------------------------
def blockwise(model: torch.nn.Module, kind: str = "q4_1") -> torch.nn.Module:
    """``model`` with every Linear weight replaced by its reference Q4_1 (or Q8_0) blocks, decoded."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.detach().numpy()
                blocks = q4_1_blocks(w) if kind == "q4_1" else q8_0_blocks(w)
                m.weight.copy_(torch.from_numpy(blocks[0]))
    return model


@pytest.mark.parametrize("rows", [1, 5, 40, DENSE_ROWS, DENSE_ROWS + 1])  # the block kernel, then one dense matmul
def test_packed_linear_within_float32_rounding_of_float64(rows):
    rng = np.random.default_rng()
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(q4_1_blocks(weights(rng, 40, 96))[0]))
    layer = PackedLinear.from_linear(lin)
    assert layer is not None and layer.kind == "q4_1"
    with pytest.raises(ShapeMismatch, match="expected inputs of 96 features"):
        layer(torch.randn(rows, 48))
    x = torch.randn(2, rows, 96)
    y = layer(x)
    assert y.shape == (2, rows, 40) and y.dtype == torch.float32
    flat = x.reshape(-1, 96).numpy()
    w = lin.weight.detach().numpy()
    assert_within_float32_of_float64(y.reshape(-1, 40).numpy() - lin.bias.detach().numpy(), flat, w)


def test_copies_and_dtype_changes_of_a_packed_layer():
    import copy

    rng = np.random.default_rng()
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(q4_1_blocks(weights(rng, 8, 64))[0]))
    layer = PackedLinear.from_linear(lin)
    x = torch.randn(2, 64)
    want = layer(x)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.scale.mul_(2)  # the copy's own buffers, seen by its kernel; the original's unchanged
    assert torch.equal(layer(x), want) and not torch.equal(twin(x), want)
    with pytest.raises(ValueError, match="scales must be C-contiguous float32"):
        layer.half()(x)  # float16 scales: refused by name, not run
    with pytest.raises(UnsupportedWeights, match="must stay float32"):
        copy.deepcopy(twin).bfloat16()(x)


def test_fused_packed_layers_compute_each_part_exactly():
    rng = np.random.default_rng()
    parts = []
    for n in (24, 8, 8):
        lin = torch.nn.Linear(64, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(q4_1_blocks(weights(rng, n, 64))[0]))
        parts.append(PackedLinear.from_linear(lin))
    fused = fused_linear(parts)
    assert isinstance(fused, PackedLinear) and fused.out_features == 40
    x = torch.randn(3, 64)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))  # rows are independent
    assert fused_linear(parts[:1]) is parts[0]
    q8 = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        q8.weight.copy_(torch.from_numpy(q8_0_blocks(weights(rng, 8, 64))[0]))
    mixed = fused_linear([parts[0], PackedLinear.from_linear(q8)])  # two kinds: their exact float32 weights
    assert isinstance(mixed, torch.nn.Linear)
    assert torch.equal(mixed.weight, torch.cat([parts[0].decoded(), q8.weight.detach()]))


def test_pack_weights_copies_and_keeps_every_weight():
    model = blockwise(tiny("llama", seed=5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack_weights(model)
    assert all(not isinstance(m, PackedLinear) for m in model.modules())  # the caller's model is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    got = dict(packed.named_modules())
    for name, m in linears.items():
        assert isinstance(got[name], PackedLinear) and torch.equal(got[name].decoded(), m.weight)
    ids = torch.randint(1, SMALL["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(model, ids)
    assert ((hf_logits(packed, ids) - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # A model without block weights comes back as it is; a packed one cannot be converted again.
    plain = tiny("llama", seed=5)
    assert pack_weights(plain) is plain and convert_weights(plain, "model") is plain
    assert convert_weights(plain, "dense") is plain
    with pytest.raises(UnsupportedWeights, match="already hold q4_1"):
        convert_weights(packed, "int8")


@pytest.mark.parametrize("implementation", ["transformers", "fused"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_engine_runs_block_weights_packed(implementation, kind):
    model = blockwise(tiny("qwen3", seed=6), kind)
    ids = torch.randint(1, SMALL["vocab_size"], (DENSE_ROWS + 16,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_logits(model, ids)
    packed = LLM(model, kv_format=F16, memory="2MiB", implementation=implementation)
    dense = LLM(model, kv_format=F16, memory="2MiB", implementation=implementation, weights="dense")
    assert all(not isinstance(m, PackedLinear) for m in model.modules())  # the caller's model is untouched
    for llm in (packed, dense):
        # chunks of 3 run the block kernel, of DENSE_ROWS + 8 the decoded weights; F16 K/V adds ~2^-11 per element.
        for chunk in (3, DENSE_ROWS + 8):
            got = llm.score(ids, chunk_size=chunk).double()
            assert ((got - want).abs().max() / want.abs().max()).item() < 5e-3
    assert packed.fingerprint != dense.fingerprint  # the key root hashes the blocks that run
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = (llm.generate([ids[:9]], params)[0].token_ids for llm in (packed, dense))
    assert a == b  # tiny()'s sharp lm_head: greedy choices do not hinge on rounding


@pytest.mark.slow
def test_smollm2_layers_are_its_gguf_blocks():
    # The float32 conversion of the packaged GGUF (`smollm2`, the default load, runs its blocks from the file:
    # tests/test_gguf_weights.py): the weights pack_weights recovers the blocks from.
    from int8kv.models import load_model

    model, tokenizer = load_model(quiet=True, weights="dense")
    packed = pack_weights(model)
    kinds = {}
    originals = dict(model.named_modules())
    for name, m in packed.named_modules():
        assert not isinstance(m, torch.nn.Linear), f"{name} was not recovered as blocks"
        if isinstance(m, PackedLinear):
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
            assert torch.equal(m.decoded(), originals[name].weight), name
    assert kinds == {"q4_1": 210, "q8_0": 1}  # 30 layers x 7 Linear in Q4_1; the tied lm_head in Q8_0
    ids = tokenizer("The license grants you the right to copy, modify and share", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits[0, -1].double()
        got = packed(ids).logits[0, -1].double()  # 12 rows: the block kernel
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # The engine's default (packed) against its dense float32 weights, teacher-forced over 40 tokens (F16 K/V:
    # INT8 codes would turn last-bit differences into whole quantization steps): logits within F16 rounding of
    # each other, and the same greedy choice wherever the dense top two are clearly apart (a near-tie may flip
    # under any change of summation order, as between two BLAS builds).
    prompt = tokenizer(" ".join(["the license grants you the right to copy and share"] * 4))["input_ids"][:40]
    got, want = (LLM(model, kv_format=F16, memory="16MiB", tokenizer=tokenizer, weights=w)
                 .score(prompt, chunk_size=4).double() for w in ("model", "dense"))  # fmt: skip
    scale = want.abs().max()
    # Measured 4.7e-4 of the range: F16 K/V storage rounds at 2^-11, and a last-bit change of a K/V element can
    # move its F16 value by one step; a wrong weight or code order moves logits by whole units.
    assert ((got - want).abs().max() / scale).item() < 5e-3
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2 * scale
    assert clear.sum() > 20 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("weights", ["model", "dense"])
def test_cli_engines_pack_for_model_weights_and_not_for_dense(monkeypatch, weights):
    """`int8kv demo / serve` load the model once (`_load`) and hand it to their engines with `_engine_weights`:
    "model" packs the GGUF blocks there (and the engine finds nothing left to pack), "dense" packs nothing."""
    import int8kv.models
    from int8kv import cli

    model = blockwise(tiny("llama", seed=8))
    monkeypatch.setattr(int8kv.models, "load_model", lambda *a, **k: (model, None))
    args = cli.build_parser().parse_args(["demo", "--weights", weights, "--quiet"])
    loaded, _ = cli._load(args)
    packed = [m for m in loaded.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == (15 if weights == "model" else 0)  # 2 layers x 7 Linear and the lm_head
    llm = LLM(loaded, kv_format=F16, memory="2MiB", weights=cli._engine_weights(args))
    assert isinstance(llm.model.lm_head, PackedLinear) == (weights == "model")  # the fused forward's layers
