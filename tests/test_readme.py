"""The README's code must run as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_lower_level_example_runs(tmp_path, monkeypatch):
    block = next(b for b in python_blocks() if "QuantizedKvCache" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "prompt.kv").stat().st_size > 0


def test_readme_has_the_two_setup_commands_and_ci_calls_the_test_one():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert [line for line in ci if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]
