"""The engine's per-step thread choice (engine/step_threads.py): the rules on simulated step times, the idle-CPU
reading on /proc/stat files written here, the real switch of torch's and numba's thread counts, compiles left
out, and an engine whose outputs do not depend on it."""

from __future__ import annotations

import numba
import pytest
import torch

from int8kv.engine.step_threads import OtherLoad, StepChoice, StepThreads


def _drive(choice: StepChoice, costs, steps: int, tokens: int = 1, start: int = 0):
    """Runs `steps` simulated steps; costs(step, parallel) -> seconds. Returns the modes chosen."""
    modes = []
    for i in range(start, start + steps):
        parallel = choice.parallel(tokens, 2)
        modes.append(parallel)
        choice.record(parallel, tokens, costs(i, parallel))
    return modes


IDLE = {True: 0.010, False: 0.016}
BUSY = {True: 0.800, False: 0.017}  # another CPU-bound process: a parallel step waits for its thread at every op


def test_idle_machine_runs_parallel_and_a_loaded_one_serial_at_little_cost():
    def costs(i, parallel):
        return (IDLE if i < 300 else BUSY)[parallel]

    modes = _drive(StepChoice(), costs, 3300)
    assert sum(modes[50:300]) >= 0.9 * 250  # idle: parallel
    loaded = modes[300:]
    assert not any(loaded[5:40])  # the load noticed within a few steps
    # The losing mode, 47x slower, is asked rarely: the time lost to asking stays near OVERHEAD.
    spent = sum(costs(i + 300, m) for i, m in enumerate(loaded))
    best = len(loaded) * BUSY[False]
    assert spent <= (1 + 2.5 * StepChoice.OVERHEAD) * best + 2 * BUSY[True]


def test_a_change_of_the_chosen_modes_time_makes_the_other_due():
    """Waits long, then the load changes in a way the stale estimate of the other mode hides: the chosen mode's
    own time moving by 30 % either way sends the other to be measured at the next step."""
    choice = StepChoice()
    _drive(choice, lambda i, p: IDLE[p], 600)
    assert choice.due[choice.group(1)] - choice.calls[choice.group(1)] >= 8
    # One core taken: parallel slows to 0.015 (still under serial's stale 0.016) while serial now takes 0.011.
    modes = _drive(choice, lambda i, p: 0.015 if p else 0.011, 40)
    assert False in modes[:6] and sum(modes[8:40]) <= 2  # then parallel only when due again (16 steps)
    # A loaded phase on serial where serial's own time moves little never asks the slow mode more often.
    choice = StepChoice()
    modes = _drive(choice, lambda i, p: BUSY[p], 2000)
    assert sum(modes[10:]) <= 4


def test_make_due_asks_the_losing_mode_at_the_next_step_only():
    choice = StepChoice()
    _drive(choice, lambda i, p: BUSY[p], 500)
    choice.make_due(1)
    assert choice.parallel(1, 2) is True and choice.measuring
    choice.record(True, 1, IDLE[True])  # the load has gone: the re-measured figure stands whole
    assert choice.best(choice.group(1)) is True
    assert all(_drive(choice, lambda i, p: IDLE[p], 10))


def test_steps_of_different_sizes_decide_apart():
    choice = StepChoice()
    for _ in range(200):
        for tokens, fast_parallel in ((1, False), (512, True)):
            p = choice.parallel(tokens, 2)
            choice.record(p, tokens, (0.01 if p == fast_parallel else 0.03) * tokens)
    assert choice.best(choice.group(1)) is False and choice.best(choice.group(512)) is True


def test_a_new_step_size_borrows_a_measured_sizes_ratio():
    """Decode steps found parallel 47x slower under load: a prompt of another size starts on one thread and does
    not pay two slow parallel steps to learn it; where the measured size found the modes close, it measures both."""
    choice = StepChoice()
    _drive(choice, lambda i, p: BUSY[p], 100)
    modes = _drive(choice, lambda i, p: BUSY[p] * 30, 12, tokens=300)
    assert not any(modes)
    assert choice.best(choice.group(300)) is False
    choice = StepChoice()
    _drive(choice, lambda i, p: IDLE[p], 100)
    modes = _drive(choice, lambda i, p: IDLE[p] * 30, 4, tokens=300)
    assert modes[:2] == [True, True] and modes[2:] == [False, False]  # the near size's best first, then the other


def test_other_load_reads_the_affinity_cpus_of_proc_stat_less_its_own_time(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    stat = tmp_path / "stat"

    def write(busy0, busy1, busy2, idle=100):
        stat.write_text("cpu  1 2 3 999 0 0 0\n"
                        f"cpu0 {busy0} 0 5 {idle} 0 0 0 0\ncpu1 {busy1} 0 5 {idle} 0\ncpu2 {busy2} 0 5 {idle} 1 0 0 0\n"
                        "intr 5\n")

    own = {"t": 0.0}
    reader = OtherLoad(str(stat), own_seconds=lambda: own["t"])
    clock = iter([10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr("int8kv.engine.step_threads.time.monotonic", lambda: next(clock))
    write(100, 100, 100)
    assert reader() is None  # the first reading only sets the start
    # In one second cpu0 and cpu2 were busy the whole time (cpu1 is outside the mask), half a CPU of it ours.
    write(100 + reader.tick, 100 + 50 * reader.tick, 100 + reader.tick)
    own["t"] = 0.5
    assert reader() == pytest.approx(1.5)
    write(100 + reader.tick, 100, "x")
    assert reader() is None  # nonsense: no figure
    assert OtherLoad(str(tmp_path / "absent"))() is None


class _FakeClock:
    """time.perf_counter for StepThreads: each step advances it by that step's simulated cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_other_processes_on_the_cpus_keep_steps_on_one_thread_until_they_go(monkeypatch):
    """StepThreads.run itself, its clock simulated. Idle: parallel wins by measurement. Two CPU-bound processes
    arrive (others' load 2.0): every step on one thread within LOOK_EVERY steps, the slow parallel mode never
    measured, though a lucky parallel step is as fast as a serial one (the stalls set its mean). They leave:
    parallel is measured at once and takes over."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba's pool of two threads")
    import random

    rnd = random.Random(3)
    clock = _FakeClock()
    monkeypatch.setattr("int8kv.engine.step_threads.time.perf_counter", clock)
    phase = {"loaded": False}

    def cost(parallel):
        if not phase["loaded"]:
            return IDLE[parallel]
        return (0.5 if rnd.random() < 0.15 else 0.023) if parallel else 0.030

    before = torch.get_num_threads()
    try:
        runner = StepThreads(2, load=lambda: 2.0 if phase["loaded"] else 0.1)

        def step():
            clock.now += cost(numba.get_num_threads() > 1)
            return numba.get_num_threads()

        used = [runner.run(1, step) for _ in range(100)]
        assert sum(u == 1 for u in used[10:]) <= 4  # serial only when asked again (after 16, 32, 64 steps)
        phase["loaded"] = True
        used = [runner.run(1, step) for _ in range(400)]
        assert all(u == 1 for u in used[StepThreads.LOOK_EVERY:])
        phase["loaded"] = False
        used = [runner.run(1, step) for _ in range(100)]
        first = next(i for i, u in enumerate(used) if u > 1)
        assert first <= StepThreads.LOOK_EVERY + 1 and sum(u == 1 for u in used[first:]) <= 3
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_step_threads_sets_numbas_thread_count_and_skips_compiles():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba's pool of two threads")
    before = torch.get_num_threads()
    try:
        runner = StepThreads(2)
        seen = []

        def step():
            seen.append((torch.get_num_threads(), numba.get_num_threads()))
            return len(seen)

        for _ in range(6):
            runner.run(1, step)
        # numba's count switches; torch's stays (its matmul's last bits depend on its thread count)
        assert {s[1] for s in seen} == {1, 2} and {s[0] for s in seen} == {torch.get_num_threads()}
        assert runner.parallel_steps + runner.serial_steps == 6
        samples = dict(runner.choice.samples)

        counter = {"n": 0}

        def compiling_step():  # a new function each call: numba compiles it, so the step's time says nothing
            counter["n"] += 1
            f = numba.njit(lambda x, k=counter["n"]: x + k)
            return f(1)

        runner.run(1, compiling_step)
        assert runner.choice.samples == samples

        with pytest.raises(ZeroDivisionError):
            runner.run(1, lambda: 1 / 0)  # a failing step is not recorded either, and the error goes through
        assert runner.choice.samples == samples
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_one_thread_measures_nothing():
    before = torch.get_num_threads()
    try:
        runner = StepThreads(1)
        for _ in range(5):
            assert runner.run(3, lambda: numba.get_num_threads()) == 1
        assert runner.choice.samples == {}
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_engine_outputs_do_not_depend_on_its_threads():
    from transformers import LlamaConfig, LlamaForCausalLM

    from int8kv.engine import LLM, SamplingParams
    from int8kv.errors import InvalidEngineConfig

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(InvalidEngineConfig, match="threads"):
        LLM(model, memory="4MiB", threads=0)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, None):
            llm = LLM(model, memory="4MiB", threads=threads)
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert outs[0] == outs[1]
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
