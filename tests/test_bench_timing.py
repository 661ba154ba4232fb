"""`int8kv.bench.timing.seconds_in_turns`: the functions take turns, each runs its batch of calls in a row, and
every round gives one figure per function: the batch's seconds over its calls (on a stand-in clock that the
functions themselves advance, so the figures are exact)."""

from __future__ import annotations

from types import SimpleNamespace

from int8kv.bench import timing


def test_functions_take_turns_in_batches_and_each_round_gives_a_figure(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    order: list[str] = []

    def run(name: str, cost: float):
        def call():
            order.append(name)
            now[0] += cost

        return call

    seconds = timing.seconds_in_turns({"a": run("a", 0.5), "b": run("b", 2.0)}, rounds=3, calls=4)
    assert order == (["a"] * 4 + ["b"] * 4) * 3
    assert seconds == {"a": [0.5] * 3, "b": [2.0] * 3}  # per call, not per batch of 4
