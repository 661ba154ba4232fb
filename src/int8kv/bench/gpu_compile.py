"""Compile every Triton kernel and switch for CUDA targets on this machine, GPU or not, and report its resources.

    python -m int8kv.bench.gpu_compile [--arch 90 80] [--only NAME ...] [--json PATH]

Each case is one call of the host wrappers (``int8kv.ops.triton``, and through it ``int8kv.ops.triton_q4w``
for the 4-bit sink-and-window pool, written on the CPU first) on small CPU tensors with launches
recorded, not run (``record_launches``); every recorded launch is then compiled with ``triton.compile`` for
each target, specialised as Triton's JIT would specialise it (ints equal to 1 become constants, pointers
and multiples of 16 get the divisibility hint). So what compiles here is what a GPU would launch, with the
same strides. Per kernel and target it prints registers per thread, the local-memory stack (spills),
static + dynamic shared memory, and SASS counts read with the ``cuobjdump`` Triton's wheel carries:
total instructions, local loads/stores (spill traffic), int-to-float conversions and byte permutes.

Exit status 0 when every case compiled, 1 otherwise (each failure printed, the rest still compiled).
Must run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels with Python functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

#: Cases: name -> (format, call kind, wrapper options). Every constexpr switch and launch option appears
#: at least once; the default decode configuration is "decode int8" / "decode f16".
SHAPE = {"batch": 8, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "context": 1024}


def _cases() -> dict[str, tuple[str, str, dict]]:
    return {
        "append int8": ("int8", "append", {}),
        "append f16": ("f16", "append", {}),
        "decode int8": ("int8", "decode", {}),
        "decode f16": ("f16", "decode", {}),
        "decode int8 split": ("int8", "decode", {"num_splits": 4}),
        "decode f16 split": ("f16", "decode", {"num_splits": 4}),
        "decode int8 kv_starts": ("int8", "decode_starts", {}),
        "decode int8 magic": ("int8", "decode", {"magic": True}),
        "decode int8 no hilo": ("int8", "decode", {"hilo": False}),
        "decode int8 magic no hilo": ("int8", "decode", {"magic": True, "hilo": False}),
        "decode f16 no hilo": ("f16", "decode", {"hilo": False}),
        "decode int8 block_n 32": ("int8", "decode", {"block_n": 32}),
        "decode int8 block_n 128": ("int8", "decode", {"block_n": 128}),
        "decode int8 stages 2": ("int8", "decode", {"num_stages": 2}),
        "decode int8 stages 3": ("int8", "decode", {"num_stages": 3}),
        "decode int8 warps 8": ("int8", "decode", {"num_warps": 8}),
        "prefill int8": ("int8", "prefill", {}),
        "prefill f16": ("f16", "prefill", {}),
        "prefill int8 magic": ("int8", "prefill", {"magic": True}),
        # window, chunk, softcap, sinks (ops.attention's variant keywords), alone where they change the code
        "decode int8 window": ("int8", "decode", {"variant": {"window": 256}}),
        "decode int8 split window sinks": (
            "int8", "decode", {"num_splits": 4, "variant": {"window": 1000, "sinks": 1}},
        ),
        "decode f16 softcap sinks": ("f16", "decode", {"variant": {"softcap": 50.0, "sinks": 1}}),
        "prefill int8 window chunk softcap sinks": (
            "int8", "prefill", {"variant": {"window": 128, "chunk": 512, "softcap": 30.0, "sinks": 1}},
        ),
        "prefill f16 chunk": ("f16", "prefill", {"variant": {"chunk": 128}}),
        # the 4-bit sink-and-window pool's kernel (ops/triton_q4w.py) over 1024 positions (15 pages sealed); four
        # cases reach its every switch (8 compiles: ~5 s of CPU each)
        "decode q4w": ("q4w", "decode", {}),
        "decode q4w no hilo block_n 64": ("q4w", "decode", {"hilo": False, "block_n": 64}),
        "decode q4w kv_starts split window sinks": (
            "q4w", "decode_starts", {"num_splits": 4, "variant": {"window": 1000, "sinks": 1}},
        ),
        "prefill q4w window chunk softcap sinks": (
            "q4w", "prefill", {"variant": {"window": 128, "chunk": 512, "softcap": 30.0, "sinks": 1}},
        ),
    }


@dataclasses.dataclass
class Result:
    case: str
    kernel: str
    arch: int
    seconds: float
    regs: int | None = None
    stack: int | None = None
    shared: int | None = None
    sass: int | None = None
    local_ops: int | None = None
    i2f: int | None = None
    prmt: int | None = None
    error: str | None = None


# --------------------------------------------------------------------------------------------------------
# recording the launches of one case
# --------------------------------------------------------------------------------------------------------
def record_case(fmt_name: str, kind: str, options: dict):
    """The launches the wrappers issue for one case, with GPU block-size defaults, on CPU tensors."""
    from int8kv.cache.paged import PagedKvCache
    from int8kv.formats import KvStorageFormat
    from int8kv.ops import triton as tk
    from int8kv.ops.plan import check_variant, plan_attention

    batch, hq, hkv, dim, page, ctx = (
        SHAPE[k] for k in ("batch", "q_heads", "kv_heads", "head_dim", "block_size", "context")
    )
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    if fmt_name == "q4w":
        cache, tables = _q4w_pool(batch, hkv, dim, ctx)
    else:
        fmt = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1 if fmt_name == "int8" else KvStorageFormat.F16
        width = ctx // page
        cache = PagedKvCache(batch * width, page, 1, hkv, dim, fmt, "cpu")
        tables = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width)
    options = dict(options)
    variant = options.pop("variant", None)
    if variant is not None:
        variant = dict(variant)
        if variant.get("sinks"):
            variant["sinks"] = torch.zeros(hq)
        options["variant"] = check_variant(cache, hq, **variant)
    with tk.record_launches() as launches:
        if kind == "append":
            k = torch.zeros((batch, hkv, dim), dtype=torch.float16)
            tk.store_rows(cache, 0, k, k, torch.arange(batch, dtype=torch.int64) * page)
        elif kind in ("decode", "decode_starts"):
            q = torch.zeros((batch, hq, dim))
            starts = torch.zeros(batch, dtype=torch.int32) if kind == "decode_starts" else None
            plan = plan_attention(cache, tables, lens, kv_starts=starts)
            tk.attention(cache, 0, q, plan, gpu=True, **options)
        else:  # a 256-token chunk per sequence
            n = 256
            q = torch.zeros((batch * n, hq, dim))
            cu = torch.arange(batch + 1, dtype=torch.int32) * n
            plan = plan_attention(cache, tables, lens, cu_seqlens_q=cu, num_queries=batch * n)
            tk.attention(cache, 0, q, plan, gpu=True, **options)
    return launches


def _q4w_pool(batch: int, heads: int, dim: int, ctx: int):
    """A one-layer 4-bit sink-and-window pool (int8kv.cache.pool_q4w) holding ``ctx`` positions of ``batch``
    sequences, written as one prefill step (its pages sealed, its window rows held); (pool, block_tables)."""
    import torch

    from int8kv import ops
    from int8kv.cache.pool_q4w import Int4SinkWindowPool
    from int8kv.ops.plan import plan_attention

    width = -(-ctx // 64)
    pool = Int4SinkWindowPool(1, heads, dim, batch * width, batch * width, batch, "cpu")
    tables = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32) * ctx
    rows = torch.randn((batch * ctx, heads, dim), generator=torch.Generator().manual_seed(0))
    ops.append_paged_kv(pool, 0, rows, rows, plan=plan_attention(pool, tables, lens, cu_seqlens_q=cu))
    return pool, tables


_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def specialise(launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) for ``triton.compile``, as the JIT specialises a launch."""
    fn = launch.kernel
    names = fn.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list] = {}
    divisible = [["tt.divisibility", 16]]
    for i, (name, value) in enumerate(zip(names, launch.args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = divisible
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = divisible
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot specialise argument {name}={value!r}")
    options = {}
    for name, value in launch.kwargs.items():
        if name in ("num_warps", "num_stages"):
            options[name] = value
        else:
            signature[name], constexprs[name] = "constexpr", value
    missing = [n for n in names if n not in signature]
    if missing:
        raise TypeError(f"{fn.__name__}: launch leaves {missing} unset")
    return signature, constexprs, attrs, options


# --------------------------------------------------------------------------------------------------------
# compiling and reading the machine code
# --------------------------------------------------------------------------------------------------------
def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path)


def _sass_counts(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        # One call for both: the resource summary, then the SASS listing.
        dump = subprocess.run([_tool("cuobjdump"), "-res-usage", "-sass", f.name], capture_output=True, text=True)
    counts = {}
    for key, pattern in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("static_shared", r"SHARED:(\d+)")):
        m = re.search(pattern, dump.stdout)
        counts[key] = int(m.group(1)) if m else -1
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", dump.stdout)
    counts["sass"] = len(ops)
    counts["local_ops"] = sum(op in ("LDL", "STL") for op in ops)
    counts["i2f"] = sum(op.startswith("I2F") for op in ops)
    counts["prmt"] = sum(op == "PRMT" for op in ops)
    return counts


def compile_launch(launch, arch: int):
    """``triton.compile`` of one recorded launch for ``sm_<arch>``; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialise(launch)
    src = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def run_cases(names: list[str], archs: list[int], say=print) -> list[Result]:
    cases = _cases()
    results: list[Result] = []
    for name in names:
        fmt_name, kind, options = cases[name]
        try:
            launches = record_case(fmt_name, kind, options)
        except Exception as exc:
            results.append(Result(name, "-", 0, 0.0, error=f"{type(exc).__name__}: {exc}"))
            say(f"FAILED {name}: recording: {exc}")
            continue
        for launch in launches:
            kernel = launch.kernel.__name__
            for arch in archs:
                start = time.perf_counter()
                res = Result(name, kernel, arch, 0.0)
                try:
                    compiled = compile_launch(launch, arch)
                    counts = _sass_counts(compiled.asm["cubin"])
                    res.regs, res.stack, res.sass = counts["regs"], counts["stack"], counts["sass"]
                    res.local_ops, res.i2f, res.prmt = counts["local_ops"], counts["i2f"], counts["prmt"]
                    res.shared = int(compiled.metadata.shared) + max(0, counts["static_shared"])
                except Exception as exc:
                    res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc) else ''}"
                    traceback.print_exc()
                res.seconds = time.perf_counter() - start
                results.append(res)
                say(_row(res))
    return results


_HEADER = "| case | kernel | sm | regs | stack B | LDL+STL | shared B | SASS | I2F | PRMT | compile s |"


def _row(r: Result) -> str:
    if r.error:
        return f"| {r.case} | {r.kernel} | {r.arch} | FAILED: {r.error} |"
    return (
        f"| {r.case} | {r.kernel} | {r.arch} | {r.regs} | {r.stack} | {r.local_ops} | {r.shared} | {r.sass} "
        f"| {r.i2f} | {r.prmt} | {r.seconds:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m int8kv.bench.gpu_compile", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (default 90 80)")
    parser.add_argument("--only", nargs="+", metavar="CASE", help="case names to compile (default: all)")
    parser.add_argument("--list", action="store_true", help="list the case names and exit")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(_cases()))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_compile: TRITON_INTERPRET is set; run without it (the interpreter compiles nothing)")
        return 2
    import triton

    names = args.only or list(_cases())
    unknown = [n for n in names if n not in _cases()]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list shows them")
    print(f"gpu_compile: triton {triton.__version__}, torch {torch.__version__}, shape {SHAPE}", flush=True)
    print(_HEADER)
    print("|" + "---|" * (_HEADER.count("|") - 1), flush=True)
    start = time.perf_counter()
    results = run_cases(names, args.arch, say=lambda s: print(s, flush=True))
    failed = [r for r in results if r.error]
    print(
        f"gpu_compile: {len(results) - len(failed)} of {len(results)} compiled in {time.perf_counter() - start:.0f} s"
    )
    if args.json:
        payload = {"triton": triton.__version__, "shape": SHAPE, "results": [dataclasses.asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
