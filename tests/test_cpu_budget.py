"""The CPUs a process may use (int8kv.cpu_budget) and the AVX2 switch (int8kv.cpu_target): cgroup hierarchies laid
out in the test's own directory, the environment handed as a dict (nothing in the process changes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from int8kv import cpu_budget, cpu_target


def _v2(tmp_path, rel: str, limits: dict[str, str]):
    """A cgroup v2 tree under tmp_path/fs with cpu.max files at the given relative paths, and a /proc/self/cgroup."""
    root = tmp_path / "fs"
    for where, text in limits.items():
        d = root / where if where else root
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text)
    (root / rel).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::/{rel}\n")
    return proc, root


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc, root = _v2(tmp_path, "kubepods/pod1/ctr", {"kubepods": "400000 100000", "kubepods/pod1": "max 100000",
                                                     "kubepods/pod1/ctr": "150000 100000"})
    assert cpu_budget.cgroup_quota(proc, root) == pytest.approx(1.5)
    proc, root = _v2(tmp_path / "b", "a/b", {"a": "50000 100000", "a/b": "max 100000"})
    assert cpu_budget.cgroup_quota(proc, root) == pytest.approx(0.5)


@pytest.mark.parametrize("text", ["max 100000", "", "garbage", "10 0", "-1 100000", "1 2 3"])
def test_cgroup_v2_without_a_quota_or_with_nonsense_is_no_limit(tmp_path, text):
    proc, root = _v2(tmp_path, "x", {"x": text})
    assert cpu_budget.cgroup_quota(proc, root) is None


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "fs"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("250000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert cpu_budget.cgroup_quota(proc, root) == pytest.approx(2.5)
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cpu_budget.cgroup_quota(proc, root) is None


def test_missing_files_and_hostile_paths_mean_no_limit(tmp_path):
    assert cpu_budget.cgroup_quota(tmp_path / "absent", tmp_path) is None
    fifo = tmp_path / "cgroup"
    os.mkfifo(fifo)
    proc, root = _v2(tmp_path / "t", "../../etc", {})  # ".." in the cgroup path goes nowhere above the root
    assert cpu_budget.cgroup_quota(proc, root) is None
    d = tmp_path / "fs2" / "g"
    d.mkdir(parents=True)
    os.mkfifo(d / "cpu.max")  # a FIFO where the file should be: opening it must not block
    (tmp_path / "c2").write_text("0::/g\n")
    # A FIFO opened for reading blocks until a writer comes; cgroup_quota must not open non-regular files.
    assert cpu_budget.cgroup_quota(tmp_path / "c2", tmp_path / "fs2") is None


def test_available_cpus_takes_the_smaller_of_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_budget, "cgroup_quota", lambda: None)
    assert cpu_budget.available_cpus() == 4
    monkeypatch.setattr(cpu_budget, "cgroup_quota", lambda: 1.5)
    assert cpu_budget.available_cpus() == 2
    monkeypatch.setattr(cpu_budget, "cgroup_quota", lambda: 0.2)
    assert cpu_budget.available_cpus() == 1
    monkeypatch.setattr(cpu_budget, "cgroup_quota", lambda: 16.0)
    assert cpu_budget.available_cpus() == 4


def test_apply_budget_sizes_numbas_pool_only_when_restricted_and_unset(monkeypatch):
    monkeypatch.setattr(cpu_budget, "available_cpus", lambda: 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delitem(sys.modules, "numba", raising=False)  # as before numba's import
    env: dict[str, str] = {}
    assert cpu_budget.apply_budget(env) == 1 and env == {"NUMBA_NUM_THREADS": "1"}
    env = {"NUMBA_NUM_THREADS": "6"}
    cpu_budget.apply_budget(env)
    assert env == {"NUMBA_NUM_THREADS": "6"}  # the user's choice stands
    monkeypatch.setattr(cpu_budget, "available_cpus", lambda: 8)
    env = {}
    cpu_budget.apply_budget(env)
    assert env == {}  # nothing restricted: numba's own default


def test_a_quota_in_a_child_sizes_numbas_pool(tmp_path):
    """The real import path: a child process whose affinity is one CPU gets a numba pool of one."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs and sched_setaffinity")
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); import int8kv, numba; "
            "print(numba.config.NUMBA_NUM_THREADS)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


# -- the AVX2 switch --------------------------------------------------------------------------------------------
def test_reduced_features_turn_off_everything_beyond_avx2():
    features = "+avx,+avx2,+fma,+f16c,+avx512f,+avx512vnni,+avxvnni,+amx-int8,-avx512bw,+avx10.1-512,+sse4.2"
    reduced = cpu_target.reduced_features(features).split(",")
    assert {"+avx", "+avx2", "+fma", "+f16c", "+sse4.2"} <= set(reduced)
    assert {"-avx512f", "-avx512vnni", "-avxvnni", "-amx-int8", "-avx512bw", "-avx10.1-512"} <= set(reduced)
    assert len(reduced) == len(features.split(","))


def test_switch_sets_numbas_target_and_torchs_capability():
    env = {"INT8KV_CPU": "avx2", "NUMBA_CPU_FEATURES": "+avx2,+avx512f,+avx512vnni"}
    assert cpu_target.apply_switch(env) == "avx2"
    assert env["NUMBA_CPU_FEATURES"] == "+avx2,-avx512f,-avx512vnni"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = {"INT8KV_CPU": "native"}
    assert cpu_target.apply_switch(env) == "native" and env == {"INT8KV_CPU": "native"}
    with pytest.raises(cpu_target.UnsupportedCpuSwitch, match="avx3"):
        cpu_target.apply_switch({"INT8KV_CPU": "avx3"})
    assert issubclass(cpu_target.UnsupportedCpuSwitch, ValueError)


def test_switch_in_a_child_picks_the_avx2_variant_and_torchs_avx2_kernels():
    code = ("import int8kv, torch; from int8kv.ops import cpu_simd; "
            "print(cpu_simd.DOT, torch.backends.cpu.get_cpu_capability())")
    env = {**os.environ, "INT8KV_CPU": "avx2"}
    env.pop("NUMBA_CPU_FEATURES", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dot, capability = done.stdout.split()
    assert dot in ("avx2", "None") and capability in ("AVX2", "DEFAULT")


def test_switch_after_numba_compiled_is_refused_by_name():
    code = ("import numba\n@numba.njit\ndef f(x):\n    return x + 1\nf(1)\n"
            "import os\nos.environ['INT8KV_CPU'] = 'avx2'\n"
            "from int8kv.cpu_target import apply_switch\napply_switch()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("INT8KV_CPU", "NUMBA_CPU_FEATURES")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if "+avx512f" not in done.stderr and done.returncode == 0:
        pytest.skip("this CPU has nothing beyond AVX2: the switch changes nothing, so nothing is refused")
    assert done.returncode != 0 and "UnsupportedCpuSwitch" in done.stderr and "before starting Python" in done.stderr
