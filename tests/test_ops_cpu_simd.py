"""The vector micro-kernels of the CPU backend (`int8kv.ops.cpu_simd`) against float64, on fresh random inputs:
INT8 codes and F16 bits, any number of rows, head_dims of one to eight vectors, keys at arbitrary strides and
offsets, accumulators that already hold values."""

from __future__ import annotations

import functools
import textwrap

import numpy as np
import pytest
from numba import njit, types
from numba.core.errors import TypingError

from int8kv.ops import cpu_simd
from int8kv.ops.cpu_simd import LANES, pv16, qk16


@njit
def _scores(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
    qk16(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)


@njit
def _accumulate(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    pv16(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)


@functools.cache  # one jitted caller (and compile) per kernel for the whole module
def _qk16_caller(kernel):
    @njit
    def scores(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
        kernel(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)

    return scores


def _codes(rng, n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat codes as the kernels take them and their float64 values."""
    if kind == "int8":
        codes = rng.integers(-127, 128, n, dtype=np.int8)
        return codes, codes.astype(np.float64)
    half = (rng.standard_normal(n) * 3).astype(np.float16)
    return half.view(np.int16), half.astype(np.float64)


def _key_rows(values: np.ndarray, koff: int, kstride: int, dim: int) -> np.ndarray:
    return np.stack([values[koff + t * kstride : koff + t * kstride + dim] for t in range(LANES)])


@pytest.mark.parametrize("kind", ["int8", "f16"])
@pytest.mark.parametrize("seed", range(6))
def test_qk16_matches_float64(kind, seed):
    rng = np.random.default_rng(seed)
    dim = LANES * int(rng.integers(1, 9))
    rows = int(rng.integers(1, 9))
    kstride = dim * int(rng.integers(1, 5)) + LANES * int(rng.integers(0, 3))  # heads apart, or padded
    koff = int(rng.integers(0, 50))
    codes, values = _codes(rng, koff + LANES * kstride + dim, kind)
    qoff, ooff, ostride = int(rng.integers(0, 20)), int(rng.integers(0, 20)), LANES + int(rng.integers(0, 9))
    q = rng.standard_normal(qoff + rows * dim).astype(np.float32)
    out = np.full(ooff + rows * ostride + LANES, np.nan, np.float32)
    _scores(q, qoff, codes, koff, kstride, out, ooff, ostride, rows, dim, np.empty(LANES * dim, np.float32))
    # An AVX2 target runs a row in passes of 4 keys (`keys_per_pass`): each key's sums see the same additions in
    # the same order, so every pass width gives this CPU's kernel's bits.
    for per_pass, kernel in cpu_simd.QK16.items():
        again = np.full(out.shape, np.nan, np.float32)
        _qk16_caller(kernel)(q, qoff, codes, koff, kstride, again, ooff, ostride, rows, dim,
                             np.empty(LANES * dim, np.float32))
        assert np.array_equal(again, out, equal_nan=True), per_pass
    keys = _key_rows(values, koff, kstride, dim)
    qs = q[qoff : qoff + rows * dim].astype(np.float64).reshape(rows, dim)
    want = qs @ keys.T  # [rows, 16]
    got = np.stack([out[ooff + r * ostride : ooff + r * ostride + LANES] for r in range(rows)])
    scale = np.abs(qs) @ np.abs(keys).T  # float32 error bound: relative to the sum of |terms|
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    untouched = np.ones(out.shape, bool)
    for r in range(rows):
        untouched[ooff + r * ostride : ooff + r * ostride + LANES] = False
    assert np.isnan(out[untouched]).all()  # nothing written outside the rows' 16 scores


@pytest.mark.parametrize("kind", ["int8", "f16"])
@pytest.mark.parametrize("seed", range(6))
def test_pv16_matches_float64(kind, seed):
    rng = np.random.default_rng(100 + seed)
    dim = LANES * int(rng.integers(1, 9))
    rows = int(rng.integers(1, 9))
    vstride = dim * int(rng.integers(1, 5))
    voff = int(rng.integers(0, 50))
    codes, values = _codes(rng, voff + LANES * vstride + dim, kind)
    woff, wstride = int(rng.integers(0, 20)), LANES + int(rng.integers(0, 9))
    w = rng.random(woff + rows * wstride).astype(np.float32) * 0.01
    aoff = int(rng.integers(0, 20))
    acc = rng.standard_normal(aoff + rows * dim + 7).astype(np.float32)
    before = acc.astype(np.float64)
    _accumulate(w, woff, wstride, codes, voff, vstride, acc, aoff, rows, dim)
    vals = _key_rows(values, voff, vstride, dim)
    weights = np.stack([w[woff + r * wstride : woff + r * wstride + LANES] for r in range(rows)]).astype(np.float64)
    want = before.copy()
    want[aoff : aoff + rows * dim] += (weights @ vals).reshape(-1)
    scale = np.abs(before).copy()
    scale[aoff : aoff + rows * dim] += (weights @ np.abs(vals)).reshape(-1)
    assert np.all(np.abs(acc - want) <= 1e-5 * scale + 1e-30)
    assert np.array_equal(acc[:aoff], before[:aoff].astype(np.float32))  # outside the rows: unchanged
    assert np.array_equal(acc[aoff + rows * dim :], before[aoff + rows * dim :].astype(np.float32))


def test_keys_per_pass_keeps_the_sums_in_registers():
    avx512 = "+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512vl"
    avx2 = "+avx,+avx2,+fma,+f16c,-avx512f,-avx512bw"
    assert cpu_simd.keys_per_pass(512, avx512) == 16 and cpu_simd.keys_per_pass(256, avx512) == 16
    # 16 ymm registers: float32 sums of 16 lanes take two each, int32 sums of 8 lanes one
    assert cpu_simd.keys_per_pass(512, avx2) == 4 and cpu_simd.keys_per_pass(256, avx2) == 8
    assert cpu_simd.keys_per_pass(512, "+neon,+fp-armv8") == 16  # not x86: one pass, as before
    assert cpu_simd.qk16 is cpu_simd.QK16[cpu_simd.keys_per_pass(512)]
    # `qk16i`'s 256-bit variants: three rows' int32 sums, their query vectors and a key's in the registers
    assert cpu_simd.keys_per_row_group(avx2) == 4 and cpu_simd.keys_per_row_group(avx512) == 8
    assert cpu_simd.keys_per_row_group("+neon,+fp-armv8") == 8


def test_fits_only_whole_vectors():
    assert cpu_simd.fits(64) and cpu_simd.fits(16) and cpu_simd.fits(256)
    assert not cpu_simd.fits(8) and not cpu_simd.fits(40) and not cpu_simd.fits(0)


def test_kernels_refuse_float_codes():
    with pytest.raises(TypingError, match="int8 or int16"):
        _scores(np.zeros(16, np.float32), 0, np.zeros(256, np.float32), 0, 16, np.zeros(16, np.float32), 0, 16, 1,
                16, np.zeros(256, np.float32))


def test_prefetch_reads_nothing_it_changes():
    """A hint only: the array is unchanged and no element outside it is touched (a range past the end is not
    allowed by the callers, so only in-range ranges are tried, from one element to a few lines)."""

    @njit
    def hint(a, offset, count):
        cpu_simd.prefetch(a, offset, count)
        return a.sum()

    rng = np.random.default_rng(3)
    a = rng.integers(-127, 128, 4096, dtype=np.int8)
    before = a.copy()
    for offset, count in ((0, 1), (5, 64), (100, 1000), (4000, 96), (0, 4096)):
        assert hint(a, offset, count) == before.astype(np.int64).sum()
    assert np.array_equal(a, before)


# -- integer q . k (`qk16i` and its variants) ----------------------------------------------------------------
def _qk16i_caller(kind: str, keys: int | None = None):
    kernel = cpu_simd.QK16I[kind] if keys is None else _qk16i_in_passes(kind, keys)

    @njit
    def scores(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim):
        kernel(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)

    return scores


# The CPU each variant is compiled for when this machine cannot run it, and the instruction it must contain.
_VARIANT_CPU = {"vnni512": ("icelake-server", "vpdpwssd"), "vnni256": ("alderlake", "vpdpwssd"),
                "avx2": ("znver3", "vpmaddwd")}
_HOST_FEATURES = cpu_simd.target_features()


@pytest.mark.parametrize("kind,keys", [(kind, None) for kind in cpu_simd.DOTS] + [("vnni256", 4), ("avx2", 8),
                                                                                      ("avx2", 4), ("avx2", 2)])
@pytest.mark.parametrize("seed", range(4))
def test_qk16i_matches_float64(kind, keys, seed):
    """Every variant this CPU can run, exact in int32: full-range int16 query codes, int8 codes including -128,
    head_dims of one to several vectors up to the 512 the int32 sums allow, keys at arbitrary strides; the 256-bit
    variants also in passes of other key counts (how a target with 16 or 32 vector registers runs them)."""
    if kind not in cpu_simd.dots_for(_HOST_FEATURES):
        pytest.skip(f"this CPU lacks {kind}: test_qk16i_variants_compile covers it")
    rng = np.random.default_rng(200 + seed)
    width = cpu_simd.DOT_WIDTH[kind]
    dim = cpu_simd.MAX_DOT_DIM if seed == 0 else width * int(rng.integers(1, 9))
    rows = int(rng.integers(1, 9))
    kstride = dim * int(rng.integers(1, 4)) + LANES * int(rng.integers(0, 3))
    koff = int(rng.integers(0, 50))
    k = rng.integers(-128, 128, koff + LANES * kstride + dim, dtype=np.int8)
    if seed == 0:
        k[:] = -128  # the largest sums: 512 x 32,767 x 128 fits in int32
    qoff, ooff, ostride = int(rng.integers(0, 20)), int(rng.integers(0, 20)), LANES + int(rng.integers(0, 9))
    q = rng.integers(-32767, 32768, qoff + rows * dim, dtype=np.int16)
    if seed == 0:
        q[:] = -32767
    out = np.full(ooff + rows * ostride + LANES, np.nan, np.float32)
    _qk16i_caller(kind, keys)(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)
    keys = _key_rows(k.astype(np.float64), koff, kstride, dim)
    want = q[qoff : qoff + rows * dim].astype(np.float64).reshape(rows, dim) @ keys.T
    got = np.stack([out[ooff + r * ostride : ooff + r * ostride + LANES] for r in range(rows)])
    # exact in int32, then one rounding to float32
    assert np.array_equal(got, want.astype(np.float32))
    untouched = np.ones(out.shape, bool)
    for r in range(rows):
        untouched[ooff + r * ostride : ooff + r * ostride + LANES] = False
    assert np.isnan(out[untouched]).all()


@pytest.mark.parametrize("kind", cpu_simd.DOTS)
@pytest.mark.parametrize("rows", range(1, 11))
def test_qk16i_every_row_count(kind, rows):
    """Each variant this CPU runs at every row count up to 10: rows go three at a time and the rest in a block of
    its own size (`_direct_kernel`), so each remainder and several whole groups run; each row's scores land in
    its own slot and nowhere else."""
    if kind not in cpu_simd.dots_for(_HOST_FEATURES):
        pytest.skip(f"this CPU lacks {kind}: test_qk16i_variants_compile covers it")
    rng = np.random.default_rng(300 + rows)
    dim, kstride, koff = 64, 3 * 64 + 16, 7
    q = rng.integers(-32767, 32768, rows * dim, dtype=np.int16)
    k = rng.integers(-128, 128, koff + LANES * kstride, dtype=np.int8)
    ostride = LANES + 3
    out = np.full(rows * ostride + 8, np.nan, np.float32)
    _qk16i_caller(kind)(q, 0, k, koff, kstride, out, 0, ostride, rows, dim)
    want = q.astype(np.float64).reshape(rows, dim) @ _key_rows(k.astype(np.float64), koff, kstride, dim).T
    got = np.stack([out[r * ostride : r * ostride + LANES] for r in range(rows)])
    assert np.array_equal(got, want.astype(np.float32))
    assert np.isnan(out.reshape(-1)[[r * ostride + LANES + j for r in range(rows) for j in range(3)]]).all()


@functools.cache
def _qk16i_in_passes(kind: str, keys: int):
    return cpu_simd.qk16i_kernel(kind, keys)


# What a variant needs turned on in a feature string, for a child process that compiles it.
_VARIANT_FLAGS = {"vnni512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"), "vnni256": ("avxvnni",),
                  "avx2": ("avx2",)}
_CHILD_COMPILE = textwrap.dedent("""
    import sys
    from numba import njit, types
    from int8kv.ops import cpu_simd
    kernel = cpu_simd.QK16I[sys.argv[1]]

    @njit
    def scores(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim):
        kernel(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)

    a16, a8, f32 = (types.Array(t, 1, "C") for t in (types.int16, types.int8, types.float32))
    i64 = types.int64
    sig = (a16, i64, a8, i64, i64, f32, i64, i64, i64, i64)
    scores.compile(sig)
    print(scores.inspect_asm(sig))
""")


def _variant_compiles_in_a_child(kind: str) -> None:
    """A variant this host's CPU lacks: LLVM cannot emit its instructions for the host (numba aborts the process),
    so a child compiles it with numba's target set to a CPU that has them (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES),
    and its machine code must hold the variant's instruction."""
    import os
    import subprocess
    import sys

    cpu, instruction = _VARIANT_CPU[kind]
    features = cpu_simd.target_features()
    for flag in _VARIANT_FLAGS[kind]:
        features = features.replace(f"-{flag}", f"+{flag}")
        if f"+{flag}" not in features.split(","):
            features += f",+{flag}"
    # The package itself (its kernels' relative imports), with the target this test asks for: INT8KV_CPU=avx2
    # in the parent would turn the variant's features off again in the child.
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features, "INT8KV_CPU": "native"}
    done = subprocess.run([sys.executable, "-c", _CHILD_COMPILE, kind], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert instruction in done.stdout


@pytest.mark.parametrize("kind", cpu_simd.DOTS)
def test_qk16i_variants_compile(kind):
    """Each variant compiled for a CPU that has its instructions (whatever runs the suite), and the instruction
    that makes it worth having is in the machine code."""
    import platform

    from llvmlite import binding

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 variants: numba compiles them for this host first")
    if kind not in cpu_simd.dots_for(cpu_simd.target_features()):
        _variant_compiles_in_a_child(kind)
        return
    scores = _qk16i_caller(kind)
    a16, a8, f32 = types.Array(types.int16, 1, "C"), types.Array(types.int8, 1, "C"), types.Array(types.float32, 1, "C")
    i64 = types.int64
    sig = (a16, i64, a8, i64, i64, f32, i64, i64, i64, i64)
    scores.compile(sig)
    llvm_ir = scores.inspect_llvm(sig)
    cpu, instruction = _VARIANT_CPU[kind]
    module = binding.parse_assembly(llvm_ir)
    machine = binding.Target.from_triple(module.triple or binding.get_process_triple()).create_target_machine(
        cpu=cpu, opt=2)
    asm = machine.emit_assembly(module)
    assert instruction in asm
    if kind == "avx2":
        assert "vpdpwssd" not in asm and "zmm" not in asm  # nothing an AVX2-only CPU lacks


def test_dot_variant_follows_the_features():
    assert cpu_simd.dot_for("+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avxvnni") == "vnni512"
    assert cpu_simd.dot_for("+avx2,+avxvnni,-avx512f") == "vnni256"
    assert cpu_simd.dot_for("+avx2,+avx512f,+avx512vl,+avx512vnni,-avx512bw") == "vnni256"
    assert cpu_simd.dot_for("+avx2,+f16c,-avx512f,-avxvnni") == "avx2"  # the AMD EPYC of the issue
    assert cpu_simd.dot_for("+neon,+fp-armv8") is None and cpu_simd.dot_for("") is None
    assert cpu_simd.dots_for("+avx2,+avx512f,+avx512bw,+avx512vnni") == ["vnni512", "avx2"]  # no VL, no AVX-VNNI
    assert cpu_simd.DOT == cpu_simd.dot_for(cpu_simd.target_features())
    # the integer path takes multiples of 32 on every variant (16 and 48 stay exact on AVX2 too)
    has_dot = cpu_simd.DOT is not None
    for dim in (16, 32, 64, 128, 512, 48, 40, 96, 544, 1024, 0):
        assert cpu_simd.int_fits(dim) == (has_dot and dim % 32 == 0 and 0 < dim <= 512)


def test_qk16i_refuses_other_dtypes():
    scores = _qk16i_caller(cpu_simd.DOT or "avx2")
    with pytest.raises(TypingError, match="q must be a int16"):
        scores(np.zeros(16, np.float32), 0, np.zeros(256, np.int8), 0, 16, np.zeros(16, np.float32), 0, 16, 1, 16)


@njit
def _absmax(x, off, n):
    return cpu_simd.absmax16(x, off, n)


@pytest.mark.parametrize("seed", range(4))
def test_absmax16_is_the_largest_magnitude(seed):
    """Against numpy on fresh inputs, at odd offsets and lengths of 0 to 32 vectors, the largest value placed in
    each lane position in turn and negative as often as positive; nothing outside [off, off + n) counts."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = LANES * int(rng.integers(0, 33))
        off = int(rng.integers(0, 40))
        x = (rng.standard_normal(off + n + 20) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        x[:off] = x[off + n :] = 1e30  # outside the range: must not count
        if n:
            x[off + int(rng.integers(0, n))] = np.float32(rng.choice([-1, 1]) * 1e6)
        expected = float(np.abs(x[off : off + n]).max()) if n else 0.0
        assert _absmax(x, off, n) == expected
