"""`int8kv serve` refuses bad arguments in one line, exit status 1, before any model is loaded; vLLM's names for
its flags set what int8kv's own do."""

import socket

import pytest

from int8kv import KvStorageFormat, cli
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
        # other servers' flags: what int8kv calls it, or why it has none
        (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization: the KV pool is sized in bytes here: use "
                                              "--memory"),
        (["--tensor-parallel-size=2"], "--tensor-parallel-size: not supported: one process serves the whole model"),
        (["-c", "4096"], "-c: llama.cpp's context size is --max-model-len here"),
        (["--parallel", "4"], "--parallel: parallel slots are --max-num-seqs here"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate (see int8kv serve --help)"),
        (["--kv-cache-dtype", "fp8_e4m3"], "fp8 KV caches are not supported; int8 (the default)"),
        (["--kv-cache-dtype", "int3"], "unsupported KV cache dtype 'int3'"),
        (["--kv-cache-dtype", "auto", "--kv-format", "int8"], "--kv-cache-dtype auto and --kv-format int8 disagree"),
        (["--dtype", "bfloat16", "--weights", "int8"], "--dtype bfloat16 is --weights bfloat16, and --weights int8"),
        (["--kv-store", "embedded", "--no-enable-prefix-caching"], "needs prefix caching"),
        (["--chat-template", "no-such-template.jinja"], "no such file, and not a Jinja template"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
         "kv_events_config: publisher 'kafka' is not supported"),
        (["--chat-template", "{% for m in messages %}{{ m.content }}"], "--chat-template: Jinja syntax error on "
                                                                        "line 1"),
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


def test_vllm_flag_names_reach_the_engine_and_the_server(capsys, monkeypatch, tmp_path):
    """--kv-cache-dtype, --dtype, --no-enable-prefix-caching, --chat-template and --disable-log-requests set what
    int8kv's own flags set (the engine and the server are stand-ins that record their arguments)."""
    from server_helpers import make_tiny_model

    import int8kv.engine
    import int8kv.server
    from int8kv.models.weights import BFloat16Linear

    model_dir = make_tiny_model(tmp_path / "tiny")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    seen: dict = {}

    def engine(model, **kwargs):
        seen.update(kwargs, model=model)
        return "engine"

    def serve(llm, name, host, port, limits, **kwargs):
        kwargs["sock"].close()
        seen["serve"] = kwargs
        return 0

    monkeypatch.setattr(int8kv.engine, "LLM", engine)
    monkeypatch.setattr(int8kv.server, "serve", serve)
    argv = ["serve", "--quiet", str(model_dir), "--port", str(free_port()), "--kv-cache-dtype", "auto", "--dtype",
            "bfloat16", "--no-enable-prefix-caching", "--chat-template", str(template), "--disable-log-requests",
            "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null", "topic": "kv"}']
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert seen["kv_events_config"].enable_kv_cache_events and seen["kv_events_config"].topic == "kv"
    assert seen["kv_format"] == KvStorageFormat.F16 and seen["prefix_caching"] is False
    assert any(isinstance(m, BFloat16Linear) for m in seen["model"].modules())
    assert seen["tokenizer"].chat_template == template.read_text()
    assert seen["serve"]["log_requests"] is False
    seen.clear()
    argv = ["serve", "--quiet", str(model_dir), "--port", str(free_port()), "--kv-cache-dtype", "int8",
            "--chat-template", "{{ messages[0]['content'] }}!"]
    assert cli.main(argv) == 0
    assert seen["kv_format"] == KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1 and "prefix_caching" not in seen
    assert seen["tokenizer"].chat_template == "{{ messages[0]['content'] }}!" and seen["serve"]["log_requests"]
    assert not any(isinstance(m, BFloat16Linear) for m in seen["model"].modules())


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
