"""Three small compiled loops of the decode path, as they were (numba indexed them so that LLVM vectorised with
gathers and scattered stores, or not at all) against the package's, in one process on the same inputs.

    PYTHONPATH=src python docs/results/gather_loops_ab.py [OUT.json]

- the int16 query's quantizer (`ops.cpu._quantize_rows`): before, each head's max and rounding indexed
  x[h * d + i] from a range LLVM could not prove non-negative;
- the CPU query check (`ops.cpu.all_finite`): before, a loop over the array's own iterator;
- the write path's split and rotation (`ops.cpu_rope.split_rotate`): before, slices of the heads (strided
  arrays to numba) rotated by indexing x[t, h, i + half], and checks that returned at the first bad value.
The "before" functions are those loops as they stood, kept here only for this comparison. Outputs must be the
same bits. Best of 7 rounds of repeated calls from a jitted loop (no Python call in the timing), us per call, and
before / after.
"""

import json
import sys
import time

import numpy as np
from numba import njit

from int8kv.ops import cpu, cpu_rope


@njit(fastmath=True)
def quantize_before(x, d, sm, codes, scale):
    for h in range(x.shape[0] // d):
        top = np.float32(0.0)
        for i in range(h * d, (h + 1) * d):
            top = max(top, abs(x[i]))
        inv = np.float32(cpu.QUERY_CODE_MAX) / top if top > 0 else np.float32(0.0)
        scale[h] = top / np.float32(cpu.QUERY_CODE_MAX) * sm
        for i in range(h * d, (h + 1) * d):
            codes[i] = np.int16(np.rint(x[i] * inv))
    return 0


@njit(fastmath=True)
def quantize_after(x, d, sm, codes, scale):
    cpu._quantize_rows(x, d, sm, codes, scale)
    return 0


@njit
def finite_before(a):
    ok = True
    for x in a.reshape(-1):
        ok &= x - x == 0
    return ok


@njit
def _neox_before(x, c, s, out):
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                out[t, h, i] = a * c[t, i] - b * s[t, i]
                out[t, h, i + half] = b * c[t, i] + a * s[t, i]


@njit
def rotate_before(qkv, c, s, q, k, v):
    tokens, hq, dim = q.shape
    hkv = k.shape[1]
    for t in range(tokens):
        for j in range(qkv.shape[1]):
            if not np.isfinite(qkv[t, j]):
                return 1
    heads = qkv.reshape(tokens, hq + 2 * hkv, dim)
    _neox_before(heads[:, :hq], c, s, q)
    _neox_before(heads[:, hq : hq + hkv], c, s, k)
    v[:] = heads[:, hq + hkv :]
    for t in range(tokens):
        for h in range(hq):
            for i in range(dim):
                if not np.isfinite(q[t, h, i]):
                    return 2
    return 0


@njit
def finite_after(a):
    return cpu.all_finite(a)


@njit
def rotate_after(qkv, c, s, q, k, v):
    return cpu_rope.split_rotate(qkv, c, s, q, k, v)


def repeat(f):
    @njit
    def loop(n, *args):
        total = 0
        for _ in range(n):
            total += int(f(*args))
        return total

    return loop


def best_us(loop, args, n=20000):
    loop(1, *args)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        loop(n, *args)
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def main() -> None:
    rng = np.random.default_rng(0)
    result = {"command": "PYTHONPATH=src python docs/results/gather_loops_ab.py", "us_per_call": {}}

    def record(name, before, after, args_before, args_after, outputs):
        b, a = best_us(repeat(before), args_before), best_us(repeat(after), args_after)
        same = all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in outputs())
        result["us_per_call"][name] = {"before": b, "after": a, "ratio": b / a, "same_bits": same}
        print(f"{name:34s} before {b:7.3f} us  after {a:7.3f} us  {b / a:5.2f}x  same bits {same}", flush=True)
        assert same

    for hq, d in ((9, 64), (32, 128)):
        x = (rng.standard_normal(hq * d) * 3).astype(np.float32)
        bufs = [(np.empty(hq * d, np.int16), np.empty(hq, np.float32)) for _ in range(2)]
        sm = np.float32(d**-0.5)

        def outputs(bufs=bufs):
            return [(bufs[0][0], bufs[1][0]), (bufs[0][1], bufs[1][1])]

        record(f"quantize query {hq} x {d}", quantize_before, quantize_after, (x, d, sm, *bufs[0]),
               (x, d, sm, *bufs[1]), outputs)
    for shape in ((1, 9, 64), (8, 32, 128)):
        a = rng.standard_normal(shape).astype(np.float32)
        record(f"all_finite {shape}", finite_before, finite_after, (a,), (a,),
               lambda a=a: [(np.array(finite_before(a)), np.array(finite_after(a)))])
    hq, hkv, d = 9, 3, 64
    for tokens in (1, 8):
        qkv = rng.standard_normal((tokens, (hq + 2 * hkv) * d)).astype(np.float32)
        c, s = (rng.standard_normal((tokens, d // 2)).astype(np.float32) for _ in range(2))
        outs = [tuple(np.empty((tokens, h, d), np.float32) for h in (hq, hkv, hkv)) for _ in range(2)]

        def outputs(outs=outs):
            return list(zip(outs[0], outs[1], strict=True))

        record(f"split_rotate {tokens} token(s) 9+3+3 x 64", rotate_before, rotate_after, (qkv, c, s, *outs[0]),
               (qkv, c, s, *outs[1]), outputs)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


main()
