"""Every subcommand through `int8kv.cli.main`, in-process: output, --json, --plot and the error paths."""

import json

import pytest

from int8kv.cli import main

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
    assert "INT8 / F16 KV bytes: 0.531" in out and "greedy outputs identical" in out
    assert "context that fits in 1 GiB" in out
    result = json.loads((tmp_path / "d.json").read_text())
    f16, int8 = result["runs"]["f16"], result["runs"]["int8_per_token_head_f32_scale_v1"]
    assert int8["kv_bytes_per_token"] == 30 * 3 * 2 * (64 + 4) and f16["kv_bytes_per_token"] == 30 * 3 * 2 * 128
    assert all(len(t) == 6 for t in f16["token_ids"])
    # whole 16-token blocks only, as the paged pool allocates them
    assert result["capacity_tokens"]["f16"] == (1 << 30) // (16 * 30 * 3 * 2 * 128) * 16
    assert (tmp_path / "mem.png").read_bytes().startswith(PNG)
    assert err == ""  # --quiet: no progress lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
        (["demo", "--memory", "lots"], "cannot read a memory size"),
        (["demo", "--formats", "fp8"], "accepted: "),
        (["demo", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["demo", "--memory", "64KiB"], "smaller than one 16-token INT8 block"),
        (["eval", "--text", "/nonexistent.txt"], "cannot read text file"),
        (["eval", "--windows", "0"], "--windows"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(capsys, argv, message):
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
        "--prompts", "1", "--json", str(tmp_path / "e.json"), "--plot", str(tmp_path / "e.png"), "--quiet",
    )
    assert code == 0, err
    rows = {r["cache"]: r for r in json.loads((tmp_path / "e.json").read_text())["rows"]}
    assert set(rows) == {"DynamicCache fp32 (baseline)", "int8kv f16", "int8kv int8", "QuantizedCache fp8"}
    assert rows["DynamicCache fp32 (baseline)"]["ppl_change_vs_baseline"] == 0
    assert rows["int8kv int8"]["bytes_vs_f16"] == pytest.approx(68 / 128)
    # 64 scored tokens: F16 storage stays within 1% of the float32 cache, INT8 within 3%.
    assert abs(rows["int8kv f16"]["ppl_change_vs_baseline"]) < 0.01
    assert abs(rows["int8kv int8"]["ppl_change_vs_baseline"]) < 0.03
    assert "int8kv int8" in out and (tmp_path / "e.png").read_bytes().startswith(PNG)


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
    code, out, err = run(
        capsys, "bench", "attention", "--batch", "1", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "64",
        "--repeat", "1", "--plot", str(tmp_path / "a.png"), "--json", str(tmp_path / "a.json"),
    )
    assert code == 0, err
    result = json.loads((tmp_path / "a.json").read_text())
    contexts = [r["context"] for r in result["results"]]
    assert contexts == sorted(contexts) and len(contexts) > 1  # --plot turns the sweep on
    assert all(r["floor_ms"] > 0 and r["int8_rel_diff_vs_torch_gather"] < 1e-5 for r in result["results"])
    assert (tmp_path / "a.png").read_bytes().startswith(PNG)


def test_plot_only_where_there_is_one(capsys):
    code, _, err = run(capsys, "bench", "codec", "--tokens", "16", "--repeat", "1", "--plot", "x.png")
    assert code == 1 and "--plot is available for `bench attention`" in err
