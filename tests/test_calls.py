"""int8kv.ops.calls: a compiled function run over worker ranges by address (fan_out), and the checks around it.

The attention kernels run through it (tests/test_ops_cpu*.py cover those numerics); these tests pin the
mechanism itself on small functions: every item runs once whatever the split, the arguments reach the callee
(arrays, scalars, None), the address found for one argument-type tuple is refused for another, and a function
that returns a value is refused before any call."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from int8kv.ops.calls import INDEX, Compiled, fan_out, signature_tag


@njit
def _scaled_square(first, last, scale, offset, src, out):
    for i in range(first, last):
        out[i] += src[i] * src[i] * scale + (0.0 if offset is None else offset)


@njit
def _returns_a_value(first, last, out):
    return first + last


def _run(lists: np.ndarray, args: tuple) -> None:
    fan_out(*Compiled(_scaled_square).address((INDEX, INDEX, *args)), lists, args, 0, 0, ())


@pytest.mark.parametrize("cuts", [[0, 7], [0, 3, 7], [0, 0, 5, 7], [0, 1, 2, 3, 4, 5, 6, 7], [0, 7, 7]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_item_runs_once_for_any_split_of_the_workers(cuts, dtype):
    rng = np.random.default_rng(len(cuts))
    src = rng.standard_normal(7).astype(dtype)
    out = np.zeros(7, dtype)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        _run(np.array(cuts, np.int64), (2.5, None, src, out))
    finally:
        numba.set_num_threads(previous)
    want = src.astype(np.float64) ** 2 * 2.5
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_scalar_and_optional_arguments_reach_the_callee():
    src = np.arange(4, dtype=np.float64)
    out = np.zeros(4)
    _run(np.array([0, 2, 4], np.int64), (1.0, 10.0, src, out))
    np.testing.assert_array_equal(out, src**2 + 10.0)


def test_each_argument_type_tuple_has_its_own_address():
    compiled = Compiled(_scaled_square)
    f32 = compiled.address((INDEX, INDEX, 1.0, None, np.zeros(2, np.float32), np.zeros(2, np.float32)))
    f64 = compiled.address((INDEX, INDEX, 1.0, None, np.zeros(2), np.zeros(2)))
    again = compiled.address((INDEX, INDEX, 2.0, None, np.ones(3, np.float32), np.ones(3, np.float32)))
    assert f32 == again
    assert f32[0] != f64[0] and f32[1] != f64[1]
    assert f64[1] == signature_tag(tuple(numba.typeof(a) for a in (INDEX, INDEX, 1.0, None, np.zeros(2), np.zeros(2))))


def test_an_address_compiled_for_other_types_is_refused_and_runs_nothing():
    compiled = Compiled(_scaled_square)
    address, tag = compiled.address((INDEX, INDEX, 1.0, None, np.zeros(3), np.zeros(3)))  # float64 arrays
    src = np.ones(3, np.float32)
    out = np.zeros(3, np.float32)
    with pytest.raises(TypeError, match="other argument types"):
        fan_out(address, tag, np.array([0, 3], np.int64), (1.0, None, src, out), 0, 0, ())  # float32 arrays
    assert not out.any()


def test_a_function_that_returns_a_value_is_refused_before_any_call():
    with pytest.raises(TypeError, match="must return None"):
        Compiled(_returns_a_value).address((INDEX, INDEX, np.zeros(2)))


@njit
def _total(src, into):
    into[0] = src.sum()


def test_the_finisher_runs_after_every_worker_on_the_calling_thread():
    src = np.arange(6, dtype=np.float64)
    out = np.zeros(6)
    into = np.zeros(1)
    then = Compiled(_total).address((out, into))
    args = (1.0, None, src, out)
    fan_out(*Compiled(_scaled_square).address((INDEX, INDEX, *args)), np.array([0, 3, 6], np.int64), args, *then,
            (out, into))
    assert into[0] == (src**2).sum()  # the sum of every worker's rows: it ran after all of them


def test_a_finisher_compiled_for_other_types_is_refused_and_nothing_runs():
    src = np.arange(4, dtype=np.float64)
    out = np.zeros(4)
    address, tag = Compiled(_total).address((np.zeros(2, np.float32), np.zeros(1, np.float32)))
    args = (1.0, None, src, out)
    with pytest.raises(TypeError, match="other argument types"):
        fan_out(*Compiled(_scaled_square).address((INDEX, INDEX, *args)), np.array([0, 4], np.int64), args, address,
                tag, (out, np.zeros(1)))
    assert not out.any()


@njit
def _fails_where_flagged(first, last, flags, out):
    # flags[first]: 0 runs the range; 1 raises once (clearing the flag first); 2 raises every time
    if flags[first] != 0:
        if flags[first] == 1:
            flags[first] = 0
        raise ValueError("planted failure of a worker's range")
    for i in range(first, last):
        out[i] += i + 1.0


def _fan_out_flagged(flags: np.ndarray, out: np.ndarray) -> None:
    args = (flags, out)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        fan_out(*Compiled(_fails_where_flagged).address((INDEX, INDEX, *args)), np.array([0, 3, 6], np.int64),
                args, 0, 0, ())
    finally:
        numba.set_num_threads(previous)


def test_a_worker_that_raises_raises_on_the_calling_thread_with_its_own_message():
    # The failing range runs again on the calling thread, where the exception propagates as itself (on omp a
    # worker's exception would reach the caller as numba's SystemError; on workqueue it would be dropped).
    flags = np.array([0, 0, 0, 2, 0, 0], np.int64)
    out = np.zeros(6)
    with pytest.raises(ValueError, match="planted failure of a worker's range"):
        _fan_out_flagged(flags, out)
    np.testing.assert_array_equal(out[:3], [1.0, 2.0, 3.0])  # the other worker's range ran, once
    assert not out[3:].any()


def test_a_range_that_fails_once_is_done_by_the_calling_thread_and_nothing_runs_twice():
    flags = np.array([0, 0, 0, 1, 0, 0], np.int64)
    out = np.zeros(6)
    _fan_out_flagged(flags, out)
    np.testing.assert_array_equal(out, np.arange(1.0, 7.0))  # every item once: the failed range had run none
    assert not flags.any()


def test_two_ranges_that_fail_once_are_an_error_not_a_partial_result():
    # Only the first failed range runs again; the second one's items would be missing, so the call raises.
    flags = np.array([1, 0, 0, 1, 0, 0], np.int64)
    with pytest.raises(RuntimeError, match="several workers failed"):
        _fan_out_flagged(flags, np.zeros(6))
