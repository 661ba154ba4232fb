"""The packed kernels' products as raw bits, to compare two builds (AVX-512 against AVX2) of the same code.

    python docs/results/packed_bits.py /tmp/native.npy
    NUMBA_CPU_FEATURES=$(cat docs/results/avx2_features.txt) NUMBA_CACHE_DIR=$(mktemp -d) \\
        python docs/results/packed_bits.py /tmp/avx2.npy
    python docs/results/packed_bits.py --compare /tmp/native.npy /tmp/avx2.npy

A 333 x 1,536 Q4_1 layer times 5 rows and a 200 x 576 Q8_0 layer times 3 rows, blocks from a fixed seed (the
tests' reference quantizer, tests/test_packed_weights.py): 2,265 float32 results, compared as uint32.
"""

import sys
from pathlib import Path

import numpy as np

if sys.argv[1] == "--compare":
    a, b = (np.load(p).view(np.uint32) for p in sys.argv[2:4])
    print(f"{a.size} results, bit for bit equal: {np.array_equal(a, b)}")
    sys.exit(0 if np.array_equal(a, b) else 1)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_packed_weights import nibbles, q4_1_blocks, q8_0_blocks, weights  # noqa: E402

from int8kv.ops import cpu_packed  # noqa: E402

rng = np.random.default_rng(7)
_, q, d, m = q4_1_blocks(weights(rng, 333, 1536))
x = rng.standard_normal((5, 1536)).astype(np.float32)
a = cpu_packed.matmul_q4_1(x, nibbles(q), d, m)
_, q8, d8 = q8_0_blocks(weights(rng, 200, 576))
x8 = rng.standard_normal((3, 576)).astype(np.float32)
b = cpu_packed.matmul_q8_0(x8, q8.reshape(200, 576), d8)
np.save(sys.argv[1], np.concatenate([a.ravel(), b.ravel()]))
