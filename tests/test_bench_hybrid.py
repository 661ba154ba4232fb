"""bench hybrid on a short context: the pages it reports are the allocator's exact counts."""

from __future__ import annotations

from int8kv.bench.hybrid import report, run


def test_pages_per_table_follow_the_window_and_the_baseline_keeps_every_block():
    result = run(tokens=100, window=16, sliding=2, full=1, periods=1, block_size=4, chunk=32)
    # The next query (position 100) sees 85..100: blocks 21..24 of each sliding table; the full table keeps 25.
    assert result["windows"] == [16, 16, None] and result["layers_per_page"] == 1
    assert result["pages_per_table"] == [4, 4, 25] and result["engine_pages"] == 33
    assert result["all_blocks_pages"] == 75 and result["ratio"] == 33 / 75
    # The step's peak: the last chunk (positions 96..99) reserved before the release.
    assert result["peak_pages_in_step"] >= result["engine_pages"]
    assert "engine / every block kept: 0.440x" in report(result)
