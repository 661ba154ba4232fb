"""GGUF weights run from the file's own blocks (int8kv.ops.cpu_gguf, int8kv.models.gguf_weights): every kind's
kernels against gguf-py's dequantized values (bit for bit) and a float64 product, the tiny llama.cpp-quantized
fixtures loaded packed against llama.cpp's logits, the engine and the weight conversions on them, the loader's
fallback to the float32 conversion (logged), and typed errors for bad shapes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import numba
import numpy as np
import pytest
import torch
from test_loader import _write_tiny_model

from int8kv import KvStorageFormat
from int8kv.engine import LLM, SamplingParams
from int8kv.errors import InvalidModelError, ShapeMismatch, UnsupportedWeights
from int8kv.models import convert_weights, load_model, loader
from int8kv.models.gguf_weights import GgufEmbedding, GgufLinear, SideBySideLinear, build_model
from int8kv.models.packed import PackedLinear, pack_weights
from int8kv.models.weights import BFloat16Linear, Int8Linear, fused_linear
from int8kv.ops import cpu_gguf, cpu_packed

EPS = 2.0**-24  # float32 unit roundoff
FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "gguf-fixtures"
# Where each kind's float16 scales sit in its block (gguf-py's gguf/quants.py).
SCALE_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q4_k": [0, 2],
                "q5_k": [0, 2], "q6_k": [208]}  # fmt: skip


def qtype(kind: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, kind.upper())


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int, extreme: bool = False) -> np.ndarray:
    """(n, row bytes) uint8: random bytes, with finite float16 scales written into the scale fields: moderate
    (|d| in 2^-12 .. 1), or with ``extreme`` also zeros, negatives, subnormals and the largest float16 values."""
    weights, nbytes = cpu_gguf.LAYOUTS[kind]
    blocks = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    for at in SCALE_FIELDS[kind]:
        d = rng.uniform(-1, 1, blocks.shape[:2]) * 2.0 ** rng.integers(-12, 1, blocks.shape[:2])
        if extreme:
            special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, 1.0])
            d = np.where(rng.random(d.shape) < 0.3, rng.choice(special, d.shape), d)
        blocks[:, :, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def reference(kind: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, qtype(kind))


def assert_within_float32_of_float64(y: np.ndarray, x: np.ndarray, w: np.ndarray, roundings: float) -> None:
    """y (m, n) against x (m, k) @ w (n, k)^T in float64: at most ``roundings`` float32 roundings of sum |x| |w|."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    err = np.abs(y.astype(np.float64) - exact)
    bound = roundings * EPS * magnitude
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-300)).max())


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------------------
SMALL_BLOCK_SHAPES = [(1, 32), (5, 96), (37, 576)]  # (n, k) for the 32-weight kinds: ragged n, a partial scale group
K_SHAPES = [(1, 256), (7, 512), (33, 1280)]


def shapes(kind: str) -> list[tuple[int, int]]:
    return K_SHAPES if kind.endswith("_k") else SMALL_BLOCK_SHAPES


@pytest.mark.parametrize("kind", cpu_gguf.KINDS)
def test_decoded_weights_are_gguf_py_s_bit_for_bit(kind):
    rng = np.random.default_rng()
    for n, k in shapes(kind):
        blocks = random_blocks(rng, kind, n, k, extreme=True)
        want = reference(kind, blocks)
        assert np.array_equal(bits(cpu_gguf.dequantize(kind, blocks)), bits(want))
        assert np.array_equal(bits(cpu_gguf.dequantize(kind, blocks, n // 2, n)), bits(want[n // 2 :]))
        ids = rng.integers(0, n, 9)  # an embedding lookup: any order, repeats
        assert np.array_equal(bits(cpu_gguf.dequantize_rows(kind, blocks, ids)), bits(want[ids]))


@pytest.mark.parametrize("kind", cpu_gguf.KINDS)
def test_matmul_within_float32_rounding_of_float64(kind):
    rng = np.random.default_rng()
    for n, k in shapes(kind):
        blocks = random_blocks(rng, kind, n, k)
        w = reference(kind, blocks)
        for m in (1, 3, 7, 70):  # 70 > DENSE_ROWS: decoded tiles and torch's matmul
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = cpu_gguf.matmul(x, kind, blocks)
            assert y.shape == (m, n) and y.dtype == np.float32
            # the block kernel: k / 32 fused products and sums per lane, then a 6-level tree; torch's matmul: a
            # float32 sum of k products in some order, at most k roundings
            assert_within_float32_of_float64(y, x, w, k / 32 + 6 if m <= cpu_gguf.DENSE_ROWS else k)
        x = rng.standard_normal((3, k)).astype(np.float32)
        assert_within_float32_of_float64(cpu_gguf.block_matmul(x, kind, blocks), x, w, k / 32 + 6)
        assert_within_float32_of_float64(cpu_gguf.dense_matmul(x, kind, blocks), x, w, k)


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    rng = np.random.default_rng()
    for kind in ("q4_k", "q5_0"):
        blocks = random_blocks(rng, kind, 300, 512)
        x = rng.standard_normal((6, 512)).astype(np.float32)
        together = cpu_gguf.block_matmul(x, kind, blocks)
        for i in range(6):
            assert np.array_equal(bits(cpu_gguf.block_matmul(x[i : i + 1].copy(), kind, blocks)[0]), bits(together[i]))
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            assert np.array_equal(bits(cpu_gguf.block_matmul(x, kind, blocks)), bits(together))
        finally:
            numba.set_num_threads(threads)


def test_q4_1_and_q8_0_rows_are_cpu_packed_s_bit_for_bit():
    """The same 32 lanes and tree as int8kv.ops.cpu_packed: a model that ran PackedLinear layers gets the very same
    numbers from the file's blocks."""
    rng = np.random.default_rng()
    n, k = 40, 576
    for kind in ("q4_1", "q8_0"):
        blocks = random_blocks(rng, kind, n, k)
        raw = blocks.reshape(n, k // 32, -1)
        d = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "q4_1":
            parts = (np.ascontiguousarray(raw[:, :, 4:].reshape(n, -1)), d,
                     raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))  # fmt: skip
        else:
            parts = (np.ascontiguousarray(raw[:, :, 2:].reshape(n, -1)).view(np.int8), d)
        for m in (1, 5):
            x = rng.standard_normal((m, k)).astype(np.float32)
            assert np.array_equal(bits(cpu_gguf.block_matmul(x, kind, blocks)), bits(cpu_packed.matmul_rows(x, parts)))


def test_bad_shapes_and_kinds_raise_typed_errors():
    blocks = np.zeros((4, 2 * 144), np.uint8)  # q4_k rows of 512 weights
    with pytest.raises(UnsupportedWeights, match="no GGUF block kernel for 'q2_k'"):
        cpu_gguf.matmul(np.zeros((1, 512), np.float32), "q2_k", blocks)
    for bad in (blocks[:, :100].copy(), blocks.astype(np.int8), blocks[:, ::2], blocks.reshape(-1), blocks[:0]):
        with pytest.raises(ShapeMismatch):
            cpu_gguf.matmul(np.zeros((1, 512), np.float32), "q4_k", bad)
    for x in (np.zeros((1, 256), np.float32), np.zeros((1, 512)), np.zeros(512, np.float32),
              np.zeros((512, 2), np.float32).T):  # fmt: skip
        with pytest.raises(ShapeMismatch):
            cpu_gguf.matmul(x, "q4_k", blocks)
    with pytest.raises(IndexError, match="row id 4 is outside"):
        cpu_gguf.dequantize_rows("q4_k", blocks, [0, 4])
    with pytest.raises(ShapeMismatch):
        cpu_gguf.dequantize("q4_k", blocks, 3, 5)
    layer = GgufLinear("q4_k", torch.from_numpy(blocks), None, 512)
    with pytest.raises(ShapeMismatch, match="expected inputs of 512 features"):
        layer(torch.zeros(2, 256))
    with pytest.raises(ShapeMismatch, match="rows of 512 weights, expected 256"):
        GgufLinear("q4_k", torch.from_numpy(blocks), None, 256)
    with pytest.raises(ShapeMismatch, match="bias"):
        GgufLinear("q4_k", torch.from_numpy(blocks), torch.zeros(3), 512)
    with pytest.raises(UnsupportedWeights):
        GgufLinear("iq2_xxs", torch.from_numpy(blocks), None, 512)


def test_gguf_linear_fusing_and_conversions(monkeypatch):
    rng = np.random.default_rng()
    parts = [GgufLinear("q4_k", torch.from_numpy(random_blocks(rng, "q4_k", n, 256)), None, 256) for n in (24, 8)]
    v = GgufLinear("q6_k", torch.from_numpy(random_blocks(rng, "q6_k", 8, 256)), None, 256)
    x = torch.randn(3, 256)
    fused = fused_linear(parts)  # one kind, small: the block rows concatenate (one kernel call)
    assert isinstance(fused, GgufLinear) and fused.out_features == 32
    with monkeypatch.context() as m:
        m.setattr("int8kv.models.weights.CONCAT_BYTES", 1024)  # large: side by side, no copy of the mapping
        apart = fused_linear(parts)
    assert isinstance(apart, SideBySideLinear) and apart.out_features == 32
    assert all(a.blocks is b.blocks for a, b in zip(apart.parts, parts, strict=True))
    assert torch.equal(apart(x), fused(x))
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))  # a row is the same in any company
    mixed = fused_linear([*parts, v])  # Q4_K q / k with a Q6_K v: side by side, each on its own blocks
    assert isinstance(mixed, SideBySideLinear) and mixed.out_features == 40
    assert torch.equal(mixed(x), torch.cat([p(x) for p in (*parts, v)], dim=-1))
    assert fused_linear(parts[:1]) is parts[0]
    with pytest.raises(UnsupportedWeights, match="different precisions"):
        fused_linear([parts[0], Int8Linear(torch.randn(8, 256), None)])
    assert torch.equal(fused.float_weights()[0], torch.cat([p.decoded() for p in parts]))
    assert torch.equal(BFloat16Linear(*v.float_weights()).weight, v.decoded().bfloat16())


# ------------------------------------------------------------------------------------------------------------
# the tiny llama.cpp-quantized models (tests/../../shared/gguf-fixtures)
# ------------------------------------------------------------------------------------------------------------
def fixture_path(name: str) -> Path:
    path = FIXTURES / f"tiny-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"the GGUF fixtures are not here ({FIXTURES}: the repository's ../shared/gguf-fixtures)")
    return path


@pytest.fixture(scope="module")
def reference_logits():
    path = FIXTURES / "llamacpp_reference_logits.json"
    if not path.is_file():
        pytest.skip(f"the GGUF fixtures are not here ({FIXTURES}: the repository's ../shared/gguf-fixtures)")
    return json.loads(path.read_text())


_LOADED: dict[str, tuple] = {}


def packed(name: str):
    """(model, tokenizer) of a fixture loaded packed, once per test session (its config, tokenizer and tensor table
    are kept in the session's model cache, tests/conftest.py)."""
    if name not in _LOADED:
        _LOADED[name] = load_model(fixture_path(name), quiet=True)
    return _LOADED[name]


# The README's tensor types, as the loaded modules hold them: 2 layers x 7 Linear, the tied output head (the
# embedding's blocks) and the embedding.
KINDS = {
    "Q4_K_M": ({"q4_k": 12, "q6_k": 3}, "q6_k"),
    "Q5_K_M": ({"q5_k": 12, "q6_k": 3}, "q6_k"),
    "Q8_0": ({"q8_0": 15}, "q8_0"),
    "Q4_0": ({"q4_0": 14, "q6_k": 1}, "q6_k"),
}
LLAMA_CPP_DISTANCE = 1.3  # README: float-activation logits against llama.cpp's, logits reaching +-117


@pytest.mark.parametrize("name", list(KINDS))
def test_fixture_loads_packed_and_agrees_with_llama_cpp(name, reference_logits):
    model, _ = packed(name)
    linear, embedding = KINDS[name]
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, GgufLinear):
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
    assert kinds == linear
    assert isinstance(model.model.embed_tokens, GgufEmbedding) and model.model.embed_tokens.kind == embedding
    assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()  # tied: shared, not copied
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(p.ndim == 1 for p in model.parameters())  # norms only: no float matrix anywhere
    ref = reference_logits["files"][name]
    ids = reference_logits["prompt_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    top = logits.max(-1).values.numpy()
    assert np.abs(top - np.array(ref["max_logit"])).max() <= LLAMA_CPP_DISTANCE
    probes = logits[:, reference_logits["probe_ids"]].numpy()
    assert np.abs(probes - np.array(ref["probe_logits"])).max() <= 2 * LLAMA_CPP_DISTANCE
    ours, theirs = logits.argmax(-1).numpy(), np.array(ref["argmax"])
    agree = float((ours == theirs).mean())
    # llama.cpp rounds activations to 8 bits in its dot products; where it chose another token, its choice is a
    # near-tie in these logits (within the README's distance of the top one). Q5_K_M: 22 of 24 positions agree
    # (top-2 gaps 0.03 and 0.07 where they do not), as they do for transformers' float32 forward over the same
    # weights (test_q5_k_m_logits_are_transformers_float32_ones); the other three files agree on >= 23 of 24.
    assert agree >= (0.9 if name == "Q5_K_M" else 0.95), agree
    for pos in np.nonzero(ours != theirs)[0]:
        assert logits[pos, ours[pos]] - logits[pos, theirs[pos]] <= LLAMA_CPP_DISTANCE


def test_q5_k_m_logits_are_transformers_float32_ones(reference_logits):
    """The packed model against transformers' own float32 conversion of the same file (the old path): the same
    weights, so the same logits up to float32 summation order."""
    path = fixture_path("Q5_K_M")
    model, _ = packed("Q5_K_M")
    dense, _ = load_model(path, quiet=True, weights="dense")
    assert isinstance(dense.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert torch.equal(dense.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.decoded())
    ids = reference_logits["prompt_ids"]
    with torch.no_grad():
        want = dense(torch.tensor([ids])).logits[0].double()
        got = model(torch.tensor([ids[:9]])).logits[0].double()  # 9 rows: the block kernel
    assert ((got - want[:9]).abs().max() / want.abs().max()).item() < 1e-5
    assert torch.equal(got.argmax(-1), want[:9].argmax(-1))


def test_engine_runs_a_packed_fixture(reference_logits):
    """The fused forward on GGUF blocks: the embedding looked up from its blocks, layer 1's Q4_K q / k beside its
    Q6_K v side by side; chunks of 5 rows (the block kernel). F16 K/V adds ~2^-11 per element."""
    model, _ = packed("Q4_K_M")
    ids = reference_logits["prompt_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double()
    llm = LLM(model, kv_format=KvStorageFormat.F16, memory="4MiB", implementation="fused", backend="reference")
    assert isinstance(llm.model.embed, GgufEmbedding) and isinstance(llm.model.layers[1].qkv, SideBySideLinear)
    assert isinstance(llm.model.layers[0].qkv, GgufLinear) and isinstance(llm.model.lm_head, GgufLinear)
    got = llm.score(ids, chunk_size=5).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    out = llm.generate([ids[:6]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "dense"])
def test_converted_weights_come_from_the_blocks_one_layer_at_a_time(weights, reference_logits):
    model, _ = packed("Q4_0")
    converted = convert_weights(model, weights)  # a copy: the blocks it keeps (the embedding) are shared
    assert not any(isinstance(m, GgufLinear) for m in converted.modules())
    cls = {"bfloat16": BFloat16Linear, "int8": Int8Linear, "dense": torch.nn.Linear}[weights]
    assert isinstance(converted.model.layers[1].mlp.down_proj, cls)
    if weights == "dense":
        assert torch.equal(converted.lm_head.weight, model.lm_head.decoded())
    assert isinstance(model.lm_head, GgufLinear)  # the original is untouched
    assert converted.model.embed_tokens.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()
    ids = reference_logits["prompt_ids"][:12]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
        got = converted(torch.tensor([ids])).logits[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < (1e-5 if weights == "dense" else 0.1)


def test_a_mismatched_table_is_refused_by_name():
    path = fixture_path("Q8_0")
    model, _ = packed("Q8_0")
    table = json.loads((loader.packed_cache_dir(path) / loader._TABLE).read_text())
    entry = next(t for t in table["tensors"] if t["name"] == "blk.0.ffn_up.weight")
    entry["shape"] = [entry["shape"][0] // 2, entry["shape"][1] * 2]
    with pytest.raises(InvalidModelError, match="blk.0.ffn_up.weight has shape"):
        build_model(path, table, model.config)
    table["tensors"] = [t for t in table["tensors"] if t["name"] != "blk.1.attn_norm.weight"]
    entry["shape"] = [entry["shape"][0] * 2, entry["shape"][1] // 2]
    with pytest.raises(InvalidModelError, match="holds no tensor for model.layers.1.input_layernorm.weight"):
        build_model(path, table, model.config)


# ------------------------------------------------------------------------------------------------------------
# qwen2 / qwen3 / llama files with every kind: the packed model is transformers' own conversion of the file
# ------------------------------------------------------------------------------------------------------------
Q = gguf.GGMLQuantizationType
EVERY_KIND = {"token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q5_0, "attn_k": Q.Q5_1, "attn_v": Q.Q4_1,
              "attn_output": Q.Q5_K, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_K, "ffn_down": Q.Q8_0}  # fmt: skip


def write_random_model(path: Path, arch: str, qtypes: dict, vocab: int = 600, hidden: int = 256, heads: int = 2,
                       kv_heads: int = 1, ffn: int = 512, layers: int = 2) -> None:  # fmt: skip
    """A random ``arch`` GGUF (untied output head, qwen2's q / k / v biases, qwen3's q / k norms) whose tensors have
    the types ``qtypes`` names (by GGUF short name; F32 otherwise), with a small byte-level BPE vocabulary."""
    rng = np.random.default_rng(11)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    hd = 128 if arch == "qwen3" else hidden // heads  # transformers reads no head size for qwen3: its default
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    chars = [chr(b) for b in (*range(33, 127), *range(161, 173), *range(174, 256))]  # GPT-2's byte characters
    chars += [chr(256 + i) for i in range(256 - len(chars))]
    pairs = [(a, b) for a in "Ġthe" for b in "thera"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, *(a + b for a, b in pairs)]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges([f"{a} {b}" for a, b in pairs])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, n: int, k: int) -> None:
        t = qtypes.get(name.split(".")[-2], Q.F32)
        if t == Q.F32:
            w.add_tensor(name, (rng.standard_normal((n, k)) * 0.05).astype(np.float32))
            return
        blocks = random_blocks(rng, t.name.lower(), n, k).reshape(n, k // gguf.GGML_QUANT_SIZES[t][0], -1)
        for at in SCALE_FIELDS[t.name.lower()]:  # small scales: sums of random codes stay moderate
            d = (rng.uniform(-1, 1, blocks.shape[:2]) * 2.0**-7).astype(np.float16)
            blocks[:, :, at : at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
        w.add_tensor(name, blocks.reshape(n, -1), raw_dtype=t)

    def vector(name: str, n: int, scale: float = 0.2, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + scale * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    if "output" in qtypes:
        matrix("output.weight", vocab, hidden)
    vector("output_norm.weight", hidden)
    for i in range(layers):
        for name, n, k in (("attn_q", heads * hd, hidden), ("attn_k", kv_heads * hd, hidden),
                           ("attn_v", kv_heads * hd, hidden), ("attn_output", hidden, heads * hd),
                           ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):  # fmt: skip
            matrix(f"blk.{i}.{name}.weight", n, k)
        vector(f"blk.{i}.attn_norm.weight", hidden)
        vector(f"blk.{i}.ffn_norm.weight", hidden)
        if arch == "qwen2":
            for name, n in (("attn_q", heads * hd), ("attn_k", kv_heads * hd), ("attn_v", kv_heads * hd)):
                vector(f"blk.{i}.{name}.bias", n, 0.1, 0.0)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", hd)
            vector(f"blk.{i}.attn_k_norm.weight", hd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_every_kind_loads_packed_as_transformers_converts_it(tmp_path, arch):
    """Names, llama's q / k row order, biases, QK norms and an untied head: the packed model against transformers'
    float32 conversion of the same file, on the block kernel (12 rows) and decoded tiles (20 rows)."""
    path = tmp_path / f"{arch}.gguf"
    write_random_model(path, arch, EVERY_KIND)
    model, tokenizer = load_model(path, cache_dir=tmp_path / "models", quiet=True)
    dense, _ = load_model(path, cache_dir=tmp_path / "models", quiet=True, weights="dense")
    classes = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
    assert type(model).__name__ == classes[arch]
    kinds = {m.kind for m in model.modules() if isinstance(m, GgufLinear)}
    assert kinds == set(cpu_gguf.KINDS) and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.kind == "q6_k" and model.model.embed_tokens.kind == "q8_0"  # untied: its own blocks
    attn = model.model.layers[1].self_attn
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    assert torch.equal(attn.k_proj.decoded(), dense.model.layers[1].self_attn.k_proj.weight)
    ids = tokenizer("the heat, the rest: there").input_ids
    ids = (ids * 4)[:20]
    with torch.no_grad():
        want = dense(torch.tensor([ids])).logits[0].double()
        for rows in (12, 20):
            got = model(torch.tensor([ids[:rows]])).logits[0].double()
            assert ((got - want[:rows]).abs().max() / want.abs().max()).item() < 1e-5, rows


# ------------------------------------------------------------------------------------------------------------
# the loader's fallback: logged, never silent
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def converter(monkeypatch):
    """The float32 conversion replaced by a tiny model: which files fell back to it."""
    calls = []

    def convert(path: Path, out_dir: Path) -> None:
        calls.append(path.name)
        _write_tiny_model(out_dir)

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return calls


def _write_gguf(path: Path, arch: str, raw_type: gguf.GGMLQuantizationType | None) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    if raw_type is not None:
        nbytes = gguf.GGML_QUANT_SIZES[raw_type][1]
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, nbytes), np.uint8), raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, raw_type, reason", [
    ("llama", gguf.GGMLQuantizationType.Q2_K, "tensor blk.0.ffn_up.weight has type Q2_K"),
    ("llama", gguf.GGMLQuantizationType.IQ4_NL, "has type IQ4_NL"),
    ("gpt2", None, "architecture 'gpt2'"),
])  # fmt: skip
def test_unsupported_files_fall_back_with_the_reason_logged(tmp_path, converter, caplog, monkeypatch, arch, raw_type,
                                                            reason):  # fmt: skip
    path = tmp_path / "odd.gguf"
    _write_gguf(path, arch, raw_type)
    cache = tmp_path / "models"
    with caplog.at_level(logging.WARNING, logger="int8kv.models"):
        model, _ = load_model(path, cache_dir=cache, quiet=True)
    assert converter == ["odd.gguf"] and isinstance(model.lm_head, torch.nn.Linear)
    warned = [r.getMessage() for r in caplog.records if r.name == "int8kv.models" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and reason in warned[0] and "float32 conversion" in warned[0]
    # The reason is kept with the file's table: a second load does not parse the file again, and says it again.
    from int8kv.models import gguf_weights

    monkeypatch.setattr(gguf_weights, "read_table", lambda p: pytest.fail("parsed again"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="int8kv.models"):
        load_model(path, cache_dir=cache, quiet=True)
    assert converter == ["odd.gguf"] and any(reason in r.getMessage() for r in caplog.records)


def test_a_truncated_file_falls_back_with_the_reason_logged_then_fails_typed(tmp_path, caplog):
    path = tmp_path / "cut.gguf"
    with fixture_path("Q8_0").open("rb") as f:
        path.write_bytes(f.read(6 << 20))
    with caplog.at_level(logging.WARNING, logger="int8kv.models"), pytest.raises(InvalidModelError):
        load_model(path, cache_dir=tmp_path / "models", quiet=True)
    assert any("cut.gguf" in r.getMessage() and "gguf-py cannot read" in r.getMessage() for r in caplog.records)
    assert not any(p.name.startswith("cut-packed") for p in (tmp_path / "models").iterdir())  # nothing cached


def test_dense_and_other_devices_take_the_float32_conversion(tmp_path, converter, caplog):
    path = tmp_path / "tiny-Q8_0.gguf"
    shutil.copy(fixture_path("Q8_0"), path)
    with caplog.at_level(logging.WARNING, logger="int8kv.models"):
        load_model(path, cache_dir=tmp_path / "models", quiet=True, weights="dense")
    assert converter == ["tiny-Q8_0.gguf"]
    assert not [r for r in caplog.records if r.name == "int8kv.models"]  # asked for: nothing to warn about
    with caplog.at_level(logging.WARNING, logger="int8kv.models"):
        model, _ = load_model(path, cache_dir=tmp_path / "models", quiet=True, device="meta")
    assert next(model.parameters()).device.type == "meta" and converter == ["tiny-Q8_0.gguf"]
    assert any("run on the CPU only" in r.getMessage() for r in caplog.records if r.name == "int8kv.models")
    with pytest.raises(UnsupportedWeights):
        load_model(path, cache_dir=tmp_path / "models", quiet=True, weights="float64")


# ------------------------------------------------------------------------------------------------------------
# the packaged SmolLM2: the same weights and greedy outputs either way
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_packed_is_its_float32_conversion(smollm2):
    """The packaged SmolLM2 loads packed (tests/conftest.py's `smollm2`): its Q4_1 layers and Q8_0 embedding / tied
    head decode to the float32 conversion's weights bit for bit, multiply as PackedLinear does (recovered from
    those weights, int8kv.models.packed) bit for bit, and generate the same greedy tokens."""
    model, tokenizer = smollm2
    dense, _ = load_model(quiet=True, weights="dense")
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, GgufLinear):
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
    assert kinds == {"q4_1": 210, "q8_0": 1} and model.model.embed_tokens.kind == "q8_0"
    old = pack_weights(dense)
    ids = torch.tensor([[1, 504, 3575, 49151, 282]])
    assert torch.equal(model.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    ours, theirs = dict(model.named_modules()), dict(old.named_modules())
    x = torch.randn(3, 576)
    for name in ["lm_head"] + [f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")]:
        assert isinstance(theirs[name], PackedLinear)
        assert torch.equal(ours[name].decoded(), dense.get_submodule(name).weight), name
        assert torch.equal(ours[name].block_product(x), theirs[name].block_product(x)), name
    x = torch.randn(3, 1536)
    assert torch.equal(ours["model.layers.5.mlp.down_proj"].block_product(x),
                       theirs["model.layers.5.mlp.down_proj"].block_product(x))  # fmt: skip
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    text = " ".join(["the license grants you the right to copy and share"] * 3)  # 33 tokens: decoded tiles
    prompts = [tokenizer("The capital of France is")["input_ids"], tokenizer(text)["input_ids"]]
    a = [o.token_ids for o in LLM(model, memory="16MiB", tokenizer=tokenizer).generate(prompts, params)]
    b = [o.token_ids for o in LLM(old, memory="16MiB", tokenizer=tokenizer).generate(prompts, params)]
    assert a == b
