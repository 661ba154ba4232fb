"""CPU decode attention over int4_kchan64_vtok_asym_sink4_win64_v1 (ops.cpu_q4w) against the INT8 and F16 paged
kernels, same rows, same queries, same run.

    python -m int8kv.bench q4w_attention [--preset batch8|smollm2|all] [--context N] [--repeat 30] [--threads N]
        [--json PATH]

One decode step (one query token per sequence) through ``ops.attention(..., backend="cpu")``. The same random
K/V rows (keys with per-channel offsets, as real keys have) are written through the write path into an INT8
and an F16 paged cache (16-position blocks) and into an :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool`
(64-position pages, sealed as the rows arrive: at 4,096 positions 63 sealed pages and 64 F16 window rows per
sequence), block tables a random permutation. The kernels take turns (bench attention's interleaved bursts) and
each reports its best and median call; each picks one thread or all of numba's (``--threads``, default all) by
what it measured (cpu.ThreadChoice). Shapes: batch8 = 8 sequences, 32 query / 8 KV heads x 128, 4,096
positions; smollm2 = 1 sequence, 9 / 3 x 64, 7,000 positions; ``--context N``: N positions per sequence instead.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .. import quant4w
from ..cache.paged import PagedKvCache
from ..cache.pool_q4w import PAGE, Int4SinkWindowPool
from ..formats import KvStorageFormat
from ..ops import append_paged_kv, attention, plan_attention
from .attention import PRESETS, interleaved_samples
from .kv4_attention import SHAPES, decode_args, heading, run_rows
from .timing import emit

CHUNK = 512  # positions per sequence per prefill step of the pool's write path
KINDS = ("int8_paged", "f16_paged", "q4w")


def _caches(batch: int, heads: int, d: int, context: int, gen: torch.Generator) -> dict[str, tuple]:
    """The three caches holding the same rows, each with its decode plan at ``context``."""
    fmts = {"int8_paged": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, "f16_paged": KvStorageFormat.F16}
    per_seq = -(-context // 16)
    paged = {}
    for name, fmt in fmts.items():
        cache = PagedKvCache(batch * per_seq, 16, 1, heads, d, fmt)
        tables = torch.randperm(batch * per_seq, generator=gen).reshape(batch, per_seq).to(torch.int32)
        paged[name] = (cache, tables)
    pages = -(-context // PAGE)
    pool = Int4SinkWindowPool(1, heads, d, batch * pages, batch * (CHUNK // PAGE + 2), batch)
    q4_tables = torch.randperm(batch * pages, generator=gen).reshape(batch, pages).to(torch.int32)
    offsets = torch.randn(heads, d, generator=gen) * 3
    at = 0
    for step in [*([CHUNK] * ((context - 1) // CHUNK)), (context - 1) % CHUNK, 1]:
        if step == 0:
            continue
        k = torch.randn(batch * step, heads, d, generator=gen) + offsets
        v = torch.randn(batch * step, heads, d, generator=gen)
        lens = torch.full((batch,), at + step, dtype=torch.int32)
        plan = plan_attention(pool, q4_tables, lens, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32) * step)
        append_paged_kv(pool, 0, k, v, plan=plan)
        pos = torch.arange(at, at + step)
        for cache, tables in paged.values():
            slots = (tables.long()[:, pos // 16] * 16 + pos % 16).reshape(-1)
            append_paged_kv(cache, 0, k, v, slots)
        at += step
    lens = torch.full((batch,), context, dtype=torch.int32)
    out = {name: (cache, plan_attention(cache, tables, lens)) for name, (cache, tables) in paged.items()}
    out["q4w"] = (pool, plan_attention(pool, q4_tables, lens))
    return out


def run_shape(name: str, repeat: int, seed: int = 0, context: int | None = None) -> dict[str, Any]:
    batch, hq, heads, d, preset_context = PRESETS[name]
    context = context or preset_context
    gen = torch.Generator().manual_seed(seed)
    caches = _caches(batch, heads, d, context, gen)
    q = torch.randn(batch, hq, d, generator=gen)
    fns = {kind: (lambda c=caches[kind]: attention(c[0], 0, q, c[1], backend="cpu")) for kind in KINDS}
    f16 = fns["f16_paged"]()
    diff = {kind: float((fns[kind]() - f16).abs().max() / f16.abs().max()) for kind in ("int8_paged", "q4w")}
    samples = interleaved_samples(fns, repeat)
    best = {k: min(v) * 1e3 for k, v in samples.items()}
    median = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    bytes_read = {"int8_paged": 2 * batch * context * heads * (d + 4), "f16_paged": 2 * batch * context * heads * 2 * d,
                  "q4w": batch * heads * quant4w.stored_bytes(context, d)}
    return {
        "shape": name, "batch": batch, "q_heads": hq, "kv_heads": heads, "head_dim": d, "context": context,
        "best_ms": best, "median_ms": median, "calls": {k: len(v) for k, v in samples.items()},
        "q4w_over_int8_median": median["q4w"] / median["int8_paged"],
        "q4w_over_f16_median": median["q4w"] / median["f16_paged"],
        "q4w_over_int8_best": best["q4w"] / best["int8_paged"], "q4w_over_f16_best": best["q4w"] / best["f16_paged"],
        "bytes_read": bytes_read, "max_rel_diff_vs_f16": diff,
    }  # fmt: skip


def run(shapes: tuple[str, ...] = SHAPES, repeat: int = 30, context: int | None = None) -> dict[str, Any]:
    return run_rows(run_shape, shapes, repeat, context)


def report(result: dict) -> str:
    lines = [
        heading(result),
        f"{'shape':<9}{'':<7}{'int8':>9}{'f16':>9}{'q4w':>9}{'q4w/int8':>10}{'q4w/f16':>9}{'bytes q4w/int8':>16}",
    ]
    for r in result["rows"]:
        for what, t in (("median", r["median_ms"]), ("best", r["best_ms"])):
            lines.append(
                f"{r['shape']:<9}{what:<7}{t['int8_paged']:>7.2f}ms{t['f16_paged']:>7.2f}ms{t['q4w']:>7.2f}ms"
                f"{t['q4w'] / t['int8_paged']:>10.2f}{t['q4w'] / t['f16_paged']:>9.2f}"
                f"{r['bytes_read']['q4w'] / r['bytes_read']['int8_paged']:>16.3f}"
            )
        lines.append(f"{r['shape']:<9}max |out - f16| / max |f16|: int8 {r['max_rel_diff_vs_f16']['int8_paged']:.2e}, "
                     f"q4w {r['max_rel_diff_vs_f16']['q4w']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args, shapes = decode_args("q4w_attention", __doc__.split("\n")[0], 30, argv)
    result = run(shapes, args.repeat, args.context)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
