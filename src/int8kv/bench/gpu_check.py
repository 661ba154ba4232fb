"""One prepared GPU session: compile smoke, correctness at every shape and switch, benchmark, then pytest.

    python -m int8kv.bench.gpu_check [--out gpu_check.log] [--budget 450] [--smoke] [--skip-pytest]

Built for a borrowed GPU with minutes of device time: the sections run in this order, and every line printed
also goes to ``--out``.

1. compile smoke: every kernel and switch launched once on a tiny batch (a compile error shows in seconds);
2. correctness: quantize-append bit for bit against the V1 codec, and attention (decode with the default
   split plan, forced 1 split and many splits, every switch; a 2k prefill chunk; a ragged batch of two
   prefills) against the float64 reference at every benchmark shape, plus a pool of more than 2^31 elements
   per tensor. Every failure is collected; none stops the run;
3. benchmark: decode at batch 1, 8 and 32 and contexts 4k-32k, Triton INT8 vs Triton F16 vs torch SDPA on a
   contiguous bf16 cache pinned to the flash backend; each Triton variant timed as plain launches and as a
   CUDA-graph replay, and its output checked; one 2k prefill chunk against causal flash SDPA. Each call is
   timed alone with CUDA events after an L2 flush (median). Bandwidth is bytes a call must read over its
   time, against the measured read-only floor (``torch.sum`` of a 2 GiB tensor);
4. the 4-bit sink-and-window pool's kernel (prefill chunks and decode rows across seals, its switches, a window
   with softcap and sinks) against its float64 reference;
5. the GPU test subset (tests/test_ops_triton.py, test_triton_q4w.py, test_engine_q4w_triton.py) in parallel
   shards, without ``-x``, with what time is left.

Each correctness section runs in a process of its own with ``CUDA_LAUNCH_BLOCKING=1``: a kernel that faults
(an illegal address ends the CUDA context of its process) is named by its traceback and costs that section
only. When the 4-bit kernel faults, the faulting step runs again once per launch configuration (tile widths,
splits, query-block rows, warps), each in a fresh process, to tell which of them fault; then, where
``compute-sanitizer`` is on the machine, the faulting case alone under its memcheck tool, which names the
kernel, the bad access and its distance from the nearest allocation (torch's caching allocator off, so each
tensor is an allocation of its own).

Exit status: 0 all passed, 1 something failed, 3 skipped (no CUDA device and no TRITON_INTERPRET=1). Without
a GPU but with TRITON_INTERPRET=1 it runs the same sections on the CPU interpreter on a small shape
(``--smoke`` is implied; CUDA graphs and CUDA-event timing are skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3
ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class Shapes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    prefill: int  # tokens of the one prefill chunk (batch 1, the whole context)
    runs: int  # timed calls per median
    large_pool: bool  # the > 2^31-element pool check (needs ~5 GB)
    pytest_k: str | None  # -k filter for the pytest section (None: every test)
    switches: tuple[str, ...] | None  # SWITCHES checked and timed (None: all)
    # Query tokens of the ragged prefill (two sequences from empty, one launch): the first step of the 4-bit
    # check, whose kernel faulted at these lengths on the first GPU run (docs/archive/benchmarks-2026.md).
    ragged: tuple[int, int]
    # Test files the pytest section collects (None: all of TRITON_TESTS). The smoke's -k selects from the first
    # only; collecting the other two imports the engine for nothing (12.9 against 5.8 s of CPU under the
    # interpreter, 2-core dev VM).
    pytest_files: tuple[str, ...] | None = None


FULL = Shapes((1, 8, 32), (4096, 8192, 16384, 32768), 32, 8, 128, 16, 2048, 20, True, None, None, (700, 1000))
# Under the interpreter num_stages means nothing; these five reach every code path of the kernels. One context:
# 72 keys are a whole and a partial 64-key tile over 9 blocks of 8 (a second context of 40, one partial tile,
# reached no other path and doubled the decode check's and the benchmark's launches: 14.8 of the smoke's 40 s).
SMOKE = Shapes(
    (1, 2), (72,), 4, 2, 32, 8, 24, 1, False, "decode_matches_reference and bs8-d64",
    ("default", "magic", "no hilo", "block_n 64", "64 splits"), (3, 13), ("test_ops_triton.py",),
)  # fmt: skip

# name -> (attention options, relative tolerance against float64). Without the hi/lo split each product
# rounds q (or p) to float16 once: ~2^-11.
TOL = 1e-5
SWITCHES = {
    "default": ({}, TOL),
    "magic": ({"magic": True}, TOL),
    "no hilo": ({"hilo": False}, 2e-3),
    "block_n 32": ({"block_n": 32}, TOL),
    "block_n 64": ({"block_n": 64}, TOL),
    "stages 2": ({"num_stages": 2}, TOL),
    "stages 3": ({"num_stages": 3}, TOL),
    "magic block_n 32": ({"magic": True, "block_n": 32}, TOL),
    "1 split": ({"num_splits": 1}, TOL),
    "64 splits": ({"num_splits": 64}, TOL),
}
SDPA_TOL = 3e-2  # bf16 queries and keys against the exact result on the same stored values


def switches(sh: Shapes) -> dict[str, tuple[dict, float]]:
    return {name: SWITCHES[name] for name in (sh.switches or SWITCHES)}


class ContextLost(BaseException):
    """A kernel faulted: the CUDA context of this process is gone, so nothing after it can run here. A
    BaseException, so that the sections' per-case ``except Exception`` handlers let it through."""


# Messages of an error that ends the CUDA context (torch's AcceleratorError, Triton's RuntimeError from the
# driver): nothing launched afterwards in the process can succeed.
_FAULTS = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
           "an illegal address", "device-side assert")  # fmt: skip


def is_fault(exc: BaseException) -> bool:
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or any(f in text for f in _FAULTS)


class Report:
    """Prints every line and appends it to the log file; collects failures. ``case``: what a section is running
    now (``--case`` can run it alone again), named with the fault when one ends the process's CUDA context."""

    def __init__(self, path: Path | None, budget: float) -> None:
        self.file = open(path or os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (lives as long as the run)
        self.failures: list[str] = []
        self.deadline = time.monotonic() + budget
        self.case: str | None = None

    def say(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()

    def fail(self, where: str, detail: str | None = None) -> None:
        self.failures.append(where)
        self.say(f"  FAIL {where}" + (f": {detail}" if detail else ""))
        if detail is None:
            for line in traceback.format_exc().rstrip().splitlines()[-12:]:
                self.say("    " + line)
            exc = sys.exc_info()[1]
            if exc is not None and is_fault(exc):
                self.say(f"  FAULT {self.case or where}")
                raise ContextLost(where) from exc

    def left(self) -> float:
        return self.deadline - time.monotonic()


# --------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        # Bigger than any L2 (H100/H200: 50 MB) so a timed call starts from HBM, as after the other layers.
        self.flush = torch.empty(256 << 20 if self.cuda else 1, dtype=torch.uint8, device=device)

    def seconds(self, fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
        import torch

        for _ in range(warmup if self.cuda else 0):
            fn()
        if not self.cuda:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
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

    def read_bandwidth(self, device) -> float:
        """Bytes per second a read-only reduction reaches: the floor for a kernel that must read N bytes."""
        import torch

        n = (2 << 30) if self.cuda else (16 << 20)
        x = torch.zeros(n // 4, dtype=torch.float32, device=device)
        return n / self.seconds(x.sum, runs=10 if self.cuda else 3)


def graph_of(fn: Callable[[], object]):
    """(graph, its output tensor) for a call with no host read: capture after a warm-up on a side stream."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# --------------------------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------------------------
def _formats():
    from int8kv.formats import KvStorageFormat

    return {"int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, "f16": KvStorageFormat.F16}


def _append(cache, k, v, slots) -> None:
    from int8kv import ops

    # The write path, as the engine takes it: checks, then Triton's fused quantize-and-store kernel.
    ops.append_paged_kv(cache, 0, k, v, slots, backend="triton")


def _plan(pool, tables, lens, cu=None, kv_starts=None, num_queries=None):
    """The validated attention plan of one call (decode when ``cu`` is None), built outside any timing: its one
    host read is the step's, and the launches it feeds read nothing back (capturable in a CUDA graph)."""
    from int8kv.ops.plan import plan_attention

    return plan_attention(pool, tables, lens, cu_seqlens_q=cu, kv_starts=kv_starts, num_queries=num_queries)


def filled_pool(fmt, sh: Shapes, batch: int, context: int, k, v, device, extra_blocks: int = 0):
    """A one-layer pool with ``k``/``v`` ``[batch, context, kv_heads, dim]`` appended by the kernel into
    shuffled blocks (at the top of the pool when ``extra_blocks`` pads it); returns (pool, block_tables)."""
    import torch

    from int8kv.cache.paged import PagedKvCache

    pages = context // sh.block_size
    num_blocks = batch * pages + extra_blocks + 1
    pool = PagedKvCache(num_blocks, sh.block_size, 1, sh.kv_heads, sh.head_dim, fmt, device)
    gen = torch.Generator().manual_seed(batch * 7 + context)
    order = torch.randperm(batch * pages + 1, generator=gen)[: batch * pages] + extra_blocks
    tables = order.to(torch.int32).reshape(batch, pages).to(device)
    pos = torch.arange(context, device=device)
    for b in range(batch):
        slots = tables[b].long()[pos // sh.block_size] * sh.block_size + pos % sh.block_size
        _append(pool, k[b], v[b], slots)
    return pool, tables


def rel_err(got, want) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------------
def compile_smoke(rep: Report, sh: Shapes, smoke: bool) -> None:
    """Every kernel and switch compiled and run once, one process per switch in parallel.

    Each process checks its switch against the float64 reference at the smallest and largest batch of the
    shortest context (so every specialisation the later sections launch is compiled, into Triton's on-disk
    cache) and the prefill chunk. Compiling them one after another would take minutes of the budget.
    """
    # The interpreter compiles nothing: two processes exercise the mechanism (the decode section checks all).
    names = list(switches(sh))[: 2 if smoke else None]
    timeout = max(60.0, min(300.0, rep.left() - 200))
    rep.say(f"  {len(names)} switches in parallel processes, {timeout:.0f} s allowed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base = [sys.executable, "-m", "int8kv.bench.gpu_check", *(["--smoke"] if smoke else [])]
    procs = {
        name: subprocess.Popen(
            [*base, "--warm", name], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name in names
    }
    end = time.monotonic() + timeout
    for name, proc in procs.items():
        out, _ = _output(proc, end - time.monotonic())
        lines = out.rstrip().splitlines()
        fails = [x.strip() for x in lines if x.strip().startswith("FAIL")]
        for line in fails[:5]:
            rep.say(f"  | {name}: {line}")
        if proc.returncode != 0 or fails:
            detail = f"exit status {proc.returncode}, {len(fails)} failed check(s)"
            rep.fail(f"compile smoke: {name}", detail + ("" if fails else ": " + " / ".join(lines[-3:])))
        else:
            rep.say(f"  {name:18s} ok: {lines[-1].strip() if lines else ''}")


def warm(sh: Shapes, switch: str, device) -> int:
    """The body of one compile-smoke process (``--warm SWITCH``): 0 when every check passed."""
    rep = Report(None, 600.0)
    one = dataclasses.replace(
        sh,
        batches=(min(sh.batches), max(sh.batches)) if device.type == "cuda" else (max(sh.batches),),
        contexts=(min(sh.contexts),),
        switches=(switch,),
    )
    start = time.perf_counter()
    try:
        check_attention(rep, Workload(one, device))
        check_prefill(rep, one, device)
    except Exception:
        rep.fail(f"warm {switch}")
    rep.say(f"decode and prefill checked in {time.perf_counter() - start:.1f} s")
    return EXIT_FAILED if rep.failures else EXIT_OK


def check_append(rep: Report, sh: Shapes, device) -> None:
    import torch

    from int8kv.codec import quantize_int8

    fmt = _formats()["int8"]
    gen = torch.Generator().manual_seed(1)
    n = 3000 if device.type == "cuda" else 40
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mag = torch.exp(2 * torch.randn((n, sh.kv_heads, 1), generator=gen))
        k = (torch.randn((n, sh.kv_heads, sh.head_dim), generator=gen) * mag).to(dtype)
        k[0] = 0.0
        k[1, 0] = (torch.randint(-127, 127, (sh.head_dim,), generator=gen).float() + 0.5) / 8  # exact ties
        k[1, 0, 0] = 127 / 8
        v = -k.flip(0)
        ctx = n // sh.block_size * sh.block_size
        try:
            pool, tables = filled_pool(fmt, sh, 1, ctx, k[None, :ctx].to(device), v[None, :ctx].to(device), device)
            pos = torch.arange(ctx, device=device)
            slots = tables[0].long()[pos // sh.block_size] * sh.block_size + pos % sh.block_size
            for x, codes, scales in ((k, pool.k_codes[0], pool.k_scales[0]), (v, pool.v_codes[0], pool.v_scales[0])):
                want_q, want_s = quantize_int8(x[:ctx])
                got_q = codes.reshape(-1, sh.kv_heads, sh.head_dim)[slots].cpu()
                got_s = scales.reshape(-1, sh.kv_heads)[slots].cpu()
                if not (torch.equal(got_q, want_q) and torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))):
                    raise AssertionError(f"{int((got_q != want_q).sum())} code(s) differ from quantize_int8")
            rep.say(f"  append {str(dtype):15s} {ctx} tokens: bit-exact vs quantize_int8")
        except Exception:
            rep.fail(f"append {dtype}")


class Workload:
    """The benchmark's K/V (bf16 source), q, and pools per format, for the largest batch and context."""

    def __init__(self, sh: Shapes, device) -> None:
        import torch

        self.sh, self.device = sh, device
        batch, ctx = max(sh.batches), max(sh.contexts)
        gen = torch.Generator(device=device).manual_seed(2)
        shape = (batch, ctx, sh.kv_heads, sh.head_dim)
        self.k = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        self.q = torch.randn((batch, sh.q_heads, sh.head_dim), device=device, generator=gen)
        self.pools = {
            name: filled_pool(fmt, sh, batch, ctx, self.k, self.v, device) for name, fmt in _formats().items()
        }

    def args(self, fmt_name: str, batch: int, context: int):
        """(pool, q, block_tables, context_lens, launch shape) for the first ``batch`` sequences cut to ``context``."""
        import torch

        from int8kv.ops import triton as tk

        pool, tables = self.pools[fmt_name]
        tables = tables[:batch, : context // self.sh.block_size].contiguous()
        lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        launch = tk.launch_plan(
            self.device, batch=batch, num_kv_heads=self.sh.kv_heads, group=self.sh.q_heads // self.sh.kv_heads,
            max_q=1, kv_bound=context, is_int8=fmt_name == "int8",
        )  # fmt: skip
        return pool, self.q[:batch].contiguous(), tables, lens, launch


def check_attention(rep: Report, work: Workload) -> None:
    import torch

    from int8kv.ops import reference as ref
    from int8kv.ops import triton as tk

    sh = work.sh
    for batch in sh.batches:
        for context in sh.contexts:
            for fmt_name in ("int8", "f16"):
                pool, q, tables, lens, _ = work.args(fmt_name, batch, context)
                starts = (torch.arange(batch, dtype=torch.int32, device=work.device) * 37) % (context // 2) + 1
                worst = {}
                for kv_starts in (None, starts):
                    want = ref.paged_decode_attention(pool, 0, q, tables, lens, None, kv_starts)
                    plan = _plan(pool, tables, lens, kv_starts=kv_starts)
                    for switch, (opts, tol) in switches(sh).items():
                        tag = f"decode b{batch} ctx{context} {fmt_name} {switch} starts={kv_starts is not None}"
                        try:
                            got = tk.attention(pool, 0, q, plan, **opts)
                            err = rel_err(got, want)
                            worst[switch] = max(worst.get(switch, 0.0), err)
                            if not err < tol:
                                rep.fail(tag, f"relative error {err:.2e} >= {tol:.0e}")
                        except Exception:
                            rep.fail(tag)
                    del want
                errs = " ".join(f"{s}={e:.1e}" for s, e in worst.items())
                rep.say(f"  decode b{batch:<2d} ctx {context:>5d} {fmt_name:4s} worst rel err: {errs}")
            if rep.left() < 150:
                rep.say("  (budget: remaining decode shapes skipped)")
                return


def check_prefill(rep: Report, sh: Shapes, device) -> None:
    import torch

    from int8kv.ops import reference as ref
    from int8kv.ops import triton as tk

    n = sh.prefill
    gen = torch.Generator(device="cpu").manual_seed(3)
    k = torch.randn((1, n, sh.kv_heads, sh.head_dim), generator=gen).to(device)
    v = torch.randn((1, n, sh.kv_heads, sh.head_dim), generator=gen).to(device)
    q = torch.randn((n, sh.q_heads, sh.head_dim), generator=gen).to(device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    for fmt_name, fmt in _formats().items():
        pool, tables = filled_pool(fmt, sh, 1, n, k, v, device)
        want = ref.paged_prefill_attention(pool, 0, q, cu, tables, lens, None, None)
        plan = _plan(pool, tables, lens, cu, num_queries=n)
        for switch, (opts, tol) in switches(sh).items():
            call = functools.partial(tk.attention, pool, 0, q, plan, **opts)
            _check_call(rep, f"prefill {n} tokens {fmt_name:4s} {switch:12s}", f"prefill {fmt_name} {switch}",
                        call, want, tol)  # fmt: skip
    check_ragged_prefill(rep, sh, device)


def _check_call(rep: Report, label: str, where: str, call: Callable[[], object], want, tol: float) -> None:
    """One attention call against its reference: its relative error said, a failure (or an error) as ``where``."""
    try:
        err = rel_err(call(), want)
        rep.say(f"  {label} rel err {err:.1e}")
        if not err < tol:
            rep.fail(where, f"relative error {err:.2e} >= {tol:.0e}")
    except Exception:
        rep.fail(where)


def check_ragged_prefill(rep: Report, sh: Shapes, device) -> None:
    """Two sequences prefilled from empty in one launch (``sh.ragged`` tokens each, not whole blocks): query
    blocks past the shorter sequence's last token, a table padded past its pages."""
    import torch

    from int8kv.cache.paged import PagedKvCache
    from int8kv.ops import reference as ref
    from int8kv.ops import triton as tk

    new = sh.ragged
    pages = [-(-n // sh.block_size) for n in new]
    gen = torch.Generator(device="cpu").manual_seed(6)
    k = torch.randn((sum(new), sh.kv_heads, sh.head_dim), generator=gen).to(device)
    v = torch.randn((sum(new), sh.kv_heads, sh.head_dim), generator=gen).to(device)
    q = torch.randn((sum(new), sh.q_heads, sh.head_dim), generator=gen).to(device)
    ids = (torch.randperm(sum(pages), generator=gen) + 1).tolist()  # block 0 pads the shorter table
    rows = [ids[: pages[0]], ids[pages[0] :]]
    tables = torch.tensor([t + [0] * (max(pages) - len(t)) for t in rows], dtype=torch.int32, device=device)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    lens = torch.tensor(new, dtype=torch.int32, device=device)
    for fmt_name, fmt in _formats().items():
        pool = PagedKvCache(sum(pages) + 1, sh.block_size, 1, sh.kv_heads, sh.head_dim, fmt, device)
        for b, (first, n) in enumerate(zip((0, new[0]), new, strict=True)):
            pos = torch.arange(n, device=device)
            slots = tables[b].long()[pos // sh.block_size] * sh.block_size + pos % sh.block_size
            _append(pool, k[first : first + n], v[first : first + n], slots)
        want = ref.paged_prefill_attention(pool, 0, q, cu, tables, lens, None, None)
        plan = _plan(pool, tables, lens, cu, num_queries=sum(new))
        for switch in ("default", "1 split"):
            opts, tol = SWITCHES[switch]
            rep.case = f"ragged {fmt_name} {switch}"
            call = functools.partial(tk.attention, pool, 0, q, plan, **opts)
            label = f"ragged prefill {new[0]} + {new[1]} tokens {fmt_name:4s} {switch:8s}"
            _check_call(rep, label, f"ragged prefill {fmt_name} {switch}", call, want, tol)


# Steps of the 4-bit pool's check: new positions per sequence of a batch of two. Full: lengths 700 / 1000 (prefill),
# 701 / 1001, 1000 / 1063 (chunks whose first rows read their last pages in F16 and later rows sealed), 1001 / 1064.
# Smoke (the interpreter, 64-row query blocks for its prefill as on a GPU: a quarter of the programs): 3 / 130
# (the second's page 0 sealed by its last rows), 4 / 131.
Q4W_STEPS = {"full": ((700, 1000), (1, 1), (299, 62), (1, 1)), "smoke": ((3, 130), (1, 1))}
Q4W_SWITCHES = {
    "default": ({}, TOL),
    "4 splits": ({"num_splits": 4}, TOL),
    "block_n 64": ({"block_n": 64}, TOL),
    "block_n 16": ({"block_n": 16}, TOL),
    "no hilo": ({"hilo": False}, 2e-3),
    # Other tile layouts of the prefill launch that faulted (64-row query blocks, 8 warps on a GPU): compiled for
    # sm_90 by Triton 3.6 (and 3.9) that launch has no software-pipelined load, every masked load predicated per
    # lane in its PTX and, unpredicated, only the 7 scalar loads of lengths, block ids and page-book entries;
    # which layouts fault tells a code-generation fault from an addressing one.
    "block_m 16": ({"block_m": 16}, TOL),
    "warps 4": ({"num_warps": 4}, TOL),
}
WINDOWED = "window softcap sinks"  # the case name of the call with a window, softcap and sinks


def check_q4w(rep: Report, sh: Shapes, device, case: str | None = None) -> None:
    """The 4-bit sink-and-window pool (int8kv.ops.triton_q4w): a batch of two written step by step through the
    write path, prefill chunks and decode rows across several seals, each step's attention against the float64
    reference over the same pool (ops.reference_q4w), per switch, and once with a window, softcap and sinks.
    ``case`` (``"STEP:SWITCH"``, as a fault names it): the steps' writes up to that step, then that one call
    alone, its reference computed after it (for the probes and compute-sanitizer)."""
    import torch

    from int8kv import ops
    from int8kv.cache.pool_q4w import Int4SinkWindowPool
    from int8kv.ops import triton as tk
    from int8kv.ops.plan import check_variant

    smoke = sh is SMOKE
    steps = Q4W_STEPS["smoke" if smoke else "full"]
    switches = {k: v for k, v in Q4W_SWITCHES.items() if not smoke or k in ("default", "4 splits")}
    final = [sum(s[b] for s in steps) for b in range(2)]
    pages = [-(-n // 64) for n in final]
    pool = Int4SinkWindowPool(1, sh.kv_heads, sh.head_dim, sum(pages), sum(pages), 2, device)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randperm(sum(pages), generator=gen).tolist()
    width = max(pages)
    rows = [ids[: pages[0]], ids[pages[0] :]]
    tables = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32, device=device)
    sinks = torch.linspace(-1.0, 1.0, sh.q_heads, device=device)
    lens = [0, 0]
    worst: dict[str, float] = {}
    only_step, only_switch = (int(case.split(":", 1)[0]), case.split(":", 1)[1]) if case else (None, None)
    for step, new in enumerate(steps):
        if rep.left() < 150 and case is None:
            rep.say("  (budget: remaining q4w steps skipped)")
            break
        if only_step is not None and step > only_step:
            break
        lens = [n + m for n, m in zip(lens, new, strict=True)]
        cu = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32, device=device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        plan = _plan(pool, tables, ctx, cu, num_queries=sum(new))
        k = (torch.randn((sum(new), sh.kv_heads, sh.head_dim), generator=gen) + 2.0).to(device)
        v = torch.randn((sum(new), sh.kv_heads, sh.head_dim), generator=gen).to(device)
        q = torch.randn((sum(new), sh.q_heads, sh.head_dim), generator=gen).to(device)
        ops.append_paged_kv(pool, 0, k, v, plan=plan, backend="triton")
        prefill = smoke and max(new) > 1
        if only_step is not None:
            if step == only_step:
                rep.case = case
                if only_switch == WINDOWED:
                    variant = {"window": 100, "softcap": 30.0, "sinks": sinks}
                    opts = {"variant": check_variant(pool, sh.q_heads, **variant)}
                else:
                    variant, opts = {}, dict(Q4W_SWITCHES[only_switch][0])
                got = tk.attention(pool, 0, q, plan, **{**({"block_m": 64} if prefill else {}), **opts}).cpu()
                err = rel_err(got, ops.attention(pool, 0, q, plan, backend="reference", **variant).cpu())
                rep.say(f"  q4w case {case} at lengths {lens}: ran, rel err {err:.1e}")
            continue
        want = ops.attention(pool, 0, q, plan, backend="reference")
        for switch, (opts, tol) in switches.items():
            if prefill and opts:
                continue  # the interpreter: the switches on decode rows only
            opts = {"block_m": 64, **opts} if prefill else opts
            rep.case = f"{step}:{switch}"
            try:
                err = rel_err(tk.attention(pool, 0, q, plan, **opts).cpu(), want.cpu())
                worst[switch] = max(worst.get(switch, 0.0), err)
                if not err < tol:
                    rep.fail(f"q4w lengths {lens} {switch}", f"relative error {err:.2e} >= {tol:.0e}")
            except Exception:
                rep.fail(f"q4w lengths {lens} {switch}")
        variant = {"window": 100, "softcap": 30.0, "sinks": sinks}
        rep.case = f"{step}:{WINDOWED}"
        try:
            checked = check_variant(pool, sh.q_heads, **variant)
            got = tk.attention(pool, 0, q, plan, variant=checked, **({"block_m": 64} if prefill else {}))
            err = rel_err(got.cpu(), ops.attention(pool, 0, q, plan, backend="reference", **variant).cpu())
            worst[WINDOWED] = max(worst.get(WINDOWED, 0.0), err)
            if not err < TOL:
                rep.fail(f"q4w lengths {lens} window softcap sinks", f"relative error {err:.2e} >= {TOL:.0e}")
        except Exception:
            rep.fail(f"q4w lengths {lens} window softcap sinks")
    if case is None:
        errs = " ".join(f"{s}={e:.1e}" for s, e in worst.items())
        rep.say(f"  q4w pool, lengths {lens}: worst rel err: {errs}")


def check_large_pool(rep: Report, sh: Shapes, device) -> None:
    """A pool whose code tensors hold more than 2^31 elements, the sequence in its top blocks."""
    import torch

    from int8kv.codec import quantize_int8
    from int8kv.ops import reference as ref
    from int8kv.ops import triton as tk

    per_block = sh.block_size * sh.kv_heads * sh.head_dim
    extra = (1 << 31) // per_block + 8
    context = 4096
    gen = torch.Generator(device="cpu").manual_seed(4)
    k = torch.randn((1, context, sh.kv_heads, sh.head_dim), generator=gen).to(device)
    v = torch.randn((1, context, sh.kv_heads, sh.head_dim), generator=gen).to(device)
    q = torch.randn((1, sh.q_heads, sh.head_dim), generator=gen).to(device)
    pool, tables = filled_pool(_formats()["int8"], sh, 1, context, k, v, device, extra_blocks=extra)
    elements = pool.k_codes[0].numel()
    pos = torch.arange(context, device=device)
    slots = tables[0].long()[pos // sh.block_size] * sh.block_size + pos % sh.block_size
    want_q, _ = quantize_int8(k[0].cpu())
    got_q = pool.k_codes[0].reshape(-1, sh.kv_heads, sh.head_dim)[slots].cpu()
    if not torch.equal(got_q, want_q):
        rep.fail("large pool append", "codes differ from quantize_int8")
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    want = ref.paged_decode_attention(pool, 0, q, tables, lens, None, None)
    plan = _plan(pool, tables, lens)
    for splits in (None, 8):
        err = rel_err(tk.attention(pool, 0, q, plan, num_splits=splits), want)
        if not err < TOL:
            rep.fail(f"large pool decode splits={splits}", f"relative error {err:.2e}")
    rep.say(f"  pool of {elements / 2**31:.2f} x 2^31 elements per tensor: append bit-exact, decode within {TOL:.0e}")


def _sdpa_decode(q, k, v):
    """torch SDPA on a contiguous ``[B, Hkv, T, D]`` bf16 cache, pinned to the flash backend; (fn, note)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(kk, vv, **kw):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, **kw)

    try:
        run(k, v, enable_gqa=True)
        return (lambda: run(k, v, enable_gqa=True)), "enable_gqa"
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        run(ke, ve)
        return (lambda: run(ke, ve)), f"K/V expanded x{group} (flash refused GQA)"


def bench_decode(rep: Report, work: Workload, timer: Timer, floor_bps: float) -> None:
    import torch

    from int8kv.ops import triton as tk

    sh = work.sh
    cuda = work.device.type == "cuda"
    rep.say(f"  read-only floor {floor_bps / 1e9:.0f} GB/s (torch.sum of a large float32 tensor)")
    header = "  batch    ctx kernel                    plain us  graph us       MB   GB/s x floor"
    for batch in sh.batches:
        for context in sh.contexts:
            if rep.left() < 100:
                rep.say("  (budget: remaining benchmark shapes skipped)")
                return
            rep.say(header)
            best: dict[str, float] = {}
            ref_out = None
            for fmt_name in ("f16", "int8"):
                pool, q, tables, lens, launch = work.args(fmt_name, batch, context)
                plan = _plan(pool, tables, lens)
                fmt = _formats()[fmt_name]
                nbytes = batch * context * sh.kv_heads * 2 * fmt.bytes_per_row(sh.head_dim) + tables.numel() * 4
                for switch, (opts, tol) in switches(sh).items():
                    name = f"triton {fmt_name} {switch}"
                    try:
                        call = functools.partial(tk.attention, pool, 0, q, plan, **opts)
                        out = call()
                        if ref_out is None:
                            ref_out = out.clone()  # F16 default: the exact result on the stored bf16 values
                        else:
                            err = rel_err(out, ref_out)
                            limit = 5e-2 if fmt_name == "int8" else tol  # INT8 rounding: ~1e-2 (4k-32k)
                            if not err < limit:
                                rep.fail(f"bench output {name} b{batch} ctx{context}", f"rel err {err:.2e} vs f16")
                        plain = timer.seconds(call, sh.runs)
                        graph_us = "-"
                        if cuda:
                            graph, g_out = graph_of(call)
                            graph.replay()
                            torch.cuda.synchronize()
                            if not torch.equal(g_out, out):
                                rep.fail(
                                    f"graph replay {name} b{batch} ctx{context}", "output differs from plain launch"
                                )
                            seconds = timer.seconds(graph.replay, sh.runs)
                            graph_us = f"{seconds * 1e6:9.1f}"
                            del graph, g_out
                        else:
                            seconds = plain
                        best[fmt_name] = min(best.get(fmt_name, math.inf), seconds)
                        extra = f"  splits {launch.num_splits}" if switch == "default" else ""
                        rep.say(
                            f"  {batch:5d} {context:6d} {name:24s} {plain * 1e6:9.1f} {graph_us:>9s} "
                            f"{nbytes / 1e6:8.1f} {nbytes / seconds / 1e9:6.0f} "
                            f"{seconds * floor_bps / nbytes:7.2f}{extra}"
                        )
                    except Exception:
                        rep.fail(f"bench {name} b{batch} ctx{context}")
            try:
                ks = work.k[:batch, :context].transpose(1, 2).contiguous()
                vs = work.v[:batch, :context].transpose(1, 2).contiguous()
                qs = work.q[:batch].to(torch.bfloat16).unsqueeze(2)
                fn, note = _sdpa_decode(qs, ks, vs)
                out = fn().squeeze(2).float()
                if ref_out is not None and not rel_err(out, ref_out) < SDPA_TOL:
                    rep.fail(f"sdpa output b{batch} ctx{context}", f"rel err {rel_err(out, ref_out):.2e}")
                seconds = timer.seconds(fn, sh.runs)
                nbytes = (ks.numel() + vs.numel()) * 2
                rep.say(
                    f"  {batch:5d} {context:6d} {'sdpa bf16 flash':24s} {seconds * 1e6:9.1f} {'-':>9s} "
                    f"{nbytes / 1e6:8.1f} {nbytes / seconds / 1e9:6.0f} {seconds * floor_bps / nbytes:7.2f}  {note}"
                )
                best["sdpa"] = seconds
                del ks, vs
            except Exception:
                rep.fail(f"bench sdpa b{batch} ctx{context}")
            if "int8" in best:
                ratios = ", ".join(f"{n} / int8 = {t / best['int8']:.2f}x" for n, t in best.items() if n != "int8")
                rep.say(f"  best times: {ratios}")
            if cuda:
                torch.cuda.empty_cache()


def bench_prefill(rep: Report, sh: Shapes, device, timer: Timer) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from int8kv.ops import triton as tk

    n = sh.prefill
    gen = torch.Generator(device="cpu").manual_seed(5)
    k = torch.randn((1, n, sh.kv_heads, sh.head_dim), generator=gen).to(device, torch.bfloat16)
    v = torch.randn((1, n, sh.kv_heads, sh.head_dim), generator=gen).to(device, torch.bfloat16)
    q = torch.randn((n, sh.q_heads, sh.head_dim), generator=gen).to(device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    flops = 4 * n * n / 2 * sh.q_heads * sh.head_dim  # causal: half the score matrix, two products
    for fmt_name, fmt in _formats().items():
        try:
            pool, tables = filled_pool(fmt, sh, 1, n, k, v, device)
            call = functools.partial(tk.attention, pool, 0, q, _plan(pool, tables, lens, cu, num_queries=n))
            seconds = timer.seconds(call, sh.runs)
            rate = flops / seconds / 1e12
            rep.say(f"  prefill chunk {n}: triton {fmt_name:4s} {seconds * 1e6:9.1f} us  {rate:6.1f} TFLOP/s")
        except Exception:
            rep.fail(f"bench prefill {fmt_name}")
    try:
        qs = q.to(torch.bfloat16).transpose(0, 1).unsqueeze(0)
        ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

        seconds = timer.seconds(sdpa, sh.runs)
        rate = flops / seconds / 1e12
        rep.say(f"  prefill chunk {n}: sdpa bf16 flash causal {seconds * 1e6:9.1f} us  {rate:6.1f} TFLOP/s")
    except Exception:
        rep.fail("bench prefill sdpa")


# The suite's Triton tests: the INT8 / F16 kernels, the 4-bit pool's kernel, the engine's 4-bit steps on triton.
TRITON_TESTS = ("test_ops_triton.py", "test_triton_q4w.py", "test_engine_q4w_triton.py")
PYTEST_SECTION = "pytest the Triton tests"  # run in child processes: runs after a lost CUDA context too


def shard_ids(ids: list[str], shards: int) -> list[list[str]]:
    """Test ids in at most ``shards`` non-empty groups, the INT8 / F16 kernels' tests (TRITON_TESTS[0]) apart from
    the 4-bit ones (a quarter of the shards, at least one), each id once."""
    ints = [i for i in ids if Path(i.split("::", 1)[0]).name == TRITON_TESTS[0]]
    q4w = [i for i in ids if Path(i.split("::", 1)[0]).name != TRITON_TESTS[0]]
    own = max(1, shards // 4) if ints and q4w and shards > 1 else 0
    if own:
        groups = [ints[i :: shards - own] for i in range(shards - own)] + [q4w[i::own] for i in range(own)]
    else:
        groups = [ids[i::shards] for i in range(shards)]
    return [g for g in groups if g]


def run_pytest(rep: Report, sh: Shapes, interpret: bool) -> None:
    names = sh.pytest_files or TRITON_TESTS
    files = [ROOT / "tests" / name for name in names]
    if not all(f.exists() for f in files):
        rep.say(f"  {', '.join(names)} not found in {ROOT / 'tests'} (installed package?): skipped")
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["INT8KV_UNVERIFIED_GPU_KERNELS"] = "1"  # the 4-bit kernel's tests: what this run is to verify
    select = ["-k", sh.pytest_k] if sh.pytest_k else []
    # no cache provider: the run writes nothing into the tree
    collect = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *map(str, files), *select,
               "--collect-only", "-q"]
    listed = subprocess.run(collect, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        rep.fail("pytest collection", (listed.stdout + listed.stderr).strip()[-500:])
        return
    # Each shard compiles its own kernels (one CPU core each); the GPU machine has 16 cores. The 4-bit kernel's
    # tests get shards of their own: its kernel faulted on the first GPU run, and a fault fails every later test
    # of its process.
    groups = shard_ids(ids, 2 if interpret else max(2, min(8, (os.cpu_count() or 4) // 2)))
    timeout = max(30.0, rep.left() - 10)
    rep.say(f"  {len(ids)} tests in {len(groups)} parallel shards, {timeout:.0f} s left for them")
    procs = []
    for group in groups:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *group]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    end = time.monotonic() + timeout
    for i, proc in enumerate(procs):
        out, timed_out = _output(proc, end - time.monotonic())
        if timed_out:
            rep.fail(f"pytest shard {i}", "timed out (budget)")
        lines = out.strip().splitlines()
        for line in [x for x in lines if x.startswith(("FAILED", "ERROR"))] + lines[-1:]:
            rep.say(f"  | shard {i}: {line}")
        if proc.returncode not in (0, None, -9):
            rep.fail(f"pytest shard {i}", f"exit status {proc.returncode}")


# --------------------------------------------------------------------------------------------------------
# sections in processes of their own
# --------------------------------------------------------------------------------------------------------
# name -> (title, body (rep, shapes, device, case)): the sections run by ``--section NAME`` in a child process.
ISOLATED: dict[str, tuple[str, Callable[..., None]]] = {
    "append": ("append: bit-exact V1 quantize", lambda rep, sh, dev, _: check_append(rep, sh, dev)),
    "decode": ("decode vs float64 reference, every shape and switch",
               lambda rep, sh, dev, _: check_attention(rep, Workload(sh, dev))),
    "prefill": ("prefill chunk and ragged prefill vs float64 reference",
                lambda rep, sh, dev, _: check_prefill(rep, sh, dev)),
    "large_pool": ("pool over 2^31 elements", lambda rep, sh, dev, _: check_large_pool(rep, sh, dev)),
    "q4w": ("4-bit sink-and-window pool vs float64 reference",
            lambda rep, sh, dev, case: check_q4w(rep, sh, dev, case)),
}  # fmt: skip
# compute-sanitizer's memcheck report: its lines start with this; the first few name the kernel and the access.
SANITIZER_LINE = "========="


def child_command() -> list[str]:
    """How a section's process is started (this module, in a fresh interpreter)."""
    return [sys.executable, "-m", "int8kv.bench.gpu_check"]


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in ("/usr/local/cuda/bin", "/opt/nvidia/compute-sanitizer"):
        path = Path(base) / "compute-sanitizer"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _child_env(device) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # The 4-bit pool refuses a CUDA device until its kernel has passed this check on one (cache/pool_q4w.py).
    env["INT8KV_UNVERIFIED_GPU_KERNELS"] = "1"
    if device.type == "cuda":
        env["CUDA_LAUNCH_BLOCKING"] = "1"  # the launch that faults raises, with its own traceback
    return env


def run_isolated(rep: Report, name: str, smoke: bool, device) -> None:
    """Section ``name`` in a child process: its lines relayed, its failures counted here; a fault's case run
    again under compute-sanitizer where the section can run one case alone (``--case``)."""
    base = [*child_command(), *(["--smoke"] if smoke else [])]
    env = _child_env(device)
    cmd = [*base, "--section", name, "--budget", f"{max(30.0, rep.left()):.0f}"]
    out, code = _communicate(cmd, env, max(60.0, rep.left() + 30))
    lines = out.rstrip().splitlines()
    fails = [x[len("  FAIL ") :] for x in lines if x.startswith("  FAIL ")]
    for line in lines:
        rep.say(line)
    rep.failures.extend(f.split(": ", 1)[0] for f in fails)
    if code != 0 and not fails:
        rep.fail(f"{name}: exit status {code}", " / ".join(lines[-3:]))
    faults = [x.split("FAULT ", 1)[1] for x in lines if x.startswith("  FAULT ")]
    if faults and name == "q4w":
        probe_q4w(rep, base, env, faults[0].split(":", 1)[0])
        sanitize(rep, base, env, name, faults[0])


def probe_q4w(rep: Report, base: list[str], env: dict[str, str], step: str) -> None:
    """The faulting step of the 4-bit check with each of its launches, one fresh process each: which of them
    fault (a fault ends the context, so one process could test only the first). Reported, not counted."""
    rep.say(f"  each launch of step {step} in a process of its own:")
    for switch in (*Q4W_SWITCHES, WINDOWED):
        if rep.left() < 120:
            rep.say("  (budget: remaining launches not probed)")
            return
        case = f"{step}:{switch}"
        out, code = _communicate([*base, "--section", "q4w", "--case", case], env, min(90.0, rep.left() - 60))
        lines = out.rstrip().splitlines()
        ran = [x.strip() for x in lines if "ran, rel err" in x]
        fault = [x for x in lines if x.startswith("  FAULT ")]
        said = ran[-1] if ran else ("FAULT" if fault else f"exit status {code}: {' / '.join(lines[-2:])}")
        rep.say(f"  | {switch:20s} {said}")


def sanitize(rep: Report, base: list[str], env: dict[str, str], name: str, case: str) -> None:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        rep.say("  compute-sanitizer not found: no memcheck run of the faulting case")
        return
    timeout = min(180.0, rep.left() - 60)
    if timeout < 30:
        rep.say("  (budget: no memcheck run of the faulting case)")
        return
    env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "4", *base, "--section", name, "--case", case]
    rep.say(f"  memcheck of case {case!r} ({timeout:.0f} s allowed):")
    out, code = _communicate(cmd, env, timeout)
    report = [x for x in out.splitlines() if x.startswith(SANITIZER_LINE)]
    for line in report[:48]:
        rep.say("  " + line)
    rep.say(f"  memcheck exit status {code}, {len(report)} report line(s)")


def _output(proc: subprocess.Popen, timeout: float) -> tuple[str, bool]:
    """``proc``'s output once it ends, killed after ``timeout`` seconds (at least 1); whether it was."""
    try:
        return proc.communicate(timeout=max(1.0, timeout))[0], False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0], True


def _communicate(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, int]:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, timed_out = _output(proc, timeout)
    if timed_out:
        out += f"\n  FAIL {Path(cmd[0]).name} timed out after {timeout:.0f} s (budget)"
    return out, proc.returncode


def _guarded(rep: Report, name: str, fn: Callable[[], None]) -> bool:
    """Run one section, an error it lets out counted as its failure; True when a fault ended the process's CUDA
    context (``rep.fail`` says ``FAULT`` and raises ContextLost, from a case's handler or from the one here)."""
    try:
        try:
            fn()
        except Exception:
            rep.fail(name)
    except ContextLost:
        return True
    return False


def run_section(sh: Shapes, name: str, case: str | None, device, budget: float) -> int:
    """The body of ``--section NAME``: 0 when every check passed, 1 otherwise (a fault says ``FAULT case``)."""
    rep = Report(None, budget)
    _guarded(rep, name, lambda: ISOLATED[name][1](rep, sh, device, case))
    return EXIT_FAILED if rep.failures else EXIT_OK


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m int8kv.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.log"), help="log file (default gpu_check.log)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    parser.add_argument("--smoke", action="store_true", help="small shapes (implied without a GPU)")
    parser.add_argument("--skip-pytest", action="store_true", help="skip the pytest section")
    parser.add_argument("--skip-bench", action="store_true", help="skip the benchmark section")
    parser.add_argument("--warm", metavar="SWITCH", help=argparse.SUPPRESS)  # one compile-smoke process
    parser.add_argument("--section", choices=sorted(ISOLATED), help=argparse.SUPPRESS)  # one section's process
    parser.add_argument("--case", help=argparse.SUPPRESS)  # with --section: one case of it alone
    args = parser.parse_args(argv)

    import torch

    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available():
        # @triton.jit picks interpreter or compiler when int8kv.ops.triton is first imported: not yet here.
        os.environ.pop("TRITON_INTERPRET", None)
        interpret = False
        device = torch.device("cuda")
    elif interpret:
        device = torch.device("cpu")
    else:
        print("gpu_check: skipped: no CUDA device here and TRITON_INTERPRET is not set (nothing to run on)")
        return EXIT_SKIPPED
    sh = SMOKE if (args.smoke or device.type != "cuda") else FULL
    if args.warm:
        return warm(sh, args.warm, device)
    if args.section:
        return run_section(sh, args.section, args.case, device, args.budget)
    rep = Report(args.out, args.budget)
    try:
        import triton

        from int8kv.ops import triton as tk
    except ImportError as exc:
        rep.say(f"gpu_check: cannot import triton or int8kv.ops.triton: {exc}")
        return EXIT_FAILED
    compiled = tk.is_compiled()
    if device.type == "cuda" and not compiled:
        rep.say("gpu_check: int8kv.ops.triton was imported in interpreter mode; run this in a fresh process")
        return EXIT_FAILED
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU, Triton interpreter"
    rep.say(f"gpu_check: torch {torch.__version__}, triton {triton.__version__}, {where}; shapes {sh}")
    # No host syncs inside timed calls: every plan is validated once, before its calls are timed or captured.

    timer = Timer(device)
    work: Workload | None = None
    smoke = sh is SMOKE

    def isolated(name: str) -> tuple[str, Callable[[], None]]:
        return ISOLATED[name][0], lambda: run_isolated(rep, name, smoke, device)

    def build() -> None:
        nonlocal work
        work = Workload(sh, device)

    sections: list[tuple[str, Callable[[], None]]] = [
        ("compile smoke", lambda: compile_smoke(rep, sh, smoke=smoke)),
        isolated("append"),
        isolated("decode"),
        isolated("prefill"),
    ]
    if sh.large_pool:
        sections.append(isolated("large_pool"))
    if not args.skip_bench:
        sections += [
            ("building the benchmark pools", build),
            ("decode benchmark", lambda: bench_decode(rep, work, timer, timer.read_bandwidth(device))),
            ("prefill benchmark", lambda: bench_prefill(rep, sh, device, timer)),
        ]
    # After the benchmarks: its kernel faulted on the first GPU run, and the memcheck run of a fault takes minutes.
    sections.append(isolated("q4w"))
    if not args.skip_pytest:
        sections.append((PYTEST_SECTION, lambda: run_pytest(rep, sh, interpret)))

    lost = False
    in_children = {title for title, _ in ISOLATED.values()} | {PYTEST_SECTION}
    for name, fn in sections:
        rep.say(f"\n== {name}")
        start = time.perf_counter()
        before = len(rep.failures)
        if lost and name not in in_children:
            rep.say("   skipped: this process's CUDA context was lost")
            continue
        lost = _guarded(rep, name, fn) or lost
        status = "ok" if len(rep.failures) == before else f"{len(rep.failures) - before} failure(s)"
        rep.say(f"   {status} ({time.perf_counter() - start:.1f} s, {rep.left():.0f} s of budget left)")
        if device.type == "cuda" and not lost:
            torch.cuda.empty_cache()
    rep.say("\ngpu_check: " + ("all passed" if not rep.failures else f"{len(rep.failures)} failed:"))
    for f in rep.failures:
        rep.say(f"  - {f}")
    rep.file.close()
    return EXIT_FAILED if rep.failures else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
