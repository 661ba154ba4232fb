"""Outputs of the CPU attention backend over fixed inputs, saved to OUT.npz, to compare two checkouts bit for bit.

    cd TREE && PYTHONPATH=src python docs/results/cpu_bits.py OUT.npz
    python docs/results/cpu_bits.py --compare A.npz B.npz     (the keys whose outputs differ in any bit)

Decode: INT8 and F16 pools (head_dim 64 with 3 KV heads x 3, 128 with 2 x 4), five ragged sequences up to 2,100
keys, exact and int16 precision, plain / window / softcap / sinks / all three, on one numba thread and on two
(six calls each, so the thread choice tries both modes): 80 outputs. Prefill: both formats, SmolLM2's heads,
chunks of 1, 20 and 31 queries over 40, 300 and 700 keys (a one-row item and several-row items), plain / window /
softcap: 6 outputs. Run it with an empty NUMBA_CACHE_DIR and then again with the same one to compare the
kernels as compiled in the process with the same kernels loaded from numba's disk cache.
"""

import sys

import numba
import numpy as np
import torch

from int8kv.cache.paged import PagedKvCache
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, attention, plan_attention

FORMATS = (KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16)


def pool(fmt, lens, kvh, hd, gen):
    cache = PagedKvCache(sum((n + 15) // 16 for n in lens) + 2, 16, 1, kvh, hd, fmt)
    for s, n in enumerate(lens):
        cache.add_sequence(s, n)
        kv = torch.randn(2, n, kvh, hd, generator=gen)
        append_paged_kv(cache, 0, kv[0], kv[1], cache.slots(s))
    return cache, *cache.batch_tensors(list(range(len(lens))), min_blocks=1)


def compare(a_path: str, b_path: str) -> None:
    import json

    a, b = np.load(a_path), np.load(b_path)
    differ = [k for k in a.files if not np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32))]
    print(f"{len(differ)} of {len(a.files)} outputs differ")
    print("json " + json.dumps({"a": a_path, "b": b_path, "outputs": len(a.files), "differ": differ}))


if sys.argv[1] == "--compare":
    compare(sys.argv[2], sys.argv[3])
    sys.exit(0)
out = {}
for fmt in FORMATS:
    for hd, kvh, g in ((64, 3, 3), (128, 2, 4)):
        gen = torch.Generator().manual_seed(7)
        lens = [1, 37, 300, 2100, 700]
        cache, tables, ctx = pool(fmt, lens, kvh, hd, gen)
        q = torch.randn(len(lens), kvh * g, hd, generator=gen)
        for prec in ("exact", "int16"):
            plan = plan_attention(cache.pool, tables, ctx, precision=prec)
            for name, extra in (("plain", {}), ("window", {"window": 100}), ("softcap", {"softcap": 20.0}),
                                ("sinks", {"sinks": torch.randn(kvh * g, generator=gen)}),
                                ("all", {"window": 64, "softcap": 10.0, "sinks": torch.randn(kvh * g, generator=gen)})):
                for threads in (1, 2):
                    numba.set_num_threads(threads)
                    for _ in range(6):  # the thread choice explores both modes
                        r = attention(cache, 0, q, plan, backend="cpu", **extra)
                    out[f"decode-{fmt.value}-{hd}-{prec}-{name}-{threads}"] = r.numpy().copy()
    gen = torch.Generator().manual_seed(7)
    cache, tables, ctx = pool(fmt, [40, 300, 700], 3, 64, gen)
    cu = torch.tensor([0, 1, 21, 52], dtype=torch.int32)
    q = torch.randn(52, 9, 64, generator=gen)
    plan = plan_attention(cache.pool, tables, ctx, cu_seqlens_q=cu)
    for name, extra in (("plain", {}), ("window", {"window": 100}), ("softcap", {"softcap": 20.0})):
        out[f"prefill-{fmt.value}-{name}"] = attention(cache, 0, q, plan, backend="cpu", **extra).numpy().copy()
np.savez(sys.argv[1], **out)
print(len(out), "outputs")
