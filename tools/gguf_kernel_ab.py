"""Same-process A/B of two versions of int8kv.ops.cpu_gguf's block kernel (the per-token matvec of decode).

    .venv/bin/python tools/gguf_kernel_ab.py                       # HEAD's cpu_gguf.py against the work tree's
    .venv/bin/python tools/gguf_kernel_ab.py --old git:HEAD~1 --new /tmp/candidate.py --kinds q4_k --threads 1

Each version is loaded as its own module (a copy of the file under /tmp/gguf_ab, imported inside the int8kv.ops
package so its relative imports resolve; numba caches its kernels there), both run on the same random blocks
(finite float16 scales) and the same x, calls taking turns (old, new, old, new, ...), and the table gives each
one's median and best ms per call, ns per weight and new / old (median). Every new output is compared with the
old one: `same` says bit for bit, else the largest difference relative to the output's largest magnitude.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (49152, 2048))  # (n out, k in)
SCALES = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2],
          "q6_k": [208]}  # fmt: skip


def load(source: str, tag: str):
    """The cpu_gguf module of ``source``: a file path, or git:REV (that revision's cpu_gguf.py)."""
    if source.startswith("git:"):
        text = subprocess.run(["git", "show", f"{source[4:]}:src/int8kv/ops/cpu_gguf.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
    else:
        text = Path(source).read_text()
    folder = Path("/tmp/gguf_ab")
    folder.mkdir(exist_ok=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = folder / f"cpu_gguf_{digest}.py"
    if not path.exists() or path.read_text() != text:  # an unchanged file keeps its mtime: numba's cache holds
        path.write_text(text)
    import int8kv.ops  # noqa: F401  (the package the copy is imported into)

    name = f"int8kv.ops._ab_{tag}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def blocks(rng: np.random.Generator, kind: str, n: int, k: int, layouts: dict) -> np.ndarray:
    weights, nbytes = layouts[kind]
    raw = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = (rng.uniform(0.5, 2.0, raw.shape[:2]) * 2.0**-10).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return np.ascontiguousarray(raw.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="git:HEAD")
    ap.add_argument("--new", default=str(ROOT / "src/int8kv/ops/cpu_gguf.py"))
    ap.add_argument("--kinds", default="q4_k,q6_k,q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--check", action="store_true", help="first: every kind, small shapes, 1-9 rows, bit for bit")
    ap.add_argument("--seconds", type=float, default=1.5, help="timing per (kind, shape, rows, threads), both")
    args = ap.parse_args()

    import numba

    from int8kv.numba_threads import launch

    old, new = load(args.old, "old"), load(args.new, "new")
    rng = np.random.default_rng(0)
    if args.check:
        for kind in old.KINDS:
            for n, k in ((1, 256), (2, 512), (3, 256), (7, 768), (64, 1024)):
                w = blocks(rng, kind, n, k, old.LAYOUTS)
                for m in range(1, 10):
                    x = rng.standard_normal((m, k)).astype(np.float32)
                    a, b = old.block_matmul(x, kind, w), new.block_matmul(x, kind, w)
                    assert np.array_equal(a, b), (kind, n, k, m)
                assert np.array_equal(old.dequantize(kind, w), new.dequantize(kind, w)), (kind, n, k)
        print("check: every kind, n 1-64, 1-9 rows of x: new == old bit for bit", flush=True)
    print(f"{'kind':5} {'shape':>11} {'m':>2} {'thr':>3} | {'old med':>8} {'best':>8} | {'new med':>8} {'best':>8}"
          f" | {'old ns/w':>8} {'new ns/w':>8} {'new/old':>7} | check")  # fmt: skip
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = blocks(rng, kind, n, k, old.LAYOUTS)
            for m in (int(v) for v in args.rows.split(",")):
                x = rng.standard_normal((m, k)).astype(np.float32)
                kid_old, kid_new = old.kind_id(kind), new.kind_id(kind)
                out_old = np.empty((m, n), np.float32)
                out_new = np.empty((m, n), np.float32)
                for threads in (int(v) for v in args.threads.split(",")):
                    numba.set_num_threads(threads)
                    launch(old._matmul, kid_old, x, w, out_old)  # compiled, warm
                    launch(new._matmul, kid_new, x, w, out_new)
                    diff = float(np.abs(out_new.astype(np.float64) - out_old).max())
                    check = "same" if np.array_equal(out_old, out_new) else f"{diff / np.abs(out_old).max():.1e}"
                    t_old, t_new = [], []
                    stop = time.perf_counter() + args.seconds
                    while time.perf_counter() < stop or len(t_old) < 5:
                        for fn, kid, out, times in ((old._matmul, kid_old, out_old, t_old),
                                                    (new._matmul, kid_new, out_new, t_new)):  # fmt: skip
                            t0 = time.perf_counter()
                            launch(fn, kid, x, w, out)
                            times.append(time.perf_counter() - t0)
                    mo, mn = statistics.median(t_old) * 1e3, statistics.median(t_new) * 1e3
                    bo, bn = min(t_old) * 1e3, min(t_new) * 1e3
                    print(f"{kind:5} {shape:>11} {m:>2} {threads:>3} | {mo:8.3f} {bo:8.3f} | {mn:8.3f} {bn:8.3f} | "
                          f"{mo * 1e6 / (n * k):8.4f} {mn * 1e6 / (n * k):8.4f} {mn / mo:7.3f} | {check}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
