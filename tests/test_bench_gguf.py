"""`python -m int8kv.bench gguf`: each peer in its own process, its figures read back, and the options checked."""

from __future__ import annotations

import json

import pytest
from test_gguf_weights import fixture_path

from int8kv.bench import gguf as bench_gguf
from int8kv.cli_common import CliError


def test_a_peers_run_reports_its_figures(capsys):
    """What a peer's process runs and prints (`--child`), run here: the parent reads that line back (`_one`)."""
    model = fixture_path("Q8_0")
    argv = ["--model", str(model), "--child", "int8kv", "--contexts", "16,40", "--prefill", "24", "--new-tokens", "4",
            "--threads", "1"]  # fmt: skip
    assert bench_gguf.main(argv) is None
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1
    row = json.loads(lines[0][len("RESULT "):])
    assert set(row["decode_ms"]) == {"16", "40"} and all(v > 0 for v in row["decode_ms"].values())
    assert row["prefill_tok_s"] > 0 and row["load_s"] > 0 and row["weights"]
    assert row["peak_rss_bytes"] > model.stat().st_size  # the process's peak: the mapped file was read


def test_the_report_puts_int8kv_over_llama_cpp():
    rows = {peer: {"load_s": 2.0 * k, "prefill_tok_s": 100.0 / k, "decode_ms": {512: 10.0 * k},
                   "peak_rss_bytes": 2**30 * k, "runs": []} for peer, k in (("int8kv", 2), ("llama.cpp", 1))}
    result = {"model": "m.gguf", "model_bytes": 2**30, "contexts": [512], "threads": 2, "repeat": 1,
              "llama_cpp": "x", "results": rows,
              "int8kv_over_llama_cpp": {"decode_ms": {512: 2.0}, "prefill_tok_s": 0.5, "peak_rss": 2.0, "load_s": 2.0}}
    text = bench_gguf.report(result)
    assert "2.00x" in text and "0.50x" in text and "int8kv / llama.cpp" in text


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
