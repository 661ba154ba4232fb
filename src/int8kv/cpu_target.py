"""The x86 vector features int8kv's compiled code may use: the running CPU's, or fewer on request.

    INT8KV_CPU=avx2 python ...      # every kernel chosen and compiled as on an AVX2-only CPU (Zen 2, Haswell)

The CPU kernels pick their variant from the features numba compiles for (`ops.cpu_simd.target_features`), and
numba takes those from ``NUMBA_CPU_FEATURES`` or else the host. ``INT8KV_CPU=avx2`` turns every AVX-512, AVX-VNNI,
AVX10 and AMX feature off in that string before anything is compiled, so the variant choice and the machine code
agree, and numba's disk cache (keyed by the same string) keeps the two builds apart. torch and oneDNN are told the
same (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``) when they are not yet imported, so the model's own matmuls
run their AVX2 code too. Child processes inherit the variables. ``INT8KV_CPU=native`` (or unset) changes nothing.

This runs when the package is imported (``int8kv/__init__``), before any kernel module: a process that compiled
numba code before importing int8kv cannot change its target any more and is refused (`UnsupportedCpuSwitch`).
"""

from __future__ import annotations

import os
import sys

__all__ = ["CHOICES", "SWITCH", "apply_switch", "reduced_features"]

SWITCH = "INT8KV_CPU"
CHOICES = ("native", "avx2")
# LLVM feature names (without the sign) an AVX2-only x86 CPU lacks among those numba may be handed.
_BEYOND_AVX2 = ("avx512", "avxvnni", "avx10", "amx", "avxifma", "avxneconvert", "vpclmulqdq", "vaes", "gfni")


class UnsupportedCpuSwitch(ValueError):
    """INT8KV_CPU names no choice, or came too late in the process to take effect."""


def reduced_features(features: str) -> str:
    """An LLVM feature string (``+avx2,+avx512f,...``) with every feature beyond AVX2 turned off."""
    out = []
    for flag in filter(None, features.split(",")):
        name = flag[1:] if flag[0] in "+-" else flag
        out.append(f"-{name}" if name.startswith(_BEYOND_AVX2) else flag)
    return ",".join(out)


def _codegen_started() -> bool:
    """Whether numba in this process has already built its CPU code generator (its target is then fixed)."""
    registry = sys.modules.get("numba.core.registry")
    target = getattr(registry, "cpu_target", None)
    return target is not None and "_toplevel_target_context" in vars(target)


def apply_switch(environ: dict[str, str] | None = None) -> str:
    """Apply INT8KV_CPU (module docs) to ``environ`` (default: this process's) and return the choice in force."""
    env = os.environ if environ is None else environ
    choice = env.get(SWITCH, "native").strip().lower() or "native"
    if choice not in CHOICES:
        raise UnsupportedCpuSwitch(f"{SWITCH}={env[SWITCH]!r}: expected one of {CHOICES}")
    if choice == "native":
        return choice
    current = env.get("NUMBA_CPU_FEATURES")
    if current is None:
        from llvmlite import binding

        current = binding.get_host_cpu_features().flatten()
    reduced = reduced_features(current)
    if reduced != current:
        if environ is None and _codegen_started():
            raise UnsupportedCpuSwitch(
                f"{SWITCH}={choice}: numba compiled code in this process before int8kv was imported; "
                "set the variable before starting Python")
        env["NUMBA_CPU_FEATURES"] = reduced
    env.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    if environ is None and "numba" in sys.modules:
        from numba.core import config

        config.reload_config()
    return choice
