"""`int8kv serve` refuses bad arguments in one line, exit status 1, before any model is loaded."""

import pytest

from int8kv import cli


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
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_1(capsys, monkeypatch, argv, message):
    import int8kv.models

    if "--model" not in argv:  # everything else must be refused before the model loads
        monkeypatch.setattr(int8kv.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert cli.main(["serve", "--quiet", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("int8kv: error: ") and message in err and err.count("\n") == 1
