"""`int8kv serve` refuses bad arguments in one line, exit status 1, before any model is loaded."""

import socket

import pytest

from int8kv import cli
from int8kv.server.launch import free_port


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "0"], "--port must be >= 1, got 0"),
        (["--port", "70000"], "--port must be <= 65535, got 70000"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        (["--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0"),
        (["--kv-format", "int3"], "unsupported KV cache dtype 'int3'"),
        (["--memory", "lots"], "cannot read a memory size from 'lots'"),
        # the 4-bit format's window pages and sink slots for 16 sequences take ~87 MiB of SmolLM2's F16 rows first
        (["--kv-format", "int4", "--memory", "64MiB"], "holds no 64-position page of this model in int4_kchan64"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
        (["/models/a", "--model", "/models/b"], "two models given: '/models/a' and --model '/models/b'"),
        (["--host", "203.0.113.7"], "cannot listen on 203.0.113.7:"),  # not an address of this machine
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["/nonexistent/positional"], "/nonexistent/positional"),
        (["--kv-store", "embedded", "--kv-store-secret", "0" * 16], "--kv-store-secret: a KV store secret of 16 "
         "bytes that are all one value is no secret"),
        # an empty key read as "no key" served every route without one
        (["--api-key", ""], "--api-key: the API key is empty or blank"),
        (["--api-key", " \t "], "--api-key: the API key is empty or blank"),
        (["--api-key", " sk-padded"], "--api-key: the API key has spaces at its ends or control characters"),
        (["--api-key", "sk-\nsplit"], "--api-key: the API key has spaces at its ends or control characters"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_1(capsys, monkeypatch, argv, message):
    import int8kv.models

    if not any("nonexistent" in a for a in argv):  # everything else must be refused before the model loads
        monkeypatch.setattr(int8kv.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    port = [] if "--port" in argv else ["--port", str(free_port())]  # 8000 may be taken on a test machine
    assert cli.main(["serve", "--quiet", *port, *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("int8kv: error: ") and message in err and err.count("\n") == 1


def test_a_port_already_taken_fails_before_the_model_loads(capsys, monkeypatch):
    import int8kv.models

    monkeypatch.setattr(int8kv.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--quiet", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"int8kv: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in err, err


def test_the_api_key_from_the_environment_is_not_shown_by_help(capsys, monkeypatch):
    monkeypatch.setenv("INT8KV_API_KEY", "sk-very-secret")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--api-key" in out and "sk-very-secret" not in out


def test_a_max_model_len_beyond_the_model_is_one_line(capsys, tmp_path):
    from server_helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", max_positions=256)
    capsys.readouterr()  # the model's saving noise
    assert cli.main(["serve", "--quiet", str(model), "--port", str(free_port()), "--max-model-len", "300"]) == 1
    err = capsys.readouterr().err
    assert "max_model_len 300 must lie in [1, 256]" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_api_key_in_the_environment_is_refused_too(capsys, monkeypatch, value):
    import int8kv.models

    monkeypatch.setattr(int8kv.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setenv("INT8KV_API_KEY", value)
    assert cli.main(["serve", "--quiet", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert err.startswith("int8kv: error: $INT8KV_API_KEY: the API key is empty or blank") and err.count("\n") == 1


def test_build_app_refuses_an_empty_key_instead_of_serving_without_one():
    from int8kv.errors import InvalidEngineConfig
    from int8kv.server import build_app

    with pytest.raises(InvalidEngineConfig, match="empty or blank"):
        build_app(None, "tiny", api_key="")  # refused before the engine is touched
