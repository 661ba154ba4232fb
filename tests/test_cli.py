"""Every subcommand through `int8kv.cli.main`, in-process: output, --json, --plot and the error paths."""

import json
import re

import pytest
import torch

from int8kv.cli import main
from int8kv.formats import INT4_SINK_WINDOW_V1 as Q4W

PNG = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_demo_on_packaged_model(capsys, tmp_path):
    code, out, err = run(
        capsys, "demo", "--prompt", "What is 2+2?", "--max-tokens", "6", "--memory", "1GiB",
        "--json", str(tmp_path / "d.json"), "--plot", str(tmp_path / "mem.png"), "--quiet",
    )
    assert code == 0, err
    assert "INT8 / F16 KV bytes: 0.531" in out
    assert "context that fits in 1 GiB" in out
    result = json.loads((tmp_path / "d.json").read_text())
    f16, int8 = result["runs"]["f16"], result["runs"]["int8_per_token_head_f32_scale_v1"]
    # The printed verdict is the one the token ids give, and on this prompt INT8 storage changes no greedy token.
    assert int8["token_ids"] == f16["token_ids"]
    assert "greedy outputs identical: yes (1/1 prompts)" in out
    assert int8["kv_bytes_per_token"] == 30 * 3 * 2 * (64 + 4) and f16["kv_bytes_per_token"] == 30 * 3 * 2 * 128
    assert all(len(t) == 6 for t in f16["token_ids"])
    # whole 16-token blocks only, as the paged pool allocates them
    assert result["capacity_tokens"]["f16"] == (1 << 30) // (16 * 30 * 3 * 2 * 128) * 16
    # 4-bit: the longest sequence whose stored form (sinks and window in F16) stays within it as it grows, ~3.5x
    q4 = result["capacity_tokens"]["int4_kchan64_vtok_asym_sink4_win64_v1"]
    assert 30 * 3 * Q4W.peak_bytes(q4, 64) <= 1 << 30 < 30 * 3 * Q4W.peak_bytes(q4 + 1, 64)
    assert 3.3 < q4 / result["capacity_tokens"]["f16"] < 3.7 and "4-bit" in out
    assert (tmp_path / "mem.png").read_bytes().startswith(PNG)
    assert err == ""  # --quiet: no progress lines


# (argv, message, refused before the model loads)
BAD_INPUT = [
    (["demo", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf", False),
    (["demo", "--memory", "64KiB"], "smaller than one 16-token INT8 block", True),  # the model's config only
    (["demo", "--memory", "5"], "smaller than one 16-token INT8 block", True),
    (["serve", "--memory", "5"], "smaller than one 16-token INT8 block", True),
    (["serve", "--kv-format", "f16", "--memory", "200KiB"], "smaller than one 16-token F16 block", True),
    (["demo", "--memory", "lots"], "cannot read a memory size", True),
    (["demo", "--formats", "fp8"], "accepted: ", True),
    (["demo", "--max-tokens", "0"], "--max-tokens must be >= 1", True),
    (["demo", "--threads", "0"], "--threads must be >= 1, got 0", True),
    (["serve", "--threads", "-2"], "--threads must be >= 1, got -2", True),
    (["bench", "busy", "--loads", "1,x"], "--loads must be comma-separated integers", True),
    (["bench", "busy", "--loads", "65"], "--loads takes counts from 0 to 64", True),
    (["demo", "--kv-store", "ftp://host"], "unknown block store 'ftp://host'", True),
    (["serve", "--kv-store", "embedded", "--kv-store-secret", "short"], "at least 16 bytes", True),
    (["serve", "--kv-store-secret", "sixteen bytes ok"], "--kv-store-secret needs --kv-store", True),
    (["eval", "--text", "/nonexistent.txt"], "cannot read text file", True),
    (["eval", "--windows", "0"], "--windows", True),
    (["eval", "--kv-format", "int3"], "unsupported KV cache dtype 'int3'", True),
    (["demo", "--bogus"], "unrecognized arguments: --bogus", True),
    (["demo", "--memory", "1e400"], "--memory: a memory size must be a finite number of bytes >= 0, got '1e400'", True),
    (["demo", "--memory=-5GiB"], "--memory: a memory size must be a finite number of bytes >= 0, got '-5GiB'", True),
    (["demo", "--memory=0"], "--memory must be a positive size", True),
    (["demo", "--memory", "0"], "--memory must be a positive size", True),
    (["eval", "--ctx", "0"], "--ctx must be >= 4, got 0", True),
    (["eval", "--chunk", "0"], "--chunk must be >= 1", True),
    (["eval", "--gen-tokens", "-1"], "--gen-tokens must be >= 1", True),
    (["eval", "--prompts", "9"], "--prompts must be in [0, 4]", True),
    (["demo", "--json", "/nonexistent/dir/d.json"], "folder '/nonexistent/dir' does not exist", True),
    (["demo", "--plot", "/nonexistent/dir/m.png"], "does not exist", True),
    (["eval", "--plot", "/"], "is a directory", True),
    (["eval", "--json", "/nonexistent/dir/e.json"], "does not exist", True),
    (["bench", "attention", "--batch", "0"], "--batch must be >= 1, got 0", True),
    (["bench", "attention", "--q-heads", "4", "--kv-heads", "3"], "not a multiple of --kv-heads", True),
    (["bench", "codec", "--tokens", "x"], "argument --tokens: invalid int value: 'x'", True),
    (["bench", "codec", "--json", "/nonexistent/dir/c.json"], "does not exist", True),
    (["bench", "engine_paths", "--steps", "0"], "--steps must be >= 1, got 0", True),
]


@pytest.mark.parametrize("argv, message, before_model", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_1(capsys, monkeypatch, argv, message, before_model):
    if before_model:
        import int8kv.models

        def no_load(*args, **kwargs):
            raise AssertionError("the model was loaded before the arguments were checked")

        monkeypatch.setattr(int8kv.models, "load_model", no_load)
    code, out, err = run(capsys, *argv, "--quiet")
    assert code == 1
    assert err.startswith("int8kv: error: ") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="memory size"):
        main(["demo", "--memory", "lots", "--debug", "--quiet"])


@pytest.mark.parametrize("content, message", [(b"", "is empty"), (b"  \n\n", "is empty"),
                                              (b"ab\x00cd", "not a text file"), (b"\xff\xfe\xfa", "not UTF-8")])
def test_eval_refuses_bad_text(capsys, tmp_path, content, message):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    code, _, err = run(capsys, "eval", "--text", str(path), "--quiet")
    assert code == 1 and message in err


@pytest.mark.slow
def test_eval_small_run(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(open("/usr/share/common-licenses/Apache-2.0").read()[:3000])
    code, out, err = run(
        capsys, "eval", "--text", str(text), "--ctx", "64", "--chunk", "32", "--windows", "2", "--gen-tokens", "4",
        "--prompts", "1", "--fp8", "--json", str(tmp_path / "e.json"), "--plot", str(tmp_path / "e.png"), "--quiet",
    )
    assert code == 0, err
    rows = {r["cache"]: r for r in json.loads((tmp_path / "e.json").read_text())["rows"]}
    # --fp8 adds transformers' fp8 cache to the default three
    assert set(rows) == {"DynamicCache fp32 (baseline)", "int8kv f16", "int8kv int8", "QuantizedCache fp8"}
    assert rows["DynamicCache fp32 (baseline)"]["ppl_change_vs_baseline"] == 0
    assert rows["int8kv int8"]["bytes_vs_f16"] == pytest.approx(68 / 128)
    # 64 scored tokens: F16 storage stays within 1% of the float32 cache, INT8 within 3%.
    assert abs(rows["int8kv f16"]["ppl_change_vs_baseline"]) < 0.01
    assert abs(rows["int8kv int8"]["ppl_change_vs_baseline"]) < 0.03
    assert "int8kv int8" in out and (tmp_path / "e.png").read_bytes().startswith(PNG)


def test_eval_takes_the_4bit_format(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(open("/usr/share/common-licenses/Apache-2.0").read()[:3000])
    code, _, err = run(
        capsys, "eval", "--text", str(text), "--ctx", "160", "--chunk", "80", "--windows", "1", "--prompts", "0",
        "--no-fp8", "--kv-format", f"f16,{Q4W.name}", "--json", str(tmp_path / "e.json"), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    rows = {r["cache"]: r for r in json.loads((tmp_path / "e.json").read_text())["rows"]}
    assert set(rows) == {"DynamicCache fp32 (baseline)", "int8kv f16", "int8kv int4"}
    assert rows["int8kv int4"]["bytes_vs_f16"] == pytest.approx(Q4W.bytes_per_row(64) / 128)
    # 80 scored tokens, page 0 sealed from position 127 on: within 5% of the float32 cache.
    assert abs(rows["int8kv int4"]["ppl_change_vs_baseline"]) < 0.05


def table_and_legend(text: str, header_start: str) -> tuple[list[str], list[str], list[str]]:
    """(column names read off the printed header, the table's rows, the names the legend explains). Header cells
    stand at least two spaces apart, and so do a legend entry's name and its text."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(header_start))
    end = lines.index("", at)
    legend = lines[lines.index("columns:", end) + 1 :]
    names = [line[2:].split("  ")[0] for line in legend if line.startswith("  ") and not line.startswith("   ")]
    return re.split(r"\s{2,}", lines[at].strip()), lines[at + 1 : end], names


EVAL_ROW = {"perplexity": 13.1, "ppl_change_vs_baseline": 0.002, "kv_bytes_per_token": 12240.0,
            "bytes_vs_f16": 0.531, "greedy_agreement": 0.75, "greedy_common_prefix": 20.5}


@pytest.mark.parametrize("prompts", [["a prompt", "another"], []])
def test_the_eval_legend_explains_every_column_of_the_table(prompts):
    from int8kv.eval import format_eval

    result = {"ctx": 512, "chunk": 128, "windows": 8, "scored_tokens": 2048, "gen_tokens": 32, "prompts": prompts,
              "rows": [{**EVAL_ROW, "cache": "DynamicCache fp32 (baseline)"}, {**EVAL_ROW, "cache": "int8kv int8"}]}
    text = format_eval(result)
    columns, rows, explained = table_and_legend(text, "cache")
    assert columns == explained and len(rows) == 2
    # the greedy columns only where something was generated, and each row has one value per column
    assert ("agree" in columns) == bool(prompts) and all(len(row[30:].split()) == len(columns) - 1 for row in rows)
    assert "(out of 32; higher is better)" in text if prompts else "prefix" not in text
    assert "the first row (DynamicCache fp32 (baseline)) is the reference" in " ".join(text.split())


def test_the_attention_legend_explains_every_column_and_names_the_default_path(capsys):
    code, out, err = run(capsys, "bench", "attention", "--context", "40", "--batch", "1", "--q-heads", "2",
                         "--kv-heads", "1", "--head-dim", "32", "--block-size", "8", "--repeat", "1",
                         "--window", "16", "--quiet")
    assert code == 0, err
    columns, rows, explained = table_and_legend(out, "context")
    assert columns == explained
    assert {"floor", "q16 diff", "q16/floor", "window/full", "x sdpa_f32"} <= set(columns)
    assert all(len(row) == len(out.splitlines()[1]) for row in rows)  # the cells stand under their names
    default = [line for line in out.splitlines() if "DEFAULT path" in line]
    assert len(default) == 1 and default[0].split()[0] == "int8_q16_paged"


def test_stages_estimate_the_time_left_from_each_kind_of_unit(monkeypatch):
    import io

    from int8kv import progress
    from int8kv.progress import Stages

    monkeypatch.setattr(progress, "_quiet", False)  # an earlier command's --quiet

    now = [0.0]
    out = io.StringIO()
    stages = [("a: perplexity", "ppl", 100), ("a: greedy", "gen", 10), ("b: perplexity", "ppl", 100),
              ("b: greedy", "gen", 10)]
    with Stages("eval", stages, every=30, stream=out, tty=False, clock=lambda: now[0]) as bar:
        bar.begin(0)
        now[0] = 10.0
        bar.update(100)  # 10 s for 100 scored tokens; nothing generated yet
        assert bar.seconds_left() is None and "estimating the time left" in bar.line()
        bar.begin(1)
        now[0] = 15.0
        bar.update(5)  # 5 s for 5 generated tokens
        # 5 + 10 generated at 1 s each, 100 scored at 0.1 s each
        assert bar.seconds_left() == pytest.approx(25.0)
        assert out.getvalue() == ""  # no line before 30 s have passed
        now[0] = 31.0
        bar.update(1)  # 6 tokens in 21 s: 3.5 s a token, for 4 + 10 of them, and 100 scored at 0.1 s
        assert out.getvalue() == "eval [2/4] a: greedy: 6/10 tok, 0:31 elapsed, about 0:59 left\n"
        for i in (1, 2, 3):
            bar.begin(i)
            bar.update(stages[i][2] - bar.done[i])
        assert bar.seconds_left() == 0
    assert out.getvalue().splitlines()[-1] == "eval: done in 0:31 (4 stages, 220 tok)"


def test_stages_redraw_one_line_on_a_terminal(monkeypatch):
    import io

    from int8kv import progress
    from int8kv.progress import Stages

    monkeypatch.setattr(progress, "_quiet", False)  # an earlier command's --quiet

    now = [0.0]
    out = io.StringIO()
    with Stages("eval", [("x", "ppl", 4)], stream=out, tty=True, clock=lambda: now[0]) as bar:
        bar.begin(0)
        for _ in range(4):
            now[0] += 1
            bar.update()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\r\x1b[Keval: done in 0:04 (1 stage, 4 tok)\n")
    assert text.count("\r") == 6  # begin, four updates, the clearing of the line
    assert "\reval [1/1] x: 3/4 tok, 0:03 elapsed, about 0:01 left\x1b[K" in text
    # a line too wide for the terminal loses the end of its stage part, never the times
    assert bar.line(50) == "eval [1/1] x: 4/..., 0:04 elapsed, about 0:00 left"


def test_bench_codec_json(capsys, tmp_path):
    code, out, _ = run(capsys, "bench", "codec", "--tokens", "64", "--repeat", "2", "--json", str(tmp_path / "c.json"))
    assert code == 0 and "quantize" in out and "dequantize" in out
    result = json.loads((tmp_path / "c.json").read_text())
    assert set(result["results"]) == {"copy", "quantize", "dequantize"} and result["shape"] == [64, 8, 128]


def test_bench_rejects_unknown_name(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cache_inspect(capsys, tmp_path):
    import torch

    from int8kv import QuantizedKvCache, save_kv

    cache = QuantizedKvCache(2, 8, 3, 16)
    cache.push_step([torch.randn(5, 3, 16)] * 2, [torch.randn(5, 3, 16)] * 2)
    path = tmp_path / "kv.safetensors"
    save_kv(path, cache, token_ids=[1, 2, 3, 4, 5], metadata={"note": "demo-model"})
    code, out, err = run(capsys, "cache", "inspect", str(path), "--json", str(tmp_path / "i.json"))
    assert code == 0, err
    assert "int8_per_token_head_f32_scale_v1" in out and "demo-model" in out
    info = json.loads((tmp_path / "i.json").read_text())
    assert info["storage_format"] == "int8_per_token_head_f32_scale_v1" and info["seq_len"] == 5
    assert info["token_ids"] == [[1, 2, 3, 4, 5]] and info["kv_bytes"] == 2 * 2 * 5 * 3 * (16 + 4)
    path.write_bytes(path.read_bytes()[:100])
    code, _, err = run(capsys, "cache", "inspect", str(path))
    assert code == 1 and err.startswith("int8kv: error: ")
    code, _, err = run(capsys, "cache", "inspect", str(tmp_path / "missing.safetensors"))
    assert code == 1 and "missing.safetensors" in err


def test_bench_attention_plot(capsys, tmp_path):
    from int8kv.bench.attention import parse_args

    assert parse_args(["--plot", str(tmp_path / "p.png")]).sweep  # --plot turns the sweep on
    # Two short contexts draw the same plot as the sweep's seven: its 32,768-token end timed seven methods
    # (a torch gather of 268 MB among them) and made this test one of the suite's slowest.
    code, out, err = run(
        capsys, "bench", "attention", "--batch", "1", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "64",
        "--repeat", "1", "--contexts", "64,128",
        "--plot", str(tmp_path / "a.png"), "--json", str(tmp_path / "a.json"),
    )
    assert code == 0, err
    result = json.loads((tmp_path / "a.json").read_text())
    contexts = [r["context"] for r in result["results"]]
    assert contexts == sorted(contexts) and len(contexts) > 1
    assert all(r["floor_ms"] > 0 and r["int8_rel_diff_vs_torch_gather"] < 1e-5 for r in result["results"])
    assert (tmp_path / "a.png").read_bytes().startswith(PNG)


def test_plot_only_where_there_is_one(capsys):
    code, _, err = run(capsys, "bench", "codec", "--tokens", "16", "--repeat", "1", "--plot", "x.png")
    assert code == 1 and err == "int8kv: error: unrecognized arguments: --plot x.png\n"


def help_text(capsys, entry, argv):
    with pytest.raises(SystemExit) as exc:
        entry(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["attention", "codec", "prefix", "e2e", "engine_paths"])
def test_bench_has_one_parser_for_both_entry_points(capsys, name):
    from int8kv.bench.__main__ import main as bench_main

    via_cli = help_text(capsys, main, ["bench", name, "--help"])
    via_module = help_text(capsys, bench_main, [name, "--help"])
    assert via_cli == via_module and f"python -m int8kv.bench {name}" in via_cli
    # --quiet and --debug are taken by every benchmark, from either entry point, wherever they stand.
    assert help_text(capsys, bench_main, ["--quiet", name, "--debug", "--help"]) == via_module
    assert help_text(capsys, main, ["bench", "--quiet", name, "--help", "--debug"]) == via_module


def test_bench_options_are_the_same_from_both_entry_points(capsys, tmp_path):
    from int8kv.bench.__main__ import main as bench_main

    argv = ["--context", "48", "--batch", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32",
            "--block-size", "8", "--repeat", "1", "--seed", "3", "--quiet"]
    assert main(["bench", "attention", *argv, "--json", str(tmp_path / "cli.json")]) == 0
    assert bench_main(["attention", *argv, "--json", str(tmp_path / "module.json")]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # --quiet: no progress lines
    results = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cli", "module")]
    for result in results:
        assert result["config"] == {"batch": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "block_size": 8}
        assert [r["context"] for r in result["results"]] == [48]
    assert out.count("paged decode attention (CPU): batch 2, 4 q heads, 2 kv heads, head_dim 32, block 8") == 2


@pytest.mark.parametrize(
    "argv, defaults",
    [
        (["demo"], ["--max-tokens MAX_TOKENS", "(default: 48)", "(default: 8GiB)", "(default: f16,int8)"]),
        (["eval"], ["(default: 512)", "(default: 128)", "(default: 8)", "(default: 32)", "(default: 4)",
                    "--fp8, --no-fp8", "off by default"]),
        (["bench", "attention"], ["(default: 4096)", "(default: 8)", "(default: 32)", "(default: 20)"]),
        (["bench", "codec"], ["(default: 4096)", "(default: 30)"]),
        (["bench", "prefix"], ["(default: 1024)", "(default: 3)"]),
    ],
)
def test_help_shows_defaults(capsys, argv, defaults):
    text = " ".join(help_text(capsys, main, [*argv, "--help"]).split())
    assert all(d in text for d in defaults), text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_bench_module_usage(capsys):
    from int8kv.bench.__main__ import main as bench_main

    assert bench_main(["--help"]) == 0 and "--quiet" in capsys.readouterr().out
    assert bench_main(["nope"]) == 2 and "usage: python -m int8kv.bench" in capsys.readouterr().err


def strict_loads(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_files_never_hold_nan_or_infinity(capsys, monkeypatch, tmp_path):
    import numpy as np

    import int8kv.bench.codec
    from int8kv.cli_common import write_json

    nan, inf = float("nan"), float("inf")
    write_json(str(tmp_path / "a.json"), {"a": [nan, 1.5, {"b": -inf}], "c": (np.float32(nan), np.float64(2.0)),
                                          "d": 3, "e": True, "f": "nan"})
    assert strict_loads((tmp_path / "a.json").read_text()) == {
        "a": [None, 1.5, {"b": None}], "c": [None, 2.0], "d": 3, "e": True, "f": "nan"
    }
    # Through the CLI: a benchmark whose figures came out non-finite.
    rows = {"copy": {"ms": nan, "gb_per_s": inf, "vs_copy": 1.0}, "quantize": {"ms": 0.5, "gb_per_s": -inf,
                                                                                "vs_copy": nan}}
    monkeypatch.setattr(int8kv.bench.codec, "run", lambda *a: {"shape": [1, 1, 1], "threads": 1, "results": rows})
    code, out, err = run(capsys, "bench", "codec", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    result = strict_loads((tmp_path / "c.json").read_text())
    assert result["results"] == {"copy": {"ms": None, "gb_per_s": None, "vs_copy": 1.0},
                                 "quantize": {"ms": 0.5, "gb_per_s": None, "vs_copy": None}}


def test_bench_plots_redraws_the_docs_plots_from_results(capsys, tmp_path):
    import pathlib
    import shutil

    from int8kv.bench.plots import PLOTS

    docs = pathlib.Path(__file__).resolve().parent.parent / "docs"
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    for source in PLOTS.values():
        shutil.copy(docs / "results" / source, results / source)
    code, stdout, err = run(capsys, "bench", "plots", "--results", str(results), "--out", str(out), "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(PLOTS)
    assert all((out / png).read_bytes().startswith(PNG) for png in PLOTS)
    assert all(f"{out / png} <- {results / source}" in stdout for png, source in PLOTS.items())
    # every README/benchmarks plot is one of these, and each is drawn from a results file docs/ still has
    assert all((docs / png).is_file() and (docs / "results" / source).is_file() for png, source in PLOTS.items())


def test_bench_plots_checks_every_input_before_drawing(capsys, tmp_path):
    from int8kv.bench.plots import PLOTS

    (tmp_path / "demo.json").write_text("{}")
    code, _, err = run(capsys, "bench", "plots", "--results", str(tmp_path), "--out", str(tmp_path), "--quiet")
    assert code == 1 and "is not a file" in err
    assert not any((tmp_path / png).exists() for png in PLOTS)
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "bench", "plots", "--out", str(tmp_path / "file" / "under"), "--quiet")
    assert code == 1 and "Not a directory" in err


def test_version(capsys):
    import int8kv

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"int8kv {int8kv.__version__}\n"


def tiny_model(tmp_path):
    from server_helpers import make_tiny_model

    return str(make_tiny_model(tmp_path / "tiny"))


def test_demo_and_eval_show_progress_and_the_demo_explains_its_figures(capsys, tmp_path):
    model = tiny_model(tmp_path)
    code, out, err = run(capsys, "demo", "--model", model, "--prompt", "the water", "--max-tokens", "3",
                         "--memory", "1MiB")
    assert code == 0, err
    assert "loading model" in err and "model loaded in" in err
    for name in ("F16", "INT8"):  # stderr is not a terminal here: the plain bar's lines, the last one at the end
        assert f"{name}: warming up" in err and f"{name}: generating: 3/3 tok (" in err
    head_dim = 16  # the tiny model's: F16 rows of 32 bytes against 16 codes + a 4-byte scale
    assert "what these figures mean:" in out
    assert f"the same memory holds {2 * head_dim / (head_dim + 4):.2f}x the tokens in INT8" in out
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the water is hot and the day is long"] * 20))
    code, out, err = run(capsys, "eval", "--model", model, "--text", str(text), "--ctx", "16", "--chunk", "8",
                         "--windows", "2", "--prompts", "1", "--gen-tokens", "3")
    assert code == 0, err
    # stderr is not a terminal and the run is short: no line every 30 s, one at the end with the work counted
    # (three caches, fp8 off by default: 2 x 16 tokens through the model and 3 generated per cache)
    assert err.splitlines()[-1].startswith("eval: done in ")
    assert err.splitlines()[-1].endswith(" (6 stages, 105 tok)")
    assert "QuantizedCache fp8" not in out and "int8kv int8" in out


def test_model_dir_prints_what_load_model_reads(capsys, tmp_path):
    model = tiny_model(tmp_path)
    code, out, err = run(capsys, "model-dir", "--model", model, "--quiet")
    assert code == 0 and out == f"{model}\n"
    code, out, err = run(capsys, "model-dir", "--model", str(tmp_path / "missing"), "--quiet")
    assert code == 1 and "no model at" in err


@pytest.mark.parametrize("where", ["file/x.json", "missing/x.json"])
def test_cache_inspect_checks_its_output_before_any_work(capsys, tmp_path, where):
    import torch

    from int8kv import QuantizedKvCache, save_kv

    cache = QuantizedKvCache(num_layers=1, capacity=4, num_kv_heads=1, head_dim=8)
    cache.push_step([torch.randn(1, 8)], [torch.randn(1, 8)])
    save_kv(tmp_path / "p.kv", cache)
    (tmp_path / "file").write_text("a regular file")
    code, out, err = run(capsys, "cache", "inspect", "--json", str(tmp_path / where), str(tmp_path / "p.kv"))
    assert code == 1 and out == "" and "--json" in err  # refused before the report, not after it
    assert (tmp_path / "file").read_text() == "a regular file" and not (tmp_path / "missing").exists()
    code, out, err = run(capsys, "cache", "inspect", "--json", str(tmp_path / "r.json"), str(tmp_path / "p.kv"))
    assert code == 0 and "tokens" in out and json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("target", ["missing/r.json", "gone.json"])
def test_cache_inspect_refuses_a_dangling_link_as_its_output_before_any_work(capsys, tmp_path, target):
    import torch

    from int8kv import QuantizedKvCache, save_kv

    cache = QuantizedKvCache(num_layers=1, capacity=4, num_kv_heads=1, head_dim=8)
    cache.push_step([torch.randn(1, 8)], [torch.randn(1, 8)])
    save_kv(tmp_path / "p.kv", cache)
    (tmp_path / "link.json").symlink_to(tmp_path / target)  # a folder that is missing, or only the file
    code, out, err = run(capsys, "cache", "inspect", str(tmp_path / "p.kv"), "--json", str(tmp_path / "link.json"))
    assert code == 1 and out == "" and err.count("\n") == 1, err  # refused before the report, not after it
    assert "--json" in err and "is a symbolic link to a missing file" in err
    assert not (tmp_path / target).exists() and (tmp_path / "link.json").is_symlink()


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path):
    import os
    import socket

    from int8kv.cli_common import output_problem

    os.mkfifo(tmp_path / "fifo")  # writing the report into it would block forever
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "sock"))
    sock.close()
    for name in ("fifo", "sock"):
        assert "is not a regular file" in output_problem(str(tmp_path / name))
    assert "is a directory" in output_problem(str(tmp_path))
    (tmp_path / "old.json").write_text("{}")
    assert output_problem(str(tmp_path / "old.json")) is None and output_problem(str(tmp_path / "new.json")) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".int8kv-probe")] == []  # the probe is gone


def test_bench_engine_paths_times_both_paths_on_one_cache(capsys, tmp_path):
    from test_loader import _write_tiny_model

    torch.manual_seed(0)
    _write_tiny_model(tmp_path / "tiny")
    code, out, _ = run(capsys, "bench", "engine_paths", "--model", str(tmp_path / "tiny"), "--context", "40",
                       "--batches", "1,2", "--steps", "1", "--rounds", "2", "--json", str(tmp_path / "p.json"))
    result = json.loads((tmp_path / "p.json").read_text())
    assert code == 0 and [c["batch"] for c in result["cells"]] == [1, 2]
    for cell in result["cells"]:
        ms = cell["step_ms"]
        assert len(cell["step_ms_rounds"]["generic"]) == 2
        assert cell["generic / fused"] == pytest.approx(ms["fused"] / ms["generic"])
    assert "generic/fused" in out
