"""What int16 weights cost an attention output, in numpy (float64): softmax weights of random logits (standard
normal times a spread), each 64-key tile's weights rounded to int16 over the tile's max (what an integer p . v
with `vpdpwssd` would use: docs/results/pv_dpwssd_prototype.py), against the same weights unrounded, relative to
max |out|, 20 trials per case, over values of int8 codes times per-token scales.

    python docs/results/pv_int16_weights_error.py
"""

import numpy as np

rng = np.random.default_rng(0)
for n, spread in ((2048, 1.0), (2048, 3.0), (512, 1.0), (7000, 1.0)):
    errs = []
    for _ in range(20):
        s = rng.standard_normal(n) * spread
        w = np.exp(s - s.max())
        v = rng.integers(-127, 128, (n, 64)).astype(np.float64) * (rng.random((n, 1)) * 0.01 + 0.005)
        exact = w @ v / w.sum()
        wq = np.empty_like(w)
        for t0 in range(0, n, 64):
            blk = w[t0:t0 + 64]
            sc = blk.max() / 32767
            wq[t0:t0 + 64] = np.rint(blk / sc) * sc
        approx = wq @ v / w.sum()
        errs.append(np.abs(approx - exact).max() / np.abs(exact).max())
    print(f"{n} keys, spread {spread}: relative to max|out| median {np.median(errs):.2e}, max {np.max(errs):.2e}")
