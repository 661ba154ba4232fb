"""`python -m int8kv.bench gguf`: each peer in its own process, its figures read back, and the options checked."""

from __future__ import annotations

import json

import pytest
from test_gguf_weights import fixture_path

from int8kv.bench import gguf as bench_gguf
from int8kv.cli_common import CliError


def test_int8kv_peer_runs_in_its_own_process_and_reports(tmp_path):
    model = fixture_path("Q8_0")
    out = tmp_path / "r.json"
    result = bench_gguf.main(["--model", str(model), "--peers", "int8kv", "--contexts", "16,40", "--prefill", "24",
                              "--new-tokens", "4", "--repeat", "1", "--threads", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    row = saved["results"]["int8kv"]
    assert saved["model"] == model.name and saved["int8kv_over_llama_cpp"] is None
    assert set(row["decode_ms"]) == {"16", "40"} and all(v > 0 for v in row["decode_ms"].values())
    assert row["prefill_tok_s"] > 0 and row["load_s"] > 0
    assert row["peak_rss_bytes"] > model.stat().st_size  # the child's own peak, the mapped file touched in it
    assert row["runs"][0]["weights"]  # the engine model that ran is named
    assert result["results"]["int8kv"]["decode_ms"][16] == row["decode_ms"]["16"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent.gguf"], "no such file"),
    (["--contexts", "5,x"], "comma-separated integers"),
    (["--peers", "vllm"], "--peers takes distinct names"),
    (["--peers", "int8kv,int8kv"], "--peers takes distinct names"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
])
def test_bad_options_are_refused_by_name(tmp_path, argv, message):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = ["--model", str(model)] if "--model" not in argv else []
    with pytest.raises(CliError, match=message):
        bench_gguf.parse_args(base + argv)
