"""Decode outputs of the CPU backend over fixed inputs, saved to OUT.npz, to compare two checkouts bit for bit.

    cd TREE && PYTHONPATH=src python docs/results/decode_bits.py OUT.npz

INT8 and F16 pools (head_dim 64 with 3 KV heads x 3, 128 with 2 x 4), five ragged sequences up to 2,100 keys,
exact and int16 precision, plain / window / softcap / sinks / all three, on one numba thread and on two (six
calls each, so the thread choice tries both modes): 80 outputs. Compare two files with
``numpy.array_equal(a[k].view(numpy.uint32), b[k].view(numpy.uint32))`` for every key.
"""
import sys, numpy as np, torch
from int8kv.cache.paged import PagedKvCache
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, attention, plan_attention
import numba
out = {}
for fmt in (KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16):
    for hd, kvh, g in ((64, 3, 3), (128, 2, 4)):
        gen = torch.Generator().manual_seed(7)
        lens = [1, 37, 300, 2100, 700]
        cache = PagedKvCache(sum((n + 15) // 16 for n in lens) + 2, 16, 1, kvh, hd, fmt)
        for s, n in enumerate(lens):
            cache.add_sequence(s, n)
            kv = torch.randn(2, n, kvh, hd, generator=gen)
            append_paged_kv(cache, 0, kv[0], kv[1], cache.slots(s))
        tables, ctx = cache.batch_tensors(list(range(len(lens))), min_blocks=1)
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
                    out[f"{fmt.value}-{hd}-{prec}-{name}-{threads}"] = r.numpy().copy()
np.savez(sys.argv[1], **out)
print(len(out), "outputs")
