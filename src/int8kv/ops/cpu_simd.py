"""Vector micro-kernels for the CPU attention backend, written as LLVM IR (numba intrinsics).

The numba loops of `cpu.py` compute one dot product per key: LLVM vectorises it over head_dim and then pays a
16-lane horizontal sum per (key, query row), and the INT8 codes go through a float32 tile in memory first;
the tile conversion cost more than the dot products. These kernels work on 16 keys at once, straight from the
pool's blocks, which removes both (docs/archive/benchmarks-2026.md, "Decode attention kernel (CPU)"):

  `qk16`  scores of g query rows against 16 keys: 16 vector accumulators (one per key, 16 lanes of head_dim
          each), codes converted once into a scratch, then one transpose-and-add tree turns the 16 accumulators into
          the 16 scores (15 adds and 30 shuffles per row instead of 16 horizontal sums of 8 operations each). Where
          the 16 do not fit in the vector registers (AVX2: 16 of 256 bits), a row runs in passes over head_dim of
          the keys that do (`keys_per_pass`), with the same bits.
  `pv16`  acc[r, :] += sum_t w[r, t] v_t for g rows and 16 values: each value row converted once in registers
          and used by every row; an accumulator chunk stays in a register across the 16 keys.

Both take flat arrays with element offsets and strides (keys: 16 rows, `kstride` elements apart, head_dim
contiguous), so one kernel serves any number of KV heads and any block layout whose head rows are contiguous.
The code element is int8 (INT8 codes: sign-extended, converted to float32), int16 (F16 bits: bitcast to half,
widened) or uint8 (packed 4-bit codes, two a byte, the even channel in the low nibble: `cpu_q4w`'s sealed rows).
4-bit rows are read in place in the split order, a row's even channels then its odd ones (16 bytes hold the
low nibbles of 16 channels and the high ones of 16 more, masked or shifted and converted in registers: no
unpacking pass), so q, the scores' other operand, and the p . v accumulator are in that order too, and dim must
be a multiple of 32; offsets and strides of such rows count bytes. head_dim must be a multiple of 16 (callers
check `fits`); g and head_dim are runtime loop counts, so nothing is specialised per model. The 16 keys are
unrolled; vectors are <16 x float>, which LLVM maps to one AVX-512 register or two AVX2 registers (or four NEON
ones) on other CPUs.

Summation order differs from a plain loop (16 lane sums, then the tree), like any vectorised float32 dot;
the float64-oracle tests bound it.

  `qk16i` the scores of int16 query codes against 16 rows of int8 codes, summed exactly in int32 (|sum| <=
          32,767 x 128 x 512 < 2**31, so head_dim <= 512) and stored as float32: each row multiplies pairs of
          int16 and adds them into int32 lanes, one instruction per 32 (512-bit) or 16 (256-bit) products where
          float32 takes one FMA per 16, then the same tree in integers. The rows go three at a time, each key's
          codes sign-extended to int16 in registers and used by the three (on 512 bits two keys share a vector
          and the tree starts one level down; on 256 bits the keys go in passes whose sums fit the registers).
          Three variants, `DOT` the one the compile target's features allow (the best first): `vnni512`
          (AVX-512 VNNI `vpdpwssd` on zmm), `vnni256` (AVX-VNNI or AVX-512 VNNI + VL on ymm),
          `avx2` (`vpmaddwd` + `vpaddd` on ymm); none on other CPUs, where callers keep the float path. The
          target is numba's (NUMBA_CPU_FEATURES, else the host's), so forcing another variant is
          `NUMBA_CPU_FEATURES=<features with +avx512vnni / +avxvnni turned to ->`, and numba's disk cache, keyed by
          the same string, never hands one variant's code to another. `vnni512` writes the instruction as
          inline assembly: from the intrinsic LLVM 22 tuned for Emerald Rapids emitted 15 of the 16 `vpdpwssd`
          of a chunk as `vpmaddwd` + `vpaddd` (`_dot_step`).

The softmax of a decode row's tile runs here too: `logits16` (the scaled logits and their max) and `weights16`
(exp, the running sum, the value scales folded in), 16 lanes a vector with the tile's ragged end masked, and
`gather16` brings a run's 16 per-token scales of every head in as one vector per head.

p . v stays float32 (`pv16`). int16 weights (each row's 16 weights rounded to int16 with one scale) times int8 value
rows interleaved in pairs, `vpdpwssd` into int32 per 16-key block, makes the dot products faster, but the weights
have to be quantized per row and block (max, scale, round, pack) first, which takes back all of the gain, and the
rounding moves an attention output beyond the int16 path's checks (docs/results/pv_dpwssd_prototype.py;
docs/archive/benchmarks-2026.md, "The 512-bit vpdpwssd as written, and p . v in integers once more"). Converting
int8 rows without byte shuffles (64 codes loaded as 16 int32 lanes, each byte sign-extended in place by a left and
a right shift, the accumulator kept in that permuted order) was slower: the widening is not what limits `pv16`.
With K and V from DRAM the arithmetic is not the limit at all, and prefetching each block's V during the score
pass instead of one block ahead gained nothing beyond the noise.
"""

from __future__ import annotations

import functools
import struct

from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ..numba_cache import require_jit

require_jit(__name__)
# Inline assembly (the 512-bit `vpdpwssd`, `_dot_step`) needs LLVM's assembly parser, which numba leaves out.
binding.initialize_native_asmparser()

__all__ = [
    "DOT", "DOTS", "LANES", "QK16", "QK16I", "absmax16", "array_data", "dot_for", "dots_for", "fits", "gather16",
    "int_fits", "keys_per_pass", "keys_per_row_group", "logits16", "prefetch", "pv16", "qk16", "qk16i",
    "qk16i_kernel", "strided_lanes", "vector_at", "weights16",
]

LANES = 16  # keys per call and float32 lanes per vector
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)
_FAST = ("fast",)


@njit(inline="always", cache=True)
def fits(head_dim: int) -> bool:
    """Whether these kernels handle rows of ``head_dim`` values (callable from Python and from numba code)."""
    return head_dim > 0 and head_dim % LANES == 0


def _mask(lanes: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)


def array_data(context, builder, aryty, value):
    """The element pointer of the numba array ``value`` (LLVM) of type ``aryty``: where an intrinsic's vectors
    start (`vector_at`)."""
    return context.make_array(aryty)(context, builder, value).data


def vector_at(builder, base, offset, ty):
    """A pointer to a ``ty`` vector starting at base[offset] (LLVM values: an element pointer, an int64 offset in
    elements); loads and stores through it say their own alignment."""
    return builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())


def _load_nibbles(builder, base, offset):
    """16 bytes of packed 4-bit codes at base[offset] as two <16 x float>: their low nibbles, their high ones."""
    sixteen = ir.VectorType(ir.IntType(8), LANES)
    raw = builder.load(vector_at(builder, base, offset, sixteen), align=1)
    low = builder.and_(raw, ir.Constant(sixteen, [15] * LANES))
    high = builder.lshr(raw, ir.Constant(sixteen, [4] * LANES))
    return builder.uitofp(low, _VEC), builder.uitofp(high, _VEC)


def _load_codes(builder, base, offset, elem, high=False):
    """16 codes at base[offset] (unaligned) as <16 x float>: int8 sign-extended, int16 read as half bits, or
    (elem `_NIBBLES`) the low nibbles of 16 bytes of packed 4-bit codes, or their high ones (`high`)."""
    if elem is _NIBBLES:
        return _load_nibbles(builder, base, offset)[1 if high else 0]
    raw = builder.load(vector_at(builder, base, offset, ir.VectorType(elem, LANES)), align=1)
    if elem.width == 8:
        return builder.sitofp(raw, _VEC)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VEC)


def _chunks(builder, dim, elem, body):
    """``body(col, offset, high)`` for each 16 channels of a row: col the channel (in the split order for 4-bit
    rows), offset where they start in a row of codes, high whether they are high nibbles. 4-bit rows: the low
    nibbles of the row's dim / 2 bytes, then the high ones, two loops with the nibble known when compiled."""
    i64 = dim.type
    if elem is not _NIBBLES:
        with cgutils.for_range(builder, builder.sdiv(dim, ir.Constant(i64, LANES))) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, LANES))
            body(col, col, False)
        return
    half = builder.sdiv(dim, ir.Constant(i64, 2))
    for high in (False, True):
        with cgutils.for_range(builder, builder.sdiv(dim, ir.Constant(i64, 2 * LANES))) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, LANES))
            body(builder.add(col, half) if high else col, col, high)


def _load_f32(builder, base, offset):
    return builder.load(vector_at(builder, base, offset, _VEC), align=4)


def _store_f32(builder, value, base, offset):
    builder.store(value, vector_at(builder, base, offset, _VEC), align=4)


def _reduce(builder, vecs: list, add, width: int | None = None) -> ir.Value:
    """n vectors of n lanes -> one vector whose lane t is the sum of vecs[t]'s lanes (`add(builder, a, b)` adds
    two vectors). Each level pairs neighbours and halves the lanes each one still spreads over: 16 lanes -> 8
    -> 4 -> 2 -> 1, keeping token order. With ``width`` (< n), each vector already holds n / width tokens in
    turn, `width` lanes each (vector i: tokens i * n / width onwards), and the levels start from there."""
    n = len(vecs) if width is None else vecs[0].type.count
    width = n if width is None else width
    while len(vecs) > 1:
        half = width // 2
        groups = n // width  # tokens already packed per vector, each over `width` lanes
        lo, hi = [], []
        for source in range(2):
            for group in range(groups):
                start = source * n + group * width
                lo += range(start, start + half)
                hi += range(start + half, start + width)
        lo_mask, hi_mask = _mask(lo), _mask(hi)
        vecs = [
            add(builder, builder.shuffle_vector(a, b, lo_mask), builder.shuffle_vector(a, b, hi_mask))
            for a, b in zip(vecs[0::2], vecs[1::2], strict=True)
        ]
        width = half
    return vecs[0]


def _score_args(context, builder, signature, args) -> tuple:
    """`qk16` / `qk16i`'s arguments with each array as its data pointer: q, qoff, k, koff, kstride, out, ooff,
    ostride, rows, dim, then `qk16`'s buf."""
    values = list(args)
    for i in (0, 2, 5, 10):  # q, k, out, buf
        if i < len(values):
            values[i] = array_data(context, builder, signature.args[i], args[i])
    return tuple(values)


def _iadd(builder, a, b):
    return builder.add(a, b)


def _fadd(builder, a, b):
    return builder.fadd(a, b, flags=_FAST)


# The element of packed 4-bit codes (uint8 arrays, two a byte: channel 2j in byte j's low nibble, 2j + 1 in its
# high one), a marker: no LLVM value has this type.
_NIBBLES = ir.IntType(4)


def _check(codes) -> ir.IntType:
    if not isinstance(codes, types.Array) or codes.dtype not in (types.int8, types.int16, types.uint8):
        raise TypingError("codes must be an int8 or int16 array, or uint8 (packed 4-bit codes)")
    return _NIBBLES if codes.dtype == types.uint8 else ir.IntType(codes.dtype.bitwidth)


def _make_qk16(keys: int):
    """`qk16` adding into ``keys`` keys' sums per pass over head_dim (`keys_per_pass`)."""

    def qk16(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
        """out[ooff + r*ostride + t] = sum_i q[qoff + r*dim + i] * k[koff + t*kstride + i] for r < rows, t < 16.

        q: float32 flat array (the rows' values, contiguous by row); k: int8 codes, int16 F16 bits or uint8 packed
        4-bit codes (module docs), flat;
        out: float32 flat; offsets, strides, rows and dim: int64 element counts (dim a multiple of 16); buf: float32
        scratch of at least 16 * dim values. The 16 keys are converted into buf once and read by every row (an FMA
        with a memory operand) rather than converted again for each row: fewer vector operations, though the
        whole kernel is no faster for it."""
        elem = _check(k)
        sig = types.void(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)

        def codegen(context, builder, signature, args):
            qp, qo, kp, ko, ks, op, oo, os_, nrows, d, bp = _score_args(context, builder, signature, args)
            i64 = qo.type
            chunks = builder.sdiv(d, ir.Constant(i64, LANES))
            if elem is _NIBBLES:  # each 16-byte load gives two chunks: the low nibbles' and the high ones'
                half = builder.sdiv(d, ir.Constant(i64, 2))
                with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, 2 * LANES))) as chunk:
                    col = builder.mul(chunk.index, ir.Constant(i64, LANES))
                    key, at = builder.add(ko, col), col
                    for _ in range(LANES):
                        low, high = _load_nibbles(builder, kp, key)
                        _store_f32(builder, low, bp, at)
                        _store_f32(builder, high, bp, builder.add(at, half))
                        key = builder.add(key, ks)
                        at = builder.add(at, d)
            else:
                with cgutils.for_range(builder, chunks) as chunk:
                    col = builder.mul(chunk.index, ir.Constant(i64, LANES))
                    key, at = builder.add(ko, col), col
                    for _ in range(LANES):
                        _store_f32(builder, _load_codes(builder, kp, key, elem), bp, at)
                        key = builder.add(key, ks)
                        at = builder.add(at, d)
            slots = [cgutils.alloca_once(builder, _VEC) for _ in range(LANES)]
            zero = ir.Constant(_VEC, None)
            with cgutils.for_range(builder, nrows) as row:
                for slot in slots:
                    builder.store(zero, slot)
                qrow = builder.add(qo, builder.mul(row.index, d))
                for first in range(0, LANES, keys):  # `keys_per_pass`: the sums a pass keeps in registers
                    with cgutils.for_range(builder, chunks) as chunk:
                        col = builder.mul(chunk.index, ir.Constant(i64, LANES))
                        qv = _load_f32(builder, qp, builder.add(qrow, col))
                        at = builder.add(col, builder.mul(d, ir.Constant(i64, first)))
                        for slot in slots[first : first + keys]:
                            kv = _load_f32(builder, bp, at)
                            acc = builder.load(slot)
                            builder.store(builder.fadd(acc, builder.fmul(qv, kv, flags=_FAST), flags=_FAST), slot)
                            at = builder.add(at, d)
                total = _reduce(builder, [builder.load(slot) for slot in slots], _fadd)
                _store_f32(builder, total, op, builder.add(oo, builder.mul(row.index, os_)))
            return context.get_dummy_value()

        return sig, codegen

    qk16.__name__ = qk16.__qualname__ = f"qk16_keys{keys}"
    return intrinsic(qk16)


QK16 = {keys: _make_qk16(keys) for keys in (4, 8, 16)}  # every pass width, for tests: `qk16` takes this target's


def _registers(features: str) -> tuple[int, int] | None:
    """(vector registers, bits per register) under an LLVM feature string: 32 x 512 with AVX-512, 16 x 256 with
    AVX only; None on other targets (the kernels then keep all 16 keys' sums in one pass, as LLVM allocates them)."""
    on = features.split(",")
    if "+avx512f" in on:
        return 32, 512
    if "+avx" in on:
        return 16, 256
    return None


def keys_per_pass(acc_bits: int, features: str | None = None) -> int:
    """Keys whose running sums (one vector of ``acc_bits`` each) a score kernel keeps in registers in one pass
    over head_dim (`qk16`): all 16 where they fit beside the query chunk and a key chunk, else the largest power
    of two that does. With every key at once on AVX2 (16 registers), `qk16`'s float sums (two ymm each) alone
    needed 32, and 16 int32 sums in one row's pass took 18 registers (LLVM spilled two to the stack and rotated
    ~26 register copies an iteration). The sums of each key see the same additions in the same order either way;
    each pass reloads the query row's chunks (from L1). ``features``: an LLVM feature
    string (default: the compile target's, `target_features`).

    Compiled for AVX2, the passes make the whole decode call faster than every key at once, most for F16, with
    every output the same bits; the AVX-512 code is unchanged (all 16 keys in one pass; docs/results/attention_ab.py,
    docs/archive/benchmarks-2026.md, "The AVX2 score kernels in passes")."""
    regs = _registers(target_features() if features is None else features)
    if regs is None:
        return LANES
    count, bits = regs
    per_sum = max(1, acc_bits // bits)
    keys = LANES
    while keys > 1 and keys * per_sum + 2 * per_sum + 2 > count:  # sums, the query chunk, a key chunk
        keys //= 2
    return keys


# -- integer q . k: int16 query codes x int8 key codes, summed exactly in int32 --------------------------------
# The variants, by the instruction that multiplies 2 x int16 pairs and adds them into int32 lanes. `DOT_WIDTH`:
# int16 values per vector (head_dim must be a multiple of it).
#   vnni512  AVX-512 VNNI `vpdpwssd` on 512 bits (32 int16 per instruction, the accumulate fused)
#   vnni256  AVX-VNNI (or AVX-512 VNNI + VL) `vpdpwssd` on 256 bits
#   avx2     `vpmaddwd` + `vpaddd` on 256 bits
DOTS = ("vnni512", "vnni256", "avx2")
DOT_WIDTH = {"vnni512": 32, "vnni256": 16, "avx2": 16}
# |code| <= 32,767 (query) x 128 (key) x head_dim must stay below 2**31: 512 x 32,767 x 128 = 2,147,418,112.
MAX_DOT_DIM = 512


# What each variant needs (any one of the sets), in the order of preference.
_NEEDS = {"vnni512": ({"avx512f", "avx512bw", "avx512vnni"},), "vnni256": ({"avxvnni"}, {"avx512vl", "avx512vnni"}),
          "avx2": ({"avx2"},)}


def dots_for(features: str) -> list[str]:
    """The integer dot variants an LLVM feature string (``+avx2,-avx512f,...``) allows, best first."""
    on = {f[1:] for f in features.split(",") if f.startswith("+")}
    return [kind for kind in DOTS if any(need <= on for need in _NEEDS[kind])]


def dot_for(features: str) -> str | None:
    """The variant `qk16i` uses under these features; None: none (the float path)."""
    allowed = dots_for(features)
    return allowed[0] if allowed else None


@functools.cache  # numba reads its target once per process; asked by each kernel factory at import, so kept
def target_features() -> str:
    """The features numba compiles for: NUMBA_CPU_FEATURES if set, else the host's (numba's own rule, so the
    variant chosen is always one the compiled code may use, and numba's disk cache, keyed by the same string,
    never serves a kernel built for another variant)."""
    from numba.core import config

    return config.CPU_FEATURES if config.CPU_FEATURES is not None else binding.get_host_cpu_features().flatten()


DOT = dot_for(target_features())  # the variant `qk16i` compiles to on this process's target
qk16 = QK16[keys_per_pass(8 * 4 * LANES)]  # float32 sums of 16 lanes


def _dot_step(kind: str):
    """``step(builder, acc, q, k)``: acc (int32 lanes) + the pairwise products of q and k (int16 lanes)."""
    lanes = DOT_WIDTH[kind] // 2
    acc_ty = ir.VectorType(_I32, lanes)
    if kind == "avx2":
        pair_ty = ir.VectorType(ir.IntType(16), 2 * lanes)
        fnty = ir.FunctionType(acc_ty, [pair_ty, pair_ty])

        def step(builder, acc, q, k):
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx2.pmadd.wd")
            return builder.add(acc, builder.call(fn, [q, k]))

        return step
    fnty = ir.FunctionType(acc_ty, [acc_ty, acc_ty, acc_ty])  # the pairs passed as int32 lanes (LLVM's signature)
    if kind == "vnni512":
        # The instruction itself, as inline assembly: from the intrinsic, LLVM emitted most of them as `vpmaddwd`
        # + `vpaddd`, which is slower and gives the same bits (docs/archive/benchmarks-2026.md, "The 512-bit
        # vpdpwssd as written"). 256 bits keep the intrinsic: on a CPU with
        # AVX-VNNI but no AVX-512 the assembler would have to pick the VEX form of the same mnemonic, which no
        # machine here can run.
        dpwssd = ir.InlineAsm(fnty, "vpdpwssd $3, $2, $0", "=v,0,v,v")

        def step(builder, acc, q, k):
            return builder.call(dpwssd, [acc, builder.bitcast(q, acc_ty), builder.bitcast(k, acc_ty)])

        return step
    name = "llvm.x86.avx512.vpdpwssd.256"

    def step(builder, acc, q, k):
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        return builder.call(fn, [acc, builder.bitcast(q, acc_ty), builder.bitcast(k, acc_ty)])

    return step


# Query rows `qk16i` takes at a time. On 512 bits: 8 int32 accumulators a row (one per key pair) and one query
# vector, so 3 rows hold 27 of the 32 vector registers with the key pair being widened; on AVX2's 16 registers,
# 3 rows x 4 keys a pass (`keys_per_row_group`). One thread, 16 keys a call over 512-2,048 keys hot in cache, ns
# per (key, KV head), the sizes taking turns (docs/results/qk_row_groups.py, qk_row_groups_emr{,_avx2}.json):
# 512 bits, 3 / 4 / 2 rows at a time: 3 rows x 64 2.18 / 2.19 / 2.68, 4 x 128 4.98 / 8.17 / 4.95, 7 x 128 8.30 /
# 10.91 / 9.21, 8 x 256 16.8 / 30.6 / 19.2; AVX2 code, 3 x 4 keys against 2 x 4 and 4 x 2: 3 x 64 4.50 / 5.39 /
# 4.92, 4 x 128 11.27 / 11.04 / 11.06, 7 x 128 17.7 / 19.9 / 18.8.
_ROWS_AT_ONCE = 3


def _direct_rows(builder, step, qp, qo, kp, ko, ks, op, oo, os_, d, row0, group):
    """The 512-bit variant for query rows [row0, row0 + group) against the 16 keys, with no scratch: for each
    16 channels, each row's 16 int16 values (twice, one copy per key of a pair), then each key pair's two 16-byte
    rows joined and sign-extended in registers and one `vpdpwssd` per row into that pair's accumulator (lanes
    0-7 the pair's first key, 8-15 its second); the tree then starts one level down."""
    i64 = qo.type
    i16 = ir.IntType(16)
    half_ty, pair_ty = ir.VectorType(i16, LANES), ir.VectorType(i16, 2 * LANES)
    bytes_ty = ir.VectorType(ir.IntType(8), LANES)
    acc_ty = ir.VectorType(_I32, LANES)

    slots = [[cgutils.alloca_once(builder, acc_ty) for _ in range(LANES // 2)] for _ in range(group)]
    for row in slots:
        for slot in row:
            builder.store(ir.Constant(acc_ty, None), slot)
    with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, LANES))) as chunk:
        col = builder.mul(chunk.index, ir.Constant(i64, LANES))
        qvs = []
        for r in range(group):
            qrow = builder.add(qo, builder.mul(builder.add(row0, ir.Constant(i64, r)), d))
            q16 = builder.load(vector_at(builder, qp, builder.add(qrow, col), half_ty), align=2)
            qvs.append(builder.shuffle_vector(q16, q16, _mask(list(range(LANES)) * 2)))
        key = builder.add(ko, col)
        for pair in range(LANES // 2):
            first = builder.load(vector_at(builder, kp, key, bytes_ty), align=1)
            key = builder.add(key, ks)
            second = builder.load(vector_at(builder, kp, key, bytes_ty), align=1)
            key = builder.add(key, ks)
            kv = builder.sext(builder.shuffle_vector(first, second, _mask(list(range(2 * LANES)))), pair_ty)
            for r in range(group):
                builder.store(step(builder, builder.load(slots[r][pair]), qvs[r], kv), slots[r][pair])
    for r in range(group):
        total = _reduce(builder, [builder.load(slot) for slot in slots[r]], _iadd, width=LANES // 2)
        at = builder.add(oo, builder.mul(builder.add(row0, ir.Constant(i64, r)), os_))
        _store_f32(builder, builder.sitofp(total, _VEC), op, at)


def _direct_rows256(builder, step, qp, qo, kp, ko, ks, op, oo, os_, d, row0, group, keys):
    """The 256-bit variants for query rows [row0, row0 + group): the 16 keys in passes of ``keys`` (a group's
    accumulators, one per row and key, must fit beside the rows' query vectors: 3 x 4 + 3 + 1 of AVX2's 16
    registers), each key's 16 channels sign-extended from memory once per pass and row group and used by every
    row of the group; then each row's 16 sums by two trees of 8."""
    i64 = qo.type
    i16 = ir.IntType(16)
    codes_ty, wide_ty = ir.VectorType(ir.IntType(8), LANES), ir.VectorType(i16, LANES)
    acc_ty = ir.VectorType(_I32, LANES // 2)

    slots = [[cgutils.alloca_once(builder, acc_ty) for _ in range(LANES)] for _ in range(group)]
    for row in slots:
        for slot in row:
            builder.store(ir.Constant(acc_ty, None), slot)
    for first in range(0, LANES, keys):
        with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, LANES))) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, LANES))
            qvs = []
            for r in range(group):
                qrow = builder.add(qo, builder.mul(builder.add(row0, ir.Constant(i64, r)), d))
                qvs.append(builder.load(vector_at(builder, qp, builder.add(qrow, col), wide_ty), align=2))
            key = builder.add(builder.add(ko, col), builder.mul(ks, ir.Constant(i64, first)))
            for t in range(first, first + keys):
                kv = builder.sext(builder.load(vector_at(builder, kp, key, codes_ty), align=1), wide_ty)
                key = builder.add(key, ks)
                for r in range(group):
                    builder.store(step(builder, builder.load(slots[r][t]), qvs[r], kv), slots[r][t])
    for r in range(group):
        sums = [builder.load(slot) for slot in slots[r]]
        half = LANES // 2
        parts = [_reduce(builder, sums[i : i + half], _iadd) for i in (0, half)]
        total = builder.shuffle_vector(parts[0], parts[1], _mask(list(range(LANES))))
        at = builder.add(oo, builder.mul(builder.add(row0, ir.Constant(i64, r)), os_))
        _store_f32(builder, builder.sitofp(total, _VEC), op, at)


def _direct_kernel(builder, step, args, nrows, d, rows_at_once: int = _ROWS_AT_ONCE, rows_block=_direct_rows):
    """``rows_block`` (`_direct_rows`) over every row: whole groups of ``rows_at_once`` in a loop, then the rest
    as one group of its own size (a block per size, picked by a switch)."""
    group = ir.Constant(nrows.type, rows_at_once)
    full = builder.sdiv(nrows, group)
    with cgutils.for_range(builder, full) as index:
        rows_block(builder, step, *args, d, builder.mul(index.index, group), rows_at_once)
    done = builder.append_basic_block("rows_done")
    switch = builder.switch(builder.srem(nrows, group), done)
    for size in range(1, rows_at_once):
        block = builder.append_basic_block(f"rows_left_{size}")
        switch.add_case(ir.Constant(nrows.type, size), block)
        builder.position_at_end(block)
        rows_block(builder, step, *args, d, builder.mul(full, group), size)
        builder.branch(done)
    builder.position_at_end(done)


def keys_per_row_group(features: str | None = None) -> int:
    """Keys a pass of the 256-bit variants takes: the most (a power of two, up to 16) whose accumulators for a
    group of `_ROWS_AT_ONCE` rows fit in the vector registers beside the group's query vectors and a key's."""
    regs = _registers(target_features() if features is None else features)
    count = 32 if regs is None else regs[0]
    keys = LANES
    while keys > 1 and _ROWS_AT_ONCE * keys + _ROWS_AT_ONCE + 1 > count:
        keys //= 2
    return keys


def qk16i_kernel(kind: str, keys: int | None = None):
    """`qk16i` built with the ``kind`` variant's instructions: query rows `_ROWS_AT_ONCE` at a time, each key's
    codes widened to int16 in registers and used by every row of the group. ``keys``: the keys a pass over
    head_dim adds into (256-bit variants; None: `keys_per_row_group`); the 512-bit variant pairs its keys and
    always takes all 16.

    Widening in registers saves a pass that sign-extends the keys into an int16 scratch each row then reads
    back: the same bits, and faster the more keys there are (docs/archive/benchmarks-2026.md, "q . k widened in
    registers")."""
    step = _dot_step(kind)
    default = keys_per_row_group()
    if kind == "vnni512":
        block = _direct_rows
    else:
        keys = default if keys is None else keys

        def block(builder, step, *args):
            _direct_rows256(builder, step, *args, keys)

    def qk16i(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim):
        for arr, dtype, what in ((q, types.int16, "q"), (k, types.int8, "k"), (out, types.float32, "out")):
            if not isinstance(arr, types.Array) or arr.dtype != dtype:
                raise TypingError(f"{what} must be a {dtype} array")
        sig = types.void(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)

        def codegen(context, builder, signature, args):
            qp, qo, kp, ko, ks, op, oo, os_, nrows, d = _score_args(context, builder, signature, args)
            _direct_kernel(builder, step, (qp, qo, kp, ko, ks, op, oo, os_), nrows, d, _ROWS_AT_ONCE, block)
            return context.get_dummy_value()

        return sig, codegen

    passes = "" if kind == "vnni512" or keys == default else f"_keys{keys}"
    qk16i.__name__ = qk16i.__qualname__ = f"qk16_{kind}{passes}"
    qk16i.__doc__ = f"""`qk16i` with the {kind} instructions (see `qk16i`; runs only on CPUs that have them)."""
    return intrinsic(qk16i)


QK16I = {kind: qk16i_kernel(kind) for kind in DOTS}  # every variant, for tests and benchmarks


def _no_dot(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim):
    raise TypingError("this CPU has no integer dot product (AVX2 or VNNI): callers check int_fits")


qk16i = QK16I[DOT] if DOT is not None else intrinsic(_no_dot)
qk16i.__doc__ = """out[ooff + r*ostride + t] = sum_i q[qoff + r*dim + i] * k[koff + t*kstride + i] for r < rows,
t < 16, summed exactly in int32 and stored as float32.

q: int16 flat array (query codes, rows contiguous); k: int8 codes, flat; out: float32 flat; offsets, strides, rows
and dim: int64 element counts (callers check `int_fits(dim)`). The variant is `DOT`, chosen from the compile
target's features."""


# head_dims the integer path takes: multiples of the widest variant's vector on every target, so a head_dim runs
# the same query path on every CPU that has an integer kernel. The 256-bit variants could take multiples of 16,
# but head_dim 16 or 48 would then run int16 on AVX2 and exact on AVX-512: one model's numerics would depend on
# the machine, and tests tuned on one failed on the other (six, on this VM compiled for AVX2).
_DOT_STEP = max(DOT_WIDTH.values()) if DOT is not None else 0  # a plain int, as numba freezes globals


@njit(inline="always", cache=True)
def int_fits(head_dim: int) -> bool:
    """Whether the int16 query path takes rows of ``head_dim`` values: a multiple of 32 up to `MAX_DOT_DIM`
    (whole vectors of every variant, int32 cannot overflow); False everywhere on a target without a variant."""
    return _DOT_STEP > 0 and 0 < head_dim <= MAX_DOT_DIM and head_dim % _DOT_STEP == 0


# Value rows `pv16` converts and holds in registers at a time: all 16 where 32 vector registers hold them
# (AVX-512: 16 zmm), 8 where there are 16 registers of half the width (AVX2: a <16 x float> row takes two ymm, so
# 16 rows spilled to the stack). Each is the faster choice on its target: fewer than 16 on AVX-512 and fewer than
# 8 on AVX2 were slower (docs/archive/benchmarks-2026.md, "The decode softmax in vectors", "The AVX2 code path's
# values, 8 keys a pass").
_PV_KEYS = LANES if "+avx512f" in target_features().split(",") else 8


@intrinsic
def pv16(typingctx, w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    """acc[aoff + r*dim + i] += sum_t w[woff + r*wstride + t] * v[voff + t*vstride + i] for r < rows, t < 16.

    w: float32 flat (the weights, value scales already folded in); v: int8 codes, int16 F16 bits or uint8 packed
    4-bit codes (module docs), flat;
    acc: float32 flat, rows contiguous; offsets, strides, rows and dim: int64 element counts."""
    elem = _check(v)
    sig = types.void(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)

    def codegen(context, builder, signature, args):
        w_arr, wo, ws, v_arr, vo, vs, acc_arr, ao, nrows, d = args
        wp = array_data(context, builder, signature.args[0], w_arr)
        vp = array_data(context, builder, signature.args[3], v_arr)
        ap = array_data(context, builder, signature.args[6], acc_arr)
        i64 = wo.type

        def chunk(col, column, high):
            for first in range(0, LANES, _PV_KEYS):  # the keys a pass converts and keeps in registers
                values = []
                offset = builder.add(builder.add(vo, column), builder.mul(vs, ir.Constant(i64, first)))
                for _ in range(_PV_KEYS):
                    values.append(_load_codes(builder, vp, offset, elem, high))
                    offset = builder.add(offset, vs)
                with cgutils.for_range(builder, nrows) as row:
                    where = builder.add(builder.add(ao, builder.mul(row.index, d)), col)
                    wrow = builder.add(wo, builder.mul(row.index, ws))
                    # Independent chains of four: one chain of 16 dependent adds would wait on the FPU's
                    # latency (4 cycles each) instead of its throughput.
                    chains = [_load_f32(builder, ap, where)] + [None] * (_PV_KEYS // 4 - 1)
                    for t, value in enumerate(values):
                        weight = builder.load(builder.gep(wp, [builder.add(wrow, ir.Constant(i64, first + t))]))
                        term = builder.fmul(_splat(builder, weight), value, flags=_FAST)
                        c = chains[t % len(chains)]
                        chains[t % len(chains)] = term if c is None else builder.fadd(c, term, flags=_FAST)
                    while len(chains) > 1:  # (c0 + c1) + (c2 + c3)
                        chains = [builder.fadd(a, b, flags=_FAST) for a, b in zip(chains[0::2], chains[1::2],
                                                                                   strict=True)]
                    _store_f32(builder, chains[0], ap, where)

        _chunks(builder, d, elem, chunk)
        return context.get_dummy_value()

    return sig, codegen


_LINE = 64  # bytes per cache line on the CPUs this targets (x86-64, most arm64)


@intrinsic
def prefetch(typingctx, array, offset, count):
    """Ask the CPU to start loading elements [offset, offset + count) of a flat array into cache, one request per
    64-byte line; returns at once. The kernels read a block head by head, rows a KV-head apart, an access the
    hardware prefetchers follow poorly when the blocks are scattered: they prefetch the next block whole."""
    if not isinstance(array, types.Array):
        raise TypingError("prefetch takes an array")
    sig = types.void(array, offset, count)

    def codegen(context, builder, signature, args):
        arr, start, n = args
        base = array_data(context, builder, signature.args[0], arr)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        first = builder.bitcast(builder.gep(base, [start]), i8p)
        size = ir.Constant(start.type, context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype)))
        lines = builder.udiv(builder.add(builder.mul(n, size), ir.Constant(start.type, _LINE - 1)),
                             ir.Constant(start.type, _LINE))
        with cgutils.for_range(builder, lines) as line:
            where = builder.gep(first, [builder.mul(line.index, ir.Constant(start.type, _LINE))])
            # read, keep in all cache levels, data cache
            builder.call(fn, [where, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# -- the online softmax of one query row over a tile of scores ------------------------------------------------
# The decode row kernel's softmax, 16 scores a vector. Written in numba loops (`cpu._softmax_step` plus the fold
# of the value scales) it was about three times slower: LLVM vectorised the loops but each row paid their
# remainders, two horizontal reductions and the exp polynomial in scalar for alpha
# (docs/archive/benchmarks-2026.md, "The decode softmax in vectors").
def _f32(value: float) -> float:
    """``value`` rounded to float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


NEG = -1e30  # the finite "minus infinity" of the kernels (`cpu.NEG`)
# exp(x) for x <= 0, here in vectors and in `cpu._exp_nonpos` (the two must give the same bits): the argument
# clamped at EXP_LOW, n = floor(x log2(e) + 1/2), r = x - n ln 2 (Cody-Waite: n * LN2_HI is exact for |n| < 2**15),
# the Taylor polynomial of e^r in Horner form (EXP_POLY, highest degree first), times 2**n. Each a float32 value.
EXP_LOW = -87.0  # keeps 2**n a normal float32
LOG2E = _f32(1.4426950408889634)
LN2_HI = 0.693359375
LN2_LO = _f32(-2.12194440e-4)
EXP_POLY = tuple(_f32(c) for c in (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0))


def _splat(builder, value, ty=_VEC):
    undef = ir.Constant(ty, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(_I32, 0)), undef,
                                  _mask([0] * ty.count))


def _lanes_below(builder, first, n):
    """<16 x i1>: lane j is first + j < n (int64 scalars)."""
    i32v = ir.VectorType(_I32, LANES)
    index = builder.add(_splat(builder, builder.trunc(first, _I32), i32v), _mask(list(range(LANES))))
    return builder.icmp_signed("<", index, _splat(builder, builder.trunc(n, _I32), i32v))


def _fmax(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b, flags=_FAST), a, b)


def _hreduce(builder, vec, op):
    """One float32: `op` of a vector's 16 lanes, halving the width each step."""
    width = LANES
    while width > 1:
        width //= 2
        high = builder.shuffle_vector(vec, vec, _mask([width + i for i in range(width)] + list(range(width, LANES))))
        vec = op(builder, vec, high)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _exp_nonpos_vec(builder, x):
    """`cpu._exp_nonpos` on 16 lanes: the same operations with the same fast-math flags, which LLVM folds as it
    folds them in `cpu._softmax_step`'s vectorised loop: the same weights bit for bit (tests/test_ops_cpu_softmax.py
    checks it; a scalar call of `_exp_nonpos`, folded otherwise, can differ by an ulp)."""
    def const(value):
        return _splat(builder, ir.Constant(_F32, float(_f32(value))))

    def fmul(a, b):
        return builder.fmul(a, b, flags=_FAST)

    x = _fmax(builder, x, const(EXP_LOW))
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]), "llvm.floor.v16f32")
    n = builder.call(floor, [_fadd(builder, fmul(x, const(LOG2E)), const(0.5))])
    r = builder.fsub(builder.fsub(x, fmul(n, const(LN2_HI)), flags=_FAST), fmul(n, const(LN2_LO)), flags=_FAST)
    p = const(EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = _fadd(builder, fmul(p, r), const(c))
    i32v = ir.VectorType(_I32, LANES)
    exponent = builder.shl(builder.add(builder.fptosi(n, i32v), _splat(builder, ir.Constant(_I32, 127), i32v)),
                           _splat(builder, ir.Constant(_I32, 23), i32v))
    return fmul(p, builder.bitcast(exponent, _VEC))


def _check_f32(*arrays):
    for arr in arrays:
        if not isinstance(arr, types.Array) or arr.dtype != types.float32:
            raise TypingError("scores and scales must be float32 arrays")


def _check_scalars_f32(*values):
    if any(value != types.float32 for value in values):
        raise TypingError("the scale and the max must be float32 scalars")


@intrinsic
def logits16(typingctx, s, soff, n, kscale, koff, qscale, floor):
    """s[soff + t] = s[soff + t] * (kscale[koff + t] * qscale) for t < n, and s[soff + t] = NEG for n <= t < the
    next multiple of 16; returns max(floor, those logits). Reads and writes up to that multiple of 16 (callers'
    buffers hold it). s, kscale: float32 flat; soff, n, koff: int64; qscale, floor: float32. The logits are
    `cpu._softmax_step`'s bit for bit (no softcap)."""
    _check_f32(s, kscale)
    _check_scalars_f32(qscale, floor)
    sig = types.float32(s, soff, n, kscale, koff, qscale, floor)

    def codegen(context, builder, signature, args):
        s_arr, so, count, k_arr, ko, qs, lowest = args
        sp = array_data(context, builder, signature.args[0], s_arr)
        kp = array_data(context, builder, signature.args[3], k_arr)
        i64 = so.type
        vectors = builder.sdiv(builder.add(count, ir.Constant(i64, LANES - 1)), ir.Constant(i64, LANES))
        qv = _splat(builder, qs)
        best = cgutils.alloca_once_value(builder, _splat(builder, lowest))
        with cgutils.for_range(builder, vectors) as vec:
            first = builder.mul(vec.index, ir.Constant(i64, LANES))
            x = builder.fmul(_load_f32(builder, sp, builder.add(so, first)),
                             builder.fmul(_load_f32(builder, kp, builder.add(ko, first)), qv, flags=_FAST),
                             flags=_FAST)
            x = builder.select(_lanes_below(builder, first, count), x, _splat(builder, ir.Constant(_F32, NEG)))
            _store_f32(builder, x, sp, builder.add(so, first))
            builder.store(_fmax(builder, builder.load(best), x), best)
        return _hreduce(builder, builder.load(best), _fmax)

    return sig, codegen


@intrinsic
def weights16(typingctx, s, soff, n, mx, vscale, voff):
    """e_t = exp(s[soff + t] - mx) for t < n (`cpu._exp_nonpos`'s bits), stored as s[soff + t] = e_t *
    vscale[voff + t] (the value scales folded into the weights); returns sum_t e_t (summed in 16 lanes, then
    halves). Writes up to the next multiple of 16 (those lanes' weights are 0). s, vscale: float32 flat; soff, n,
    voff: int64; mx: float32, at least every s[soff + t]."""
    _check_f32(s, vscale)
    _check_scalars_f32(mx)
    sig = types.float32(s, soff, n, mx, vscale, voff)

    def codegen(context, builder, signature, args):
        s_arr, so, count, top, v_arr, vo = args
        sp = array_data(context, builder, signature.args[0], s_arr)
        vp = array_data(context, builder, signature.args[4], v_arr)
        i64 = so.type
        vectors = builder.sdiv(builder.add(count, ir.Constant(i64, LANES - 1)), ir.Constant(i64, LANES))
        mv = _splat(builder, top)
        zero = ir.Constant(_VEC, None)
        total = cgutils.alloca_once_value(builder, zero)
        with cgutils.for_range(builder, vectors) as vec:
            first = builder.mul(vec.index, ir.Constant(i64, LANES))
            e = _exp_nonpos_vec(builder, builder.fsub(_load_f32(builder, sp, builder.add(so, first)), mv, flags=_FAST))
            e = builder.select(_lanes_below(builder, first, count), e, zero)
            builder.store(_fadd(builder, builder.load(total), e), total)
            _store_f32(builder, builder.fmul(e, _load_f32(builder, vp, builder.add(vo, first)), flags=_FAST), sp,
                       builder.add(so, first))
        return _hreduce(builder, builder.load(total), _fadd)

    return sig, codegen


def strided_lanes(builder, base, start, step, vector_type):
    """A vector of ``vector_type``'s lane count loaded one element at a time from base[start + j * step] (LLVM
    values: a pointer, two int64 offsets in elements)."""
    vec = ir.Constant(vector_type, ir.Undefined)
    at = start
    for j in range(vector_type.count):
        vec = builder.insert_element(vec, builder.load(builder.gep(base, [at])), ir.Constant(_I32, j))
        at = builder.add(at, step)
    return vec


# Head counts whose 16 rows `gather16` reads as one vector and splits by shuffles (LLVM's permutes) when a row
# of heads is contiguous: the counts where one call for all heads of a 16-token run beats 16 scalar loads and
# inserts per head (at 8 heads only on the native code, a tie on AVX2); other counts keep the per-head loads
# (docs/results/gather_heads_ab.py).
_WIDE_HEADS = (1, 2, 3, 4, 8)


@intrinsic
def gather16(typingctx, src, first, stride, heads, hstep, dst, doff, dstride):
    """dst[doff + h * dstride + j] = src.flat[first + j * stride + h * hstep] for h < heads, j < 16 (element
    offsets into src's buffer, whatever its shape: the caller computes them from src's strides): a block's 16
    per-token scales of every head, which sit a row of heads apart, as one vector per head for `logits16` /
    `weights16`. Where a row of heads is contiguous (hstep 1, stride == heads) and heads is one of
    `_WIDE_HEADS`, the 16 rows are one vector load split by shuffles; otherwise 16 scalar loads per head and one
    vector store. src, dst: float32 arrays; the rest int64."""
    _check_f32(src, dst)
    sig = types.void(src, first, stride, heads, hstep, dst, doff, dstride)

    def codegen(context, builder, signature, args):
        src_arr, start, step, nheads, hop, dst_arr, do, ds = args
        sp = array_data(context, builder, signature.args[0], src_arr)
        dp = array_data(context, builder, signature.args[5], dst_arr)
        i64 = start.type
        done = builder.append_basic_block("gathered")
        apart = builder.append_basic_block("heads_apart")
        rows = builder.and_(builder.icmp_signed("==", hop, ir.Constant(i64, 1)),
                            builder.icmp_signed("==", step, nheads))
        wide = builder.append_basic_block("rows_whole")
        builder.cbranch(rows, wide, apart)
        builder.position_at_end(wide)
        switch = builder.switch(nheads, apart)
        for n in _WIDE_HEADS:
            block = builder.append_basic_block(f"heads_{n}")
            switch.add_case(ir.Constant(i64, n), block)
            builder.position_at_end(block)
            row_ty = ir.VectorType(_F32, LANES * n)
            whole = builder.load(vector_at(builder, sp, start, row_ty), align=4)
            for h in range(n):
                lanes = builder.shuffle_vector(whole, whole, _mask([h + n * j for j in range(LANES)]))
                _store_f32(builder, lanes, dp, builder.add(do, builder.mul(ds, ir.Constant(i64, h))))
            builder.branch(done)
        builder.position_at_end(apart)
        with cgutils.for_range(builder, nheads) as h:
            lanes = strided_lanes(builder, sp, builder.add(start, builder.mul(h.index, hop)), step, _VEC)
            _store_f32(builder, lanes, dp, builder.add(do, builder.mul(ds, h.index)))
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def absmax16(typingctx, x, off, n):
    """max_i |x[off + i]| for i < n, 0 for n = 0 (n a multiple of 16; x float32 flat, finite; off, n int64): 16
    lanes at a time, then halves. The int16 query path's range per head (`cpu._quantize_rows`): numba's loop of
    `max(top, abs(v))` stays scalar, as LLVM does not vectorise that reduction."""
    _check_f32(x, x)
    sig = types.float32(x, off, n)

    def codegen(context, builder, signature, args):
        x_arr, xo, count = args
        xp = array_data(context, builder, signature.args[0], x_arr)
        i64 = xo.type
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]), "llvm.fabs.v16f32")
        best = cgutils.alloca_once_value(builder, ir.Constant(_VEC, None))
        with cgutils.for_range(builder, builder.sdiv(count, ir.Constant(i64, LANES))) as vec:
            first = builder.add(xo, builder.mul(vec.index, ir.Constant(i64, LANES)))
            builder.store(_fmax(builder, builder.load(best), builder.call(fabs, [_load_f32(builder, xp, first)])),
                          best)
        return _hreduce(builder, builder.load(best), _fmax)

    return sig, codegen
