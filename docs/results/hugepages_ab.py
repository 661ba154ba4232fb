"""The CPU decode kernel over the same INT8 pool in 4 KB pages and in 2 MB pages, calls taking turns.

    PYTHONPATH=src python docs/results/hugepages_ab.py [--preset batch8] [--context 4096] [--rounds 60] [OUT.json]

The attention benchmark's INT8 cache (its block table a random permutation of the blocks) copied into two pools
of its shape: one whose memory was marked `MADV_HUGEPAGE` before it was first written (2 MB pages: one TLB entry
covers 128 of batch8's 16 KB blocks), one marked `MADV_NOHUGEPAGE`. Both give the same output (checked); rounds
of 5 calls each, the int16 query. Prints the process's AnonHugePages and the median and best ms per call.
Linux only; the kernel's transparent huge pages must be "always" or "madvise".
"""

import argparse
import ctypes
import json
import statistics

import torch

from int8kv.bench import attention as bench
from int8kv.bench.timing import seconds_in_turns
from int8kv.cache.pool import KvPool
from int8kv.formats import KvStorageFormat
from int8kv.ops import attention
from int8kv.ops.plan import plan_attention

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _copy_in_pages(like: torch.Tensor, huge: bool, keep: list) -> torch.Tensor:
    """A copy of ``like`` in fresh memory, 2 MB aligned, advised before its first write."""
    n = like.numel() * like.element_size()
    raw = torch.empty(n + 2 * HUGE, dtype=torch.uint8)  # large: mmap'ed, not touched yet
    start = (raw.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    if _libc.madvise(start, -(-n // HUGE) * HUGE, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise failed")
    keep.append(raw)
    offset = start - raw.data_ptr()
    out = raw[offset : offset + n].view(like.dtype).view(like.shape)
    out.copy_(like)
    return out


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="batch8")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("out", nargs="?")
    opts = parser.parse_args()
    args = bench.parse_args(["--preset", opts.preset])
    args.batch, args.q_heads, args.kv_heads, args.head_dim, _ = bench.PRESETS[opts.preset]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.q_heads, args.head_dim, generator=gen)
    cache, tables, lens = bench.paged_cache(args, opts.context, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, gen)
    src, keep, pools = cache.pool, [], {}
    for huge in (False, True):
        k = [_copy_in_pages(t, huge, keep).unsqueeze(0) for t in (src.k_codes[0], src.k_scales[0])]
        v = [_copy_in_pages(t, huge, keep).unsqueeze(0) for t in (src.v_codes[0], src.v_scales[0])]
        pools[huge] = KvPool.from_tensors(src.layout, k, v)
    huge_kb = _anon_huge_kb()
    print(f"AnonHugePages: {huge_kb} kB")
    plans = {h: plan_attention(p, tables, lens, precision="int16") for h, p in pools.items()}
    fns = {h: (lambda h=h: attention(pools[h], 0, q, plans[h], backend="cpu")) for h in pools}
    if not torch.equal(fns[False](), fns[True]()):
        raise SystemExit("the two pools gave different outputs")
    for fn in fns.values():
        for _ in range(10):
            fn()
    seconds = seconds_in_turns(fns, opts.rounds, 5)
    rows = {("2M" if h else "4K"): {"median_ms": statistics.median(s) * 1e3, "best_ms": min(s) * 1e3}
            for h, s in seconds.items()}
    for name, row in rows.items():
        print(f"{name} pages: median {row['median_ms']:.3f} ms, best {row['best_ms']:.3f}")
    ratio = rows["4K"]["median_ms"] / rows["2M"]["median_ms"]
    print(f"4K / 2M (medians): {ratio:.3f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"preset": opts.preset, "context": opts.context, "anon_huge_kb": huge_kb, "rows": rows,
                       "ratio_4k_over_2m": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
