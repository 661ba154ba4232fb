"""``python -m int8kv.bench.gpu_check``: runs end to end on the CPU interpreter, logs what it prints, says
"skipped" with its own exit status when there is nothing to run on, and never stops at the first failure.

Each run is a fresh process (the script decides compiler or interpreter before importing Triton) with CUDA
hidden, so on a GPU machine these tests still exercise the CPU paths. The smoke run took 75 s on the
shared 2-core VM (~40 s of CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = [
    "== compile smoke",
    "== append: bit-exact V1 quantize",
    "== decode vs float64 reference, every shape and switch",
    "== prefill chunk and ragged prefill vs float64 reference",
    "== decode benchmark",
    "== prefill benchmark",
    "== 4-bit sink-and-window pool vs float64 reference",
    "== pytest the Triton tests",
]


def _run(
    args: list[str], interpret: bool, tmp_path: Path, code: str | None = None, path: str | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if path is not None:
        env["PATH"] = path
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "int8kv.bench.gpu_check", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


def test_smoke_runs_end_to_end_under_the_interpreter(tmp_path):
    log = tmp_path / "check.log"
    done = _run(["--smoke", "--out", str(log), "--budget", "850"], True, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = log.read_text()
    assert text == done.stdout  # everything printed is in the log
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    assert "FAIL" not in text and text.rstrip().endswith("gpu_check: all passed")
    assert "bit-exact vs quantize_int8" in text and "worst rel err: default=" in text
    assert "q4w pool, lengths [4, 131]: worst rel err: default=" in text
    assert "ragged prefill 3 + 13 tokens int8 default  rel err" in text
    assert "ragged prefill 3 + 13 tokens f16  1 split  rel err" in text
    assert "sdpa bf16 flash" in text and "prefill chunk 24: triton int8" in text
    # The pytest section ran its selection in two shards and both passed.
    assert text.count("| shard") == 2 and text.count("1 passed") == 2


def test_skipped_without_cuda_or_interpreter(tmp_path):
    done = _run(["--out", str(tmp_path / "check.log")], False, tmp_path)
    assert done.returncode == 3
    assert "skipped" in done.stdout
    assert not (tmp_path / "check.log").exists()


# Stand-ins for the heavy sections, in the parent and in every section's process (child_command runs this same
# code): compile smoke raises, append reports a failed case, decode and prefill pass, and the 4-bit section
# faults (an error that ends a CUDA context) at a case it names; "--case" runs one case alone, which faults
# too but for the launch with 4 warps.
STAND_INS = """
import sys
import int8kv.bench.gpu_check as g
def boom(*a, **k): raise RuntimeError('planted')
def bad_case(rep, *a, **k): rep.fail('planted case', 'relative error 1e-1')
def ok(rep, *a, **k): rep.say('  stand-in ran')
def fault(rep, sh, device, case=None):
    rep.say(f'  stand-in q4w case={case}')
    if case == '1:warps 4':
        rep.say(f'  q4w case {case} at lengths [701, 1001]: ran, rel err 1.0e-07')
        return
    rep.case = case or '1:block_n 16'
    try:
        raise RuntimeError('CUDA error: an illegal memory access was encountered')
    except Exception:
        rep.fail('q4w lengths [701, 1001] block_n 16')
    rep.say('  not reached: the context is lost')
g.compile_smoke = boom
g.check_append = bad_case
g.Workload = lambda *a, **k: None
g.check_attention = g.check_prefill = ok
g.check_q4w = fault
g.child_command = lambda: [sys.executable, '-c', CODE]
sys.exit(g.main(sys.argv[1:]))
"""


def _stand_in_run(tmp_path: Path, path_dirs: list[Path]) -> tuple[subprocess.CompletedProcess, str]:
    code = "CODE = " + repr(STAND_INS) + "\n" + STAND_INS
    log = tmp_path / "check.log"
    env_path = os.pathsep.join([*map(str, path_dirs), os.environ.get("PATH", "")])
    done = _run(["--smoke", "--skip-bench", "--skip-pytest", "--out", str(log)], True, tmp_path, code, env_path)
    return done, log.read_text()


def test_failures_are_collected_and_a_fault_is_probed_and_run_under_memcheck(tmp_path):
    # Three sections fail (one raises, one reports a failed case, one faults in its own process); every section
    # after them still runs and the exit status is 1 with each failure listed. The faulting step then runs once
    # per launch, each in a fresh process, and the faulting case alone under compute-sanitizer: a stand-in on
    # PATH here (the CPU has none) that prints a memcheck-style line with its first and last arguments and runs
    # the command it was given, with the caching allocator off.
    tool = tmp_path / "bin" / "compute-sanitizer"
    tool.parent.mkdir()
    tool.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do p4="$p3"; p3="$p2"; p2="$p1"; p1="$a"; done\n'
        'echo "========= stand-in memcheck caching=$PYTORCH_NO_CUDA_MEMORY_CACHING $1 $2 ... $p4 $p3 $p2 $p1"\n'
        'while [ "$1" != "--print-limit" ]; do shift; done; shift 2\n'
        'exec "$@"\n'
    )
    tool.chmod(0o755)
    done, text = _stand_in_run(tmp_path, [tool.parent])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RuntimeError: planted" in text
    assert text.count("stand-in ran") == 2  # decode and prefill, each in its own process
    assert "  FAULT 1:block_n 16" in text and "not reached" not in text
    assert "3 failed:" in text and "  - compile smoke" in text and "  - planted case" in text
    assert "  - q4w lengths [701, 1001] block_n 16" in text
    probes = [x for x in text.splitlines() if x.startswith("  | ")]
    assert len(probes) == 8 and sum(x.endswith("FAULT") for x in probes) == 7  # every launch but warps 4
    assert any("warps 4" in x and x.endswith("ran, rel err 1.0e-07") for x in probes)
    assert "memcheck of case '1:block_n 16'" in text
    line = next(x for x in text.splitlines() if "stand-in memcheck" in x)
    assert "caching=1" in line and "--tool memcheck" in line and "--section q4w --case 1:block_n 16" in line
    assert "memcheck exit status 1, 1 report line(s)" in text


@pytest.mark.parametrize("case", ["0:block_m 16", "1:window softcap sinks"])
def test_one_case_of_the_4bit_check_runs_alone(tmp_path, case):
    # What the probes and the memcheck run call: the steps' writes up to the case's step, then that one launch
    # against the reference (a prefill step on a switch, a decode step on the windowed variant).
    done = _run(["--smoke", "--section", "q4w", "--case", case], True, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    line = done.stdout.rstrip().splitlines()[-1]
    assert line.startswith(f"  q4w case {case} at lengths ") and "ran, rel err" in line
    assert float(line.rsplit(" ", 1)[1]) < 1e-5


def test_the_4bit_tests_get_shards_of_their_own():
    # A fault of the 4-bit kernel fails every later test of its process: its tests never share a shard with
    # the INT8 / F16 kernels' ones; no shard is empty (pytest without ids would run the whole suite).
    from int8kv.bench.gpu_check import shard_ids

    ints = [f"tests/test_ops_triton.py::t{i}" for i in range(10)]
    q4w = [f"tests/test_triton_q4w.py::t{i}" for i in range(3)] + ["tests/test_engine_q4w_triton.py::e"]
    for shards in (1, 2, 3, 8, 20):
        groups = shard_ids(ints + q4w, shards)
        assert sorted(sum(groups, [])) == sorted(ints + q4w) and all(groups) and len(groups) <= shards
        if shards > 1:
            assert all(set(g) <= set(ints) or set(g) <= set(q4w) for g in groups)
            assert sum(set(g) <= set(q4w) for g in groups) == min(len(q4w), max(1, shards // 4))
    assert shard_ids(ints[:3], 8) == [[x] for x in ints[:3]]


def test_a_fault_a_section_lets_out_ends_only_that_section(monkeypatch, capsys):
    # An error that ends the CUDA context raised outside any case's handler (while building a section's inputs,
    # say) is counted, said as a FAULT, and ends the section's process with status 1, not with a traceback.
    from int8kv.bench import gpu_check as g

    def body(rep, sh, device, case):
        rep.case = "0:default"
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(g.ISOLATED, "q4w", ("4-bit stand-in", body))
    assert g.run_section(g.SMOKE, "q4w", None, None, 60.0) == g.EXIT_FAILED
    out = capsys.readouterr().out
    assert "  FAIL q4w\n" in out and "  FAULT 0:default" in out and "ContextLost" not in out
