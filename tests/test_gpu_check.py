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
    "== prefill chunk vs float64 reference",
    "== 4-bit sink-and-window pool vs float64 reference",
    "== decode benchmark",
    "== prefill benchmark",
    "== pytest the Triton tests",
]


def _run(args: list[str], interpret: bool, tmp_path: Path, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
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
    assert "sdpa bf16 flash" in text and "prefill chunk 24: triton int8" in text
    # The pytest section ran its selection in two shards and both passed.
    assert text.count("| shard") == 2 and text.count("1 passed") == 2


def test_skipped_without_cuda_or_interpreter(tmp_path):
    done = _run(["--out", str(tmp_path / "check.log")], False, tmp_path)
    assert done.returncode == 3
    assert "skipped" in done.stdout
    assert not (tmp_path / "check.log").exists()


def test_failures_are_collected_and_later_sections_still_run(tmp_path):
    # Two sections fail (one raises, one reports a failed case); the sections after them still run and the
    # exit status is 1 with both failures listed. The heavy sections are replaced by cheap stand-ins.
    code = (
        "import sys\n"
        "import int8kv.bench.gpu_check as g\n"
        "def boom(*a, **k): raise RuntimeError('planted')\n"
        "def bad_case(rep, *a, **k): rep.fail('planted case', 'relative error 1e-1')\n"
        "def ok(rep, *a, **k): rep.say('  stand-in ran')\n"
        "g.compile_smoke = boom\n"
        "g.check_append = bad_case\n"
        "g.Workload = lambda *a, **k: None\n"
        "g.check_attention = g.check_prefill = g.check_q4w = ok\n"
        "sys.exit(g.main(sys.argv[1:]))\n"
    )
    log = tmp_path / "check.log"
    done = _run(["--smoke", "--skip-bench", "--skip-pytest", "--out", str(log)], True, tmp_path, code)
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert "RuntimeError: planted" in text
    assert text.count("stand-in ran") == 3
    assert "2 failed:" in text and "  - compile smoke" in text and "  - planted case" in text
