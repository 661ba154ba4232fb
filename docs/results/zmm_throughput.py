"""Throughput of one 512-bit multiply-add instruction on this CPU: vfmadd (float32, 16 products), vpdpwssd
(int16 pairs, 32 products) and vpdpbusd (uint8 x int8 quads, 64 products), each the only work of a loop of 8
independent accumulators (more than the latency of any of them needs to hide).

    python docs/results/zmm_throughput.py [OUT.json]

Needs AVX-512 F and VNNI. Prints ns per instruction and products per ns, best of 5 runs of 20 M iterations.
"""

import ctypes
import json
import sys
import time

import llvmlite.binding as llvm

KINDS = {  # name: (LLVM vector type, declaration, call, products per instruction)
    "vfmadd231ps": ("<16 x float>", "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
                    "call <16 x float> @llvm.fma.v16f32(<16 x float> %x, <16 x float> %y, <16 x float> {acc})", 16),
    "vpdpwssd": ("<16 x i32>", "declare <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32>, <16 x i32>, <16 x i32>)",
                 "call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> {acc}, <16 x i32> %x, <16 x i32> %y)", 32),
    "vpdpbusd": ("<16 x i32>", "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)",
                 "call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {acc}, <16 x i32> %x, <16 x i32> %y)", 64),
}
CHAINS = 8


def module(kind: str) -> str:
    ty, decl, call, _ = KINDS[kind]
    add = "fadd" if "float" in ty else "add"
    cast = "bitcast <16 x i32> %{0}i to <16 x float>" if "float" in ty else "add <16 x i32> %{0}i, zeroinitializer"
    phis = "\n  ".join(f"%a{i} = phi {ty} [zeroinitializer, %entry], [%b{i}, %loop]" for i in range(CHAINS))
    ops = "\n  ".join(f"%b{i} = " + call.format(acc=f"%a{i}") for i in range(CHAINS))
    sums = "\n  ".join([f"%t0 = {add} {ty} %b0, zeroinitializer"]
                       + [f"%t{i} = {add} {ty} %t{i - 1}, %b{i}" for i in range(1, CHAINS)])
    return f"""{decl}
define void @run(i64 %n, ptr %xp, ptr %yp, ptr %out) {{
entry:
  %xi = load <16 x i32>, ptr %xp, align 4
  %yi = load <16 x i32>, ptr %yp, align 4
  %x = {cast.format("x")}
  %y = {cast.format("y")}
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  {phis}
  {ops}
  %j = add i64 %i, 1
  %c = icmp ult i64 %j, %n
  br i1 %c, label %loop, label %done
done:
  {sums}
  store {ty} %t{CHAINS - 1}, ptr %out, align 4
  ret void
}}"""


def main() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    keep, rows = [], {}
    n = 20_000_000
    for kind, (_, _, _, products) in KINDS.items():
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2
        )
        mod = llvm.parse_assembly(module(kind))
        mod.verify()
        engine = llvm.create_mcjit_compiler(mod, tm)
        engine.finalize_object()
        keep.append((engine, mod))
        run = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
            engine.get_function_address("run")
        )
        buf = (ctypes.c_int32 * 48)(*([1] * 48))
        at = ctypes.addressof(buf)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            run(n, at, at, at)
            best = min(best, time.perf_counter() - start)
        ns = best / (n * CHAINS) * 1e9
        rows[kind] = {"ns_per_instruction": ns, "products_per_ns": products / ns}
        print(f"{kind:12s} {ns:.3f} ns per instruction, {products / ns:.1f} products per ns")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"cpu": llvm.get_host_cpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
