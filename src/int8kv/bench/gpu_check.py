"""One prepared GPU session: compiled correctness checks, then the decode benchmark.

    python -m int8kv.bench.gpu_check [--skip-tests] [--skip-bench] [--contexts 4096 16384]

Sections run one after another; a failing section prints its traceback and the next one still runs, so a
single short device session reports everything it can. Exit status 1 if any section failed. Without CUDA
it says so and exits 0 (the interpreter tests in tests/test_ops_triton.py cover the CPU).

Benchmark: decode, batch 8, 32 query heads, 8 KV heads, head_dim 128, block size 16, one layer:
Triton INT8 vs Triton F16 vs torch SDPA on a contiguous bf16 cache. Each call is timed alone with CUDA
events after an L2 flush, median of the runs. The bandwidth floor is the bytes a call must read over the
measured device copy bandwidth; time / floor says how far a kernel is from memory speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 8, 128, 16
TOL = 1e-5


def _say(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------
class _Timer:
    def __init__(self, flush_bytes: int = 512 << 20) -> None:
        # Bigger than any L2 so a timed call starts from HBM, as a decode step does after the other layers.
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def median_seconds(self, fn: Callable[[], object], runs: int = 30, warmup: int = 5) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(runs):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e-3

    def copy_bandwidth(self, nbytes: int = 1 << 30) -> float:
        """Device-to-device copy, bytes read + written per second."""
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        seconds = self.median_seconds(lambda: dst.copy_(src), runs=10, warmup=2)
        return 2 * nbytes / seconds


# --------------------------------------------------------------------------------------------------------
# building caches
# --------------------------------------------------------------------------------------------------------
def _paged_cache(fmt, context_lens: list[int], k: torch.Tensor, v: torch.Tensor, seed: int = 0):
    """A one-layer PagedKvCache holding k/v ``[batch, ctx_max, kv_heads, dim]`` in shuffled blocks via the kernel."""
    from int8kv.cache.paged import PagedKvCache
    from int8kv.ops import triton as tk

    pages = [-(-n // BLOCK_SIZE) for n in context_lens]
    width = max(pages)
    num_blocks = sum(pages) + 1
    cache = PagedKvCache(num_blocks, BLOCK_SIZE, 1, KV_HEADS, HEAD_DIM, fmt, "cuda")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(context_lens), width), dtype=torch.int32)
    used = 0
    for b in range(len(context_lens)):
        tables[b, : pages[b]] = order[used : used + pages[b]].to(torch.int32)
        used += pages[b]
    tables = tables.cuda()
    for b, n in enumerate(context_lens):
        pos = torch.arange(n, device="cuda")
        slots = tables[b].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        tk.append_paged_kv(cache, 0, k[b, :n], v[b, :n], slots)
    return cache, tables


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------------
def check_append() -> None:
    from int8kv.codec import quantize_int8
    from int8kv.formats import KvStorageFormat

    fmt = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
    gen = torch.Generator().manual_seed(0)
    n = 3000
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mag = torch.exp(2 * torch.randn((n, KV_HEADS, 1), generator=gen))  # stays inside float16
        k = (torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen) * mag).to(dtype)
        v = (torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen) * mag).to(dtype)
        k[0] = 0.0
        k[1, 0] = (torch.randint(-127, 127, (HEAD_DIM,), generator=gen).float() + 0.5) / 8  # exact ties
        k[1, 0, 0] = 127 / 8
        cache, tables = _paged_cache(fmt, [n], k[None].cuda(), v[None].cuda())
        pos = torch.arange(n, device="cuda")
        slots = tables[0].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        rows = (-1, KV_HEADS, HEAD_DIM)
        for x, codes, scales in ((k, cache.k_codes[0], cache.k_scales[0]), (v, cache.v_codes[0], cache.v_scales[0])):
            q_cpu, s_cpu = quantize_int8(x)  # CPU codec
            q_gpu, s_gpu = quantize_int8(x.cuda())  # torch codec on the GPU
            got_q = codes.reshape(rows)[slots].cpu()
            got_s = scales.reshape(rows[:2])[slots].cpu()
            ok = (
                torch.equal(got_q, q_cpu)
                and torch.equal(got_s.view(torch.int32), s_cpu.view(torch.int32))
                and torch.equal(q_gpu.cpu(), q_cpu)
                and torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32))
            )
            if not ok:
                bad = int((got_q != q_cpu).sum())
                raise AssertionError(f"append {dtype}: {bad} code(s) differ from quantize_int8")
        _say(f"  append {str(dtype):15s} {n} tokens: bit-exact vs quantize_int8 (CPU and CUDA codec)")


def check_attention() -> None:
    from int8kv.formats import KvStorageFormat
    from int8kv.ops import reference as ref
    from int8kv.ops import triton as tk

    gen = torch.Generator().manual_seed(1)
    context_lens = [4096, 1, 777, 2500]
    n_q = [64, 1, 300, 17]
    ctx_max = max(context_lens)
    k = torch.randn((len(context_lens), ctx_max, KV_HEADS, HEAD_DIM), generator=gen).cuda()
    v = torch.randn((len(context_lens), ctx_max, KV_HEADS, HEAD_DIM), generator=gen).cuda()
    ctx = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    starts = torch.tensor([100, 0, 0, 2490], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    worst = 0.0
    for fmt in (KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16):
        cache, tables = _paged_cache(fmt, context_lens, k, v)
        for group in (1, 4, 8):
            heads = KV_HEADS * group
            qd = torch.randn((len(context_lens), heads, HEAD_DIM), generator=gen).cuda()
            qp = torch.randn((sum(n_q), heads, HEAD_DIM), generator=gen).cuda()
            for kv_starts in (None, starts):
                cases = [
                    ("decode", tk.paged_decode_attention(cache, 0, qd, tables, ctx, None, kv_starts),
                     ref.paged_decode_attention(cache, 0, qd, tables, ctx, None, kv_starts)),
                    ("decode split=7", tk._attention(cache, 0, qd, torch.arange(5, dtype=torch.int32, device="cuda"),
                                                     1, tables, ctx, None, kv_starts, num_splits=7),
                     ref.paged_decode_attention(cache, 0, qd, tables, ctx, None, kv_starts)),
                    ("prefill", tk.paged_prefill_attention(cache, 0, qp, cu, tables, ctx, 0.1, kv_starts),
                     ref.paged_prefill_attention(cache, 0, qp, cu, tables, ctx, 0.1, kv_starts)),
                ]  # fmt: skip
                for name, got, want in cases:
                    err = _rel_err(got, want)
                    worst = max(worst, err)
                    tag = f"{fmt.value[:4]} group={group} starts={'yes' if kv_starts is not None else 'no '} {name}"
                    if not err < TOL:
                        raise AssertionError(f"{tag}: relative error {err:.2e} >= {TOL:.0e}")
        _say(f"  attention {fmt.value}: decode/split/prefill within {TOL:.0e} (worst so far {worst:.2e})")


def run_pytest() -> None:
    root = Path(__file__).resolve().parents[3]
    test_file = root / "tests" / "test_ops_triton.py"
    if not test_file.exists():
        _say(f"  {test_file} not found (installed package?): skipped")
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", str(test_file)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=420)
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    for line in tail:
        _say("  | " + line)
    if done.returncode != 0:
        raise AssertionError(f"pytest exited with {done.returncode}")


_VARIANTS = (
    {"num_splits": 1},
    {"num_splits": 16},
    {"num_splits": 32},
    {"block_n": 32, "num_warps": 4},
    {"block_n": 128, "num_warps": 4},
    {"block_n": 64, "num_warps": 8},
    {"block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 4},
)


def _bench_triton(timer: _Timer, fmt, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> tuple[float, int]:
    from int8kv.ops import triton as tk

    batch, ctx_len = k.shape[0], k.shape[1]
    cache, tables = _paged_cache(fmt, [ctx_len] * batch, k, v)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    nbytes = batch * ctx_len * KV_HEADS * 2 * fmt.bytes_per_row(HEAD_DIM) + tables.numel() * 4
    seconds = timer.median_seconds(lambda: tk.paged_decode_attention(cache, 0, q, tables, ctx))
    splits = tk._num_splits(q.device, batch * KV_HEADS, tables.shape[1] * BLOCK_SIZE)
    name = "triton int8" if fmt.is_quantized else "triton f16"
    _say(f"    {name:12s} {seconds * 1e6:8.1f} us  (default config, {splits} KV splits)")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    for opts in _VARIANTS:
        try:
            t = timer.median_seconds(lambda o=opts: tk._attention(cache, 0, q, cu, 1, tables, ctx, None, None, **o), 15)
            _say(f"      variant {opts}: {t * 1e6:8.1f} us")
        except Exception as exc:  # a config that fails to compile must not end the sweep
            _say(f"      variant {opts}: failed: {type(exc).__name__}: {exc}")
    return seconds, nbytes


def _bench_sdpa(timer: _Timer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> tuple[float, int]:
    import torch.nn.functional as F

    batch = k.shape[0]
    qs = q.to(torch.bfloat16).reshape(batch, Q_HEADS, 1, HEAD_DIM)
    ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, T, D]
    scale = HEAD_DIM**-0.5
    note = "enable_gqa"
    try:
        F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
        seconds = timer.median_seconds(lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True))
    except TypeError:  # torch without enable_gqa: every query head gets its own K/V copy
        group = Q_HEADS // KV_HEADS
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        note = "K/V expanded to every query head"
        seconds = timer.median_seconds(lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale))
    _say(f"    {'sdpa bf16':12s} {seconds * 1e6:8.1f} us  ({note}, contiguous cache)")
    return seconds, (ks.numel() + vs.numel()) * 2


def bench_decode(contexts: list[int]) -> None:
    from int8kv.formats import KvStorageFormat
    from int8kv.ops import triton as tk

    tk.check_values = False  # no host syncs inside timed calls
    timer = _Timer()
    bandwidth = timer.copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    _say(f"  {props.name}, {props.multi_processor_count} SMs, copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for ctx_len in contexts:
        _say(f"\n  batch {BATCH}, context {ctx_len}, heads {Q_HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}")
        shape = (BATCH, ctx_len, KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        q = torch.randn((BATCH, Q_HEADS, HEAD_DIM), device="cuda", generator=gen)
        results: dict[str, tuple[float, int]] = {}
        int8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
        for name, bench, args in (
            ("triton int8", _bench_triton, (timer, int8, k, v, q)),
            ("triton f16", _bench_triton, (timer, KvStorageFormat.F16, k, v, q)),
            ("sdpa bf16", _bench_sdpa, (timer, k, v, q)),
        ):
            try:
                results[name] = bench(*args)
            except Exception:
                traceback.print_exc()
            torch.cuda.empty_cache()

        _say(f"    {'kernel':12s} {'time us':>9s} {'MB read':>9s} {'floor us':>9s} {'x floor':>8s} {'GB/s':>7s}")
        for name, (seconds, nbytes) in results.items():
            floor = nbytes / bandwidth
            _say(
                f"    {name:12s} {seconds * 1e6:9.1f} {nbytes / 1e6:9.1f} {floor * 1e6:9.1f} "
                f"{seconds / floor:8.2f} {nbytes / seconds / 1e9:7.0f}"
            )
        if "triton int8" in results:
            base = results["triton int8"][0]
            for name, (seconds, _) in results.items():
                if name != "triton int8":
                    _say(f"    {name} time / triton int8 time: {seconds / base:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m int8kv.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="skip the correctness sections")
    parser.add_argument("--skip-bench", action="store_true", help="skip the decode benchmark")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        _say("gpu_check: no CUDA device here; nothing to run (tests/test_ops_triton.py covers the CPU interpreter).")
        return 0
    if os.environ.pop("TRITON_INTERPRET", None) is not None:
        _say("gpu_check: TRITON_INTERPRET was set; unset so the kernels run compiled.")
    try:
        import triton

        from int8kv.ops import triton as tk
    except ImportError as exc:
        _say(f"gpu_check: cannot import triton or int8kv.ops.triton: {exc}")
        return 1
    # @triton.jit picks interpreter or compiler when the module is first imported.
    if type(tk._attention_kernel).__name__ != "JITFunction":
        _say("gpu_check: int8kv.ops.triton was imported in interpreter mode; run this script in a fresh process")
        return 1
    _say(f"gpu_check: torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}")

    sections: list[tuple[str, Callable[[], None]]] = []
    if not args.skip_tests:
        sections += [
            ("append: bit-exact V1 quantize", check_append),
            ("attention: compiled vs float64 reference", check_attention),
            ("pytest tests/test_ops_triton.py (compiled)", run_pytest),
        ]
    if not args.skip_bench:
        sections.append(("decode benchmark", lambda: bench_decode(args.contexts)))
    failed = []
    for name, fn in sections:
        _say(f"\n== {name}")
        start = time.perf_counter()
        try:
            fn()
            _say(f"   ok ({time.perf_counter() - start:.1f} s)")
        except Exception:
            traceback.print_exc()
            failed.append(name)
            _say(f"   FAILED ({time.perf_counter() - start:.1f} s)")
        torch.cuda.empty_cache()
    _say("\ngpu_check: " + ("all sections passed" if not failed else "failed: " + "; ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
