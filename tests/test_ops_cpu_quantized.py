"""The quantized-query path of the CPU kernel (`precision="int16"`, the default) and the thread choice.

The int16 path quantizes each (decode row, head) of q to int16 codes with one float32 scale (the softmax scale
folded into it) and multiplies them with the INT8 key codes in int32, in the integer vector kernels
(`cpu_simd.qk16i`, the variant of this CPU; tests/test_ops_cpu_simd.py checks each). Everything after the
logits is the exact path's float32. An int8 query is not offered (+0.24 pp of perplexity): its name is refused.
Two checks per case, both against the float64 reference on fresh random inputs (pools poisoned as in
test_ops_cpu.py):
  1. it equals the reference run on the dequantized query (codes x scale) to float32 tolerance: the only
     change from the exact path is the query's rounding;
  2. it stays within the derived bound from the reference on the true query (docs/design.md, "Quantized
     query"): with u = softmax_scale * q = s n + e, |e_i| <= s / 2, every logit moves by at most
     delta = max_t |e . k_t| <= s / 2 * max_t |k_t|_1, every weight by a factor within e^(+-2 delta), so
     |out - ref|_i <= (e^(2 delta) - 1) * max_t |v_t,i| (k, v decoded, t over the visible keys). Checked with
     the worst case (s / 2 |k|_1, the bound a caller can compute beforehand) and with the actual rounding
     error e (tighter, computed afterwards).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_ops_cpu import F16, FORMATS, INT8, TOL, build, one_torch_thread, rel_err, starts_for  # noqa: F401

from int8kv.errors import UnknownBackend
from int8kv.ops import attention, cpu, plan_attention, reference
from int8kv.ops.plan import PRECISION_ENV
from int8kv.ops.reference import gather_kv


def _quantized(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of u = softmax_scale * q as the int16 path rounds it (it quantizes q and folds the
    softmax scale into the scales)."""
    codes, s = cpu.quantize_query_int16(q)
    return codes, s * scale


def dequantized(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The query the path effectively uses, in the units of q (softmax scale taken back out)."""
    codes, s = _quantized(q, scale)
    return (codes.double() * s.double().unsqueeze(2) / scale).float()


def bound(cache, layer, q, plan, actual: bool = False) -> torch.Tensor:
    """Per (query, head, dim) bound of |quantized path - exact reference| (module docs), float64 [n, Hq, D];
    worst case, or with the actual rounding error of the query (`actual`)."""
    u = (q * plan.softmax_scale).double()
    codes, s = _quantized(q, plan.softmax_scale)
    err = u - codes.double() * s.double().unsqueeze(2)  # [n, Hq, D]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu, lens = plan.cu_seqlens_q.tolist(), plan.context_lens.tolist()
    starts = [0] * plan.batch if plan.kv_starts is None else plan.kv_starts.tolist()
    group = q.shape[1] // cache.num_kv_heads
    for b in range(plan.batch):
        lo, hi, n = cu[b], cu[b + 1], lens[b]
        if hi == lo or n <= starts[b]:
            continue
        k, v = gather_kv(cache.pool, layer, plan.block_tables[b], n)
        k, v = k[starts[b] :], v[starts[b] :]  # the visible keys (a superset for causal rows: a looser bound)
        vmax = v.abs().amax(dim=0).repeat_interleave(group, dim=0)  # [Hq, D]: max_t |v_t,i|
        if actual:  # max_t |e . k_t| per (row, head)
            kk = k.repeat_interleave(group, dim=1)  # [t, Hq, D]
            delta = torch.einsum("nhd,thd->nht", err[lo:hi], kk).abs().amax(dim=2)
        else:
            k1 = k.abs().sum(dim=2).amax(dim=0).repeat_interleave(group)  # [Hq]: max_t |k_t|_1
            delta = s[lo:hi].double() / 2 * k1  # [rows, Hq]
        out[lo:hi] = torch.expm1(2 * delta).unsqueeze(2) * vmax
    return out


def check(cache, tables, context, q, starts=None, layer=1):
    """The int16 path of a decode step (it quantizes decode steps only) against the float64 reference on its
    dequantized query (to TOL) and on the true query (within the bound)."""
    if cpu.cpu_simd.DOT is None:
        pytest.skip("no integer dot variant on this CPU: int16 runs the exact path (test_int16_query_falls_back...)")
    plan = plan_attention(cache.pool, tables, context, kv_starts=starts, precision="int16")
    out = attention(cache, layer, q, plan, backend="cpu")
    emulated = reference.paged_decode_attention(cache, layer, dequantized(q, plan.softmax_scale), tables, context,
                                                kv_starts=starts)  # fmt: skip
    exact = reference.paged_decode_attention(cache, layer, q, tables, context, kv_starts=starts)
    assert rel_err(out, emulated) < TOL
    slack = TOL * float(exact.abs().max())
    for actual in (False, True):
        excess = (out.double() - exact).abs() - bound(cache, layer, q, plan, actual)
        assert float(excess.max()) <= slack, f"beyond the derived error bound (actual rounding error: {actual})"
    return out, exact


# -- the quantizer ------------------------------------------------------------------------------------------
def test_quantize_query_int16_codes_and_rounding_error():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 6, 64, generator=gen) * torch.logspace(-3, 2, 6).view(1, 6, 1)
    q[1, 2] = 0.0
    q[3, 4, 7] = -1e4
    codes, s = cpu.quantize_query_int16(q)
    assert codes.dtype == torch.int16 and s.dtype == torch.float32 and s.shape == (5, 6)
    nonzero = s > 0
    assert bool((codes.abs().amax(dim=2)[nonzero] == cpu.QUERY_CODE_MAX).all())  # the full range, not beyond
    assert not codes[1, 2].any() and float(s[1, 2]) == 0.0
    err = (q.double() - codes.double() * s.double().unsqueeze(2)).abs()
    assert bool((err <= s.double().unsqueeze(2) * (0.5 + 1e-4)).all())
    assert float((err / q.abs().amax(dim=2, keepdim=True).clamp_min(1e-30)).max()) <= 1 / 65534 * 1.001


# -- decode against the reference ----------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_quantized_query_matches_reference_within_bound(block_size, head_dim, group):
    seed = 5000 + block_size * 100 + head_dim + group
    lens = [1, 37, 150, 0, 64 + block_size, 700]
    cache, tables, context = build(INT8, block_size, head_dim, 2, lens, seed)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=torch.Generator().manual_seed(seed))
    for starts in (None, starts_for(context, seed)):
        out, _ = check(cache, tables, context, q, starts=starts)
        assert not out[3].any()  # the empty sequence attends to nothing


# What the int16 query costs in accuracy, per integer-dot variant: the largest distance from a float64 attention
# over the stored values, as a fraction of that attention's largest |output|, on the shapes below (docs/formats.md
# states these). The integer sums are exact on every variant, so the figure is the query's rounding and does not
# depend on the CPU: measured 9.5e-5 (int16) and 1.5e-6 (exact) with vnni512 (Zen 4) and with avx2 (INT8KV_CPU=avx2
# on the same CPU); the bounds leave room for other random inputs. `make test` runs this under both.
INT16_ACCURACY = {"vnni512": 2.5e-4, "vnni256": 2.5e-4, "avx2": 2.5e-4}
EXACT_ACCURACY = 1e-5


def test_int16_query_accuracy_of_this_cpus_variant():
    variant = cpu.cpu_simd.DOT
    if variant is None:
        pytest.skip("no integer dot variant on this CPU: int16 runs the exact path")
    worst = {"int16": 0.0, "exact": 0.0}
    for seed, (head_dim, group) in enumerate([(64, 3), (128, 4), (64, 1), (128, 8)]):
        lens = [1, 37, 150, 700, 2048]
        cache, tables, context = build(INT8, 16, head_dim, 2, lens, 7100 + seed)
        q = torch.randn(len(lens), 2 * group, head_dim, generator=torch.Generator().manual_seed(seed)) * 2
        exact = reference.paged_decode_attention(cache, 1, q, tables, context)
        scale = float(exact.abs().max())
        for precision in worst:
            plan = plan_attention(cache.pool, tables, context, precision=precision)
            out = attention(cache, 1, q, plan, backend="cpu")
            worst[precision] = max(worst[precision], float((out.double() - exact).abs().max()) / scale)
    assert worst["int16"] <= INT16_ACCURACY[variant], (variant, worst)
    assert worst["exact"] <= EXACT_ACCURACY, (variant, worst)
    assert worst["int16"] > worst["exact"]  # the int16 path did run (it rounds the query)


def test_decode_split_keys_quantized_query():
    """One long sequence: its keys are split across work items and the partial states merged."""
    cache, tables, context = build(INT8, 16, 64, 3, [3000], seed=41)
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(41)) * 3
    check(cache, tables, context, q)
    check(cache, tables, context, q, starts=torch.tensor([2900], dtype=torch.int32))


def _exact_and(precision, cache, tables, context, q, cu=None):
    outs = []
    for p in ("exact", precision):
        plan = plan_attention(cache.pool, tables, context, cu_seqlens_q=cu, num_queries=q.shape[0], precision=p)
        outs.append(attention(cache, 1, q, plan, backend="cpu"))
    return outs


@pytest.mark.parametrize("head_dim", [48, 40])
def test_int16_query_falls_back_to_exact_where_the_integer_kernel_does_not_fit(head_dim):
    """head_dim 40 (not whole 16-lane vectors) always, 48 where the variant takes 32 int16 at a time (AVX-512
    VNNI): the exact path, bit for bit (the exact kernel itself runs such a call, whatever compiled it when).
    Elsewhere 48 runs the integer kernel and is checked as such."""
    cache, tables, context = build(INT8, 16, head_dim, 2, [150, 33], seed=49)
    q = torch.randn(2, 4, head_dim, generator=torch.Generator().manual_seed(49))
    exact, int16 = _exact_and("int16", cache, tables, context, q)
    if cpu.cpu_simd.int_fits(head_dim):  # never without an integer dot variant
        check(cache, tables, context, q)
        assert not torch.equal(exact, int16)
    else:
        assert torch.equal(exact, int16)


def test_int16_query_prefill_runs_exact():
    """The int16 path quantizes decode steps only: a prefill (one-token chunks included) is the exact path's."""
    cache, tables, context = build(INT8, 16, 64, 2, [70, 40, 9], seed=50)
    cu = torch.tensor([0, 20, 21, 30], dtype=torch.int32)
    q = torch.randn(30, 4, 64, generator=torch.Generator().manual_seed(50))
    exact, int16 = _exact_and("int16", cache, tables, context, q, cu)
    assert torch.equal(exact, int16)


def test_int16_query_error_is_that_of_the_query_rounding():
    """The int16 path does quantize (it differs from exact beyond float32 rounding), and its error stays below
    the bound computed from the actual rounding error, itself below the worst-case one."""
    cache, tables, context = build(INT8, 16, 64, 2, [500, 260], seed=51)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(51))
    out, exact = check(cache, tables, context, q)
    plan = plan_attention(cache.pool, tables, context, precision="int16")
    assert rel_err(out, exact) > 1e-7
    actual, worst = bound(cache, 1, q, plan, actual=True), bound(cache, 1, q, plan)
    assert bool((actual <= worst).all()) and float(actual.max()) < 0.5 * float(worst.max())


def test_f16_cache_ignores_quantized_precisions():
    """Only INT8 keys have codes to multiply in integers: an F16 cache runs the exact path either way."""
    cache, tables, context = build(F16, 16, 64, 2, [90, 33], seed=44)
    q = torch.randn(2, 4, 64)
    outs = [
        attention(cache, 1, q, plan_attention(cache.pool, tables, context, precision=p), backend="cpu")
        for p in ("exact", "int16")
    ]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], reference.paged_decode_attention(cache, 1, q, tables, context)) < TOL


def test_precision_names_and_environment_default(monkeypatch):
    cache, tables, context = build(INT8, 16, 64, 1, [10], seed=45)
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    assert plan_attention(cache.pool, tables, context).precision == "int16"
    monkeypatch.setenv(PRECISION_ENV, "exact")
    assert plan_attention(cache.pool, tables, context).precision == "exact"
    assert plan_attention(cache.pool, tables, context, precision="int16").precision == "int16"
    for bad in ("fp8", "", "INT8", "int4"):
        with pytest.raises(UnknownBackend, match="accepted: exact, int16"):
            plan_attention(cache.pool, tables, context, precision=bad)
    # The int8 query is refused by name, from the argument and from the environment, never run as another path.
    with pytest.raises(UnknownBackend, match=r"'int8' \(an int8 query costs \+0.24 pp"):
        plan_attention(cache.pool, tables, context, precision="int8")
    for name in ("int8", "fast"):
        monkeypatch.setenv(PRECISION_ENV, name)
        with pytest.raises(UnknownBackend, match=repr(name)):
            plan_attention(cache.pool, tables, context)
    assert plan_attention(cache.pool, tables, context, precision="exact").precision == "exact"


# -- threads ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_thread_or_all_give_the_same_bits(fmt, monkeypatch):
    """The thread choice changes who runs the work items, never the items: outputs are bit-identical."""
    cache, tables, context = build(fmt, 16, 64, 3, [2000, 5], seed=46)
    q = torch.randn(2, 9, 64)
    outs = []
    for parallel in (False, True):
        monkeypatch.setattr(cpu.ThreadChoice, "parallel", lambda self, work, threads, p=parallel: p)
        for precision in ("exact", "int16"):
            plan = plan_attention(cache.pool, tables, context, precision=precision)
            outs.append(attention(cache, 1, q, plan, backend="cpu"))
    assert all(torch.equal(outs[i], outs[i + 2]) for i in range(2))


def test_each_kind_of_call_has_its_own_thread_choice(monkeypatch):
    """Decode and prefill, INT8 and F16, exact and int16 query cost different amounts per unit of work: each kind
    gets its own cost model (F16 runs the exact path whatever the precision asked, and so does INT8 on a CPU
    without an integer dot variant)."""
    seen = []
    real = cpu.thread_choice
    monkeypatch.setattr(cpu, "thread_choice", lambda key: seen.append(key) or real(key))
    for fmt in FORMATS:
        cache, tables, context = build(fmt, 16, 64, 3, [300, 40], seed=47)
        for precision in ("exact", "int16"):
            plan = plan_attention(cache.pool, tables, context, precision=precision)
            attention(cache, 1, torch.randn(2, 9, 64), plan, backend="cpu")
    kinds = 3 if cpu.cpu_simd.int_fits(64) else 2
    assert len(seen) == 4 and len(set(seen)) == kinds
    cache, tables, context = build(INT8, 16, 64, 3, [300, 40], seed=48)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    plan = plan_attention(cache.pool, tables, context, cu_seqlens_q=cu)
    attention(cache, 1, torch.randn(5, 9, 64), plan, backend="cpu")
    assert len(set(seen)) == kinds + 1 and seen[-1] not in seen[:-1]  # prefill: a model of its own


def test_thread_choice_follows_the_measured_costs():
    choice = cpu.ThreadChoice()
    choice.EXPLORE = 10**9  # no re-measuring: only the estimates decide
    big, small = 10**7, 10**3
    assert choice.parallel(big, 2) is False  # nothing measured yet: one thread first, twice
    choice.record(False, big, 2, 12e-3)
    assert choice.parallel(big, 2) is False
    choice.record(False, big, 2, 10e-3)  # the faster of the two first samples: 1 ns per unit on one thread
    assert choice.rate[(False, choice.group(big))] == pytest.approx(1e-9)
    for seconds in (9e-3, 6e-3):  # then the other mode, twice
        assert choice.parallel(big, 2) is True
        choice.record(True, big, 2, seconds)  # 0.6 ns per unit on two
    assert choice.parallel(big, 2) is True and choice.parallel(big + 1, 2) is True  # the same size group
    for mode, seconds in ((False, 1e-6), (False, 1e-6), (True, 20e-6), (True, 20e-6)):
        assert choice.parallel(small, 2) is mode
        choice.record(mode, small, 2, seconds)  # small calls: one thread 1 us, two threads 20 us (waking the pool)
    assert choice.parallel(small, 2) is False and choice.parallel(big, 2) is True  # each size its own answer
    assert choice.parallel(big, 1) is False and choice.parallel(0, 2) is False


def test_thread_choice_follows_a_change_of_cost_within_a_size():
    """The failure the size groups fixed, as a scenario: parallel loses while keys are cached and the pool is
    slow to wake, then wins once they come from DRAM; re-measuring notices within EXPLORE calls."""
    choice = cpu.ThreadChoice()
    choice.EXPLORE = 8
    work = 10**6
    cost = {False: 1e-3, True: 2e-3}
    for _ in range(40):
        mode = choice.parallel(work, 2)
        choice.record(mode, work, 2, cost[mode])
    assert choice.parallel(work, 2) is False
    cost = {False: 3e-3, True: 1.6e-3}
    modes = []
    for _ in range(40):
        mode = choice.parallel(work, 2)
        modes.append(mode)
        choice.record(mode, work, 2, cost[mode])
    assert modes.index(True) <= choice.EXPLORE  # taken up at its first re-measuring
    assert sum(modes[-20:]) >= 20 - choice.BURST  # and kept, bar one re-measuring burst of one thread


def _drive(choice, work: int, cost: dict, calls: int) -> list[bool]:
    """``calls`` calls of one size through ``choice``, each mode costing ``cost[mode]`` seconds, recorded when
    the choice asks for a measurement: the modes it ran."""
    modes = []
    for _ in range(calls):
        mode = choice.parallel(work, 2)
        modes.append(mode)
        if choice.timed:
            choice.record(mode, work, 2, cost[mode])
    return modes


def test_thread_choice_survives_a_delayed_call():
    """One call the OS held up for milliseconds (a thousand times the usual) must not hand a size group to the
    slower mode: it moves the chosen mode's estimate by at most DECAY x (CLIP - 1), and two threads stay chosen
    where they are 1.5x faster. Taken at face value, the same sample made the estimate 250x too high."""
    choice = cpu.ThreadChoice()
    work = 10**6
    cost = {False: 1.5e-3, True: 1e-3}
    _drive(choice, work, cost, 8)
    key = (True, choice.group(work))
    before = choice.rate[key]
    assert choice.parallel(work, 2) is True
    choice.record(True, work, 2, 1.0)  # the delayed call
    assert choice.rate[key] <= before * (1 + choice.DECAY * (choice.CLIP - 1)) * (1 + 1e-12)
    assert sum(_drive(choice, work, cost, 200)) >= 190  # two threads throughout, bar the re-measuring of one


def test_thread_choice_follows_a_sustained_rise():
    """Clipping bounds each sample, not a change that lasts: the chosen mode slowing down 10x for good hands
    the group to the other one within a few of its measured calls."""
    choice = cpu.ThreadChoice()
    choice.EXPLORE = 8
    work = 10**6
    _drive(choice, work, {False: 1.5e-3, True: 1e-3}, 8)
    modes = _drive(choice, work, {False: 1.5e-3, True: 1e-2}, 200)  # two threads now wait on every call
    assert sum(modes[-100:]) <= 3  # one thread, bar a re-measuring call


@pytest.mark.parametrize("seed", range(6))
def test_thread_choice_decides_a_settled_group_as_its_full_rules_do(seed):
    """A size group whose decision is settled is decided from `settled` (one dict read) until the other mode's
    re-measuring is due or a call is recorded: over random costs, sizes, load changes and delayed calls, a
    choice deciding that way makes the same decisions and asks for the same measurements, call for call, as
    one that applies the full rules at every call (its `settled` emptied before each)."""
    rng = np.random.default_rng(seed)
    fast, full = cpu.ThreadChoice(), cpu.ThreadChoice()
    for choice in (fast, full):
        choice.EXPLORE, choice.MAX_EXPLORE = 8, 64  # re-measurings and doubling waits within the run
    sizes = [10**3, 10**5, 10**6]
    cost = {False: 1e-3, True: 2e-3}
    shortcuts = 0
    for call in range(3000):
        if call % 500 == 0:
            cost = {False: float(rng.uniform(1e-4, 3e-3)), True: float(rng.uniform(1e-4, 3e-3))}
        work = sizes[int(rng.integers(0, len(sizes)))]
        full.settled.clear()
        group = fast.group(work)
        before = fast.settled.get(group)
        mode = fast.parallel(work, 2)
        shortcuts += before is not None and fast.calls[group] <= before[1]
        assert (mode, fast.timed, fast.exploring) == (full.parallel(work, 2), full.timed, full.exploring), call
        if fast.timed:
            seconds = cost[mode] * (1000.0 if rng.random() < 0.01 else float(rng.uniform(0.8, 1.2)))
            for choice in (fast, full):
                choice.record(mode, work, 2, seconds)
    assert fast.rate == full.rate and fast.wait == full.wait
    assert shortcuts > 1000  # the shortcut did decide most calls


def test_thread_choice_takes_up_a_mode_whose_first_calls_were_slow():
    """Two threads measured 20x slower than they are at first (the pool asleep, another process busy), then
    twice as fast as one: the first re-measuring call hands them the group. Decayed from its first figure, the
    estimate needed five re-measurements at doubling waits (thousands of calls)."""
    choice = cpu.ThreadChoice()
    work = 10**6
    _drive(choice, work, {False: 1e-3, True: 1e-2}, 4)  # both modes' first two measurements
    modes = _drive(choice, work, {False: 1e-3, True: 5e-4}, 600)
    # One thread until the first re-measuring, EXPLORE calls on (first samples that lose are no re-measuring:
    # doubling the wait for them put it 256 calls away), then two threads, bar re-measuring one.
    assert sum(modes[: choice.EXPLORE]) == 0 and modes.index(True) <= choice.EXPLORE + 1
    assert sum(modes[-200:]) >= 200 - 2 * choice.BURST


def test_thread_choice_re_measures_in_bursts_and_keeps_the_fastest():
    """A re-measured mode runs BURST calls in a row and the fastest stands: the first call after a long pause
    wakes the pool and pays for it every time (7-11 ms measured here), so a lone re-measuring call left two
    threads looking slower than one for good."""
    choice = cpu.ThreadChoice()
    work = 10**6
    _drive(choice, work, {False: 1e-3, True: 1e-2}, 4)  # both modes' first two measurements: two threads lose
    modes, waking = [], True
    for _ in range(600):
        mode = choice.parallel(work, 2)
        modes.append(mode)
        if choice.timed:
            # Two threads cost 0.5 ms, but the first parallel call after one-thread calls wakes the pool: 10 ms.
            seconds = (1e-2 if waking else 5e-4) if mode else 1e-3
            choice.record(mode, work, 2, seconds)
        waking = not mode
    assert sum(modes[-200:]) >= 200 - 2 * choice.BURST


def test_thread_choice_a_lucky_call_in_a_burst_does_not_hand_over_the_group():
    """One thread costs 1 ms a call but now and then 0.5 (a call that found its keys in cache); two threads
    0.8 ms. Re-measuring bursts of one thread meet that lucky call: their median stands, not their fastest, so
    two threads keep the group (the fastest handed it to one thread until its estimate rose again)."""
    choice = cpu.ThreadChoice()
    work = 10**6
    serial_calls = 0
    modes = []
    for _ in range(2000):
        mode = choice.parallel(work, 2)
        modes.append(mode)
        if not mode:
            serial_calls += 1
        if choice.timed:
            seconds = 8e-4 if mode else (5e-4 if serial_calls % 3 == 0 else 1e-3)
            choice.record(mode, work, 2, seconds)
    explorations = [i for i, m in enumerate(modes) if not m and modes[i - 1]]
    assert len(explorations) >= 3  # one thread was re-measured now and then
    assert len(modes) - sum(modes) <= choice.FIRST + choice.BURST * len(explorations)  # and only then


def test_thread_choice_ignores_calls_that_compiled():
    """A call that compiled a kernel (seconds=None) teaches nothing: one 0.2 s compile taken as a measurement
    once made every later call parallel."""
    choice = cpu.ThreadChoice()
    choice.EXPLORE = 10**9
    work = 10**6
    assert choice.parallel(work, 2) is False
    choice.record(False, work, 2, None)
    assert choice.rate == {} and choice.parallel(work, 2) is False  # still to be measured
    choice.record(False, work, 2, 1e-3)
    choice.parallel(work, 2)
    choice.record(False, work, 2, 1e-3)
    assert choice.parallel(work, 2) is True
    choice.record(True, work, 2, None)
    assert choice.parallel(work, 2) is True  # still to be measured
    choice.record(True, work, 2, 5e-3)  # measured: the second thread costs more than it saves
    choice.parallel(work, 2)
    choice.record(True, work, 2, 5e-3)
    assert choice.parallel(work, 2) is False


def test_thread_choice_explores_both_modes_and_backs_off():
    choice = cpu.ThreadChoice()
    choice.EXPLORE = 4
    modes = []
    for _ in range(200):
        mode = choice.parallel(10**6, 2)
        modes.append(mode)
        choice.record(mode, 10**6, 2, 1e-3 if not mode else 5.0)  # parallel is terribly slow here
    starts = [i for i, m in enumerate(modes) if m and not modes[i - 1]]
    runs = [len(run) for run in "".join("P" if m else "." for m in modes).split(".") if run]
    assert runs[0] == choice.FIRST and set(runs[1:]) == {choice.BURST}  # first samples, then bursts
    assert len(starts) >= 3  # parallel is still tried now and then, though it lost
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # and less and less often, as it keeps losing
    group = cpu.ThreadChoice.group(10**6)
    assert choice.wait[(True, group)] > 4 and choice.wait.get((False, group), 4) == 4


def test_thread_choice_times_exploring_calls_and_one_in_eight_others():
    choice = cpu.ThreadChoice()
    work = 10**6
    timed = []
    for _ in range(40):
        mode = choice.parallel(work, 2)
        timed.append((choice.timed, choice.exploring is not None))
        if choice.timed:
            choice.record(mode, work, 2, 1e-3 if not mode else 2e-3)
    assert all(t for t, exploring in timed if exploring)  # every measuring call is timed
    assert timed[:4] == [(True, True)] * 4  # both modes, twice each, first
    steady = [t for t, exploring in timed[4:] if not exploring]
    assert 0 < sum(steady) <= len(steady) // cpu.ThreadChoice.MEASURE_EVERY + 1
    choice.parallel(work, 1)
    assert choice.timed is False  # one thread only: nothing to choose, nothing to time


def _features_for(kind: str) -> str | None:
    """This machine's features with the better integer variants switched off, so numba compiles `kind` (None: this
    CPU cannot run it)."""
    features = cpu.cpu_simd.target_features()
    if kind not in cpu.cpu_simd.dots_for(features):
        return None
    better = cpu.cpu_simd.DOTS[: cpu.cpu_simd.DOTS.index(kind)]
    off = {"vnni512": ("avx512vnni",), "vnni256": ("avx512vnni", "avxvnni")}
    for flag in {f for k in better for f in off[k]}:
        features = features.replace(f"+{flag}", f"-{flag}")
    return features


@pytest.mark.parametrize("kind", ["avx2"])
def test_int16_query_on_the_variants_this_cpu_would_not_choose(kind):
    """The whole decode path compiled for a CPU without the better variants (NUMBA_CPU_FEATURES, which also keys
    numba's disk cache), in a child process on one thread: plain AVX2 (an AMD EPYC before Zen 4) against the
    float64 reference as above. Its compile is the cost (minutes on a loaded 2-core machine), so only AVX2 runs
    whole here; "vnni256" passes the same (run by hand: ``-k variants`` with it added); every variant's
    micro-kernel is checked in test_ops_cpu_simd.py, run where the CPU has it and compiled where it has not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not os.environ.get("INT8KV_TEST_ALL_VARIANTS"):
        pytest.skip("compiles the whole decode kernel again for another CPU (minutes): INT8KV_TEST_ALL_VARIANTS=1; "
                    "every variant's micro-kernel runs against float64 in test_ops_cpu_simd.py either way")
    features = _features_for(kind)
    if features is None:
        pytest.skip(f"this CPU cannot run {kind}")
    here = Path(__file__).parent
    env = {**os.environ, "NUMBA_CPU_FEATURES": features, "NUMBA_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import test_ops_cpu_quantized as t\n"
        f"assert t.cpu.cpu_simd.DOT == {kind!r}, t.cpu.cpu_simd.DOT\n"
        "t.test_decode_quantized_query_matches_reference_within_bound(16, 64, 3)\n"
        "t.test_decode_quantized_query_matches_reference_within_bound(32, 128, 8)\n"
        "t.test_int16_query_falls_back_to_exact_where_the_integer_kernel_does_not_fit(48)\n"
    )  # one compiled kernel (the int16 path's types) serves all three
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
