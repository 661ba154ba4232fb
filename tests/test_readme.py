"""The README's and the user docs' code must run as written: every ```python block is executed by a test here
(servers it needs started on loopback by the test), and every command line they show parses with the real CLI's
parsers."""

import argparse
import importlib
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The pages whose ```python blocks are run and whose command lines are parsed (the README first).
PAGES = {name: (ROOT / name).read_text() for name in ("README.md", "docs/quickstart.md", "docs/serving.md")}

# One phrase that only its block holds -> the test that runs it.
BLOCKS = {
    "Int8KvCache(model.config)": "test_transformers_example_runs",
    "llm.chat(conversations, params)": "test_engine_example_answers_every_question",
    "kv_store=store": "test_store_example_shares_blocks_between_two_engines",
    "from openai import OpenAI": "test_openai_example_runs_against_int8kv_serve",
    "QuantizedKvCache": "test_lower_level_example_runs",
    "response_format=": "test_structured_output_example_follows_its_schema",
}


def fenced(text: str | None = None) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of one page, or of every page in PAGES."""
    if text is None:
        return [b for page in PAGES.values() for b in fenced(page)]
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(lines) + "\n"))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def python_blocks() -> list[str]:
    return [text for lang, text in fenced() if lang == "python"]


def block(phrase: str) -> str:
    (found,) = [b for b in python_blocks() if phrase in b]
    return found


def run_block(code: str) -> tuple[dict, list[tuple]]:
    """Execute a README block in a fresh namespace; its globals and the arguments of each of its print calls
    (printed as well)."""
    printed: list[tuple] = []

    def recording_print(*args, **kwargs):
        printed.append(args)
        print(*args, **kwargs)

    namespace: dict = {"print": recording_print}
    exec(compile(code, "docs", "exec"), namespace)
    return namespace, printed


def test_every_python_block_is_run_by_a_test():
    blocks = python_blocks()
    owners = [[name for phrase, name in BLOCKS.items() if phrase in b] for b in blocks]
    assert all(len(o) == 1 for o in owners), owners  # each block is claimed by exactly one test
    assert sorted(o[0] for o in owners) == sorted(BLOCKS.values())
    assert all(name in globals() for name in BLOCKS.values())


def test_the_readme_keeps_the_transformers_engine_and_openai_examples():
    readme = [text for lang, text in fenced(README) if lang == "python"]
    for phrase in ("Int8KvCache(model.config)", "llm.chat(conversations, params)", "from openai import OpenAI"):
        assert sum(phrase in b for b in readme) == 1, phrase


def test_lower_level_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_block(block("QuantizedKvCache"))
    assert (tmp_path / "prompt.kv").stat().st_size > 0


@pytest.mark.slow
def test_transformers_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns, printed = run_block(block("Int8KvCache(model.config)"))
    ((text, nbytes),) = printed
    assert text == ns["tok"].decode(ns["out"][0]) and text.startswith("The capital of France is")
    assert len(ns["out"][0]) == len(ns["inputs"]["input_ids"][0]) + 16 and nbytes == ns["cache"].memory_bytes() > 0
    assert (pathlib.Path(ns["path"]) / "config.json").is_file()  # an ordinary transformers directory


@pytest.mark.slow
def test_engine_example_answers_every_question(tmp_path, monkeypatch):
    from int8kv.engine import EngineStats

    monkeypatch.chdir(tmp_path)
    ns, printed = run_block(block("llm.chat(conversations, params)"))
    *answers, (stats,) = printed
    assert len(answers) == len(ns["questions"]) == 2
    assert all(isinstance(a, str) and a.strip() for (a,) in answers)  # no empty first answer
    assert isinstance(stats, EngineStats) and stats.generated_tokens > 2


@pytest.mark.slow
def test_store_example_shares_blocks_between_two_engines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's relative disk: store lands in this test's directory
    ns, printed = run_block(block("kv_store=store"))
    (answer,), (hits, prefilled) = printed
    assert answer == ns["out"].text and answer.strip()
    assert hits >= 5 * 16  # the shared system prompt's full blocks, loaded from the store
    assert prefilled < hits and ns["second"].stats.prefix_hit_tokens == 0  # its own pool started empty
    assert any((tmp_path / "int8kv-blocks").rglob("*"))


@pytest.mark.slow
def test_openai_example_runs_against_int8kv_serve(smollm2_server):
    # conftest.py's `smollm2_server`: `int8kv serve --memory 64MiB` on a free loopback port, stopped (exit 0
    # checked) at the end of the session.
    code = block("from openai import OpenAI")
    url = "http://127.0.0.1:8000/v1"
    assert code.count(url) == 1
    ns, printed = run_block(code.replace(url, smollm2_server.base + "/v1"))
    (reply, usage), *pieces = printed
    assert reply == ns["reply"].choices[0].message.content and reply.strip() and usage.completion_tokens > 0
    texts = [text for (text,) in pieces if text]  # chunks without text print "" (a finish or usage chunk)
    assert "".join(texts).strip() and len(texts) <= 16  # max_tokens=16: at most one text piece per token


def test_structured_output_example_follows_its_schema(smollm2_server):
    code = block("response_format=")
    url = "http://127.0.0.1:8000/v1"
    assert code.count(url) == 1
    ns, printed = run_block(code.replace(url, smollm2_server.base + "/v1"))
    ((city,),) = printed
    assert city == ns["city"] and set(city) == {"city", "population"}
    assert city["city"] in ("Paris", "Rome", "Oslo") and isinstance(city["population"], int)


# -- command lines ---------------------------------------------------------------------------------------
def command_lines() -> list[str]:
    """Every `int8kv ...` / `python -m int8kv.bench ...` command the pages show: the lines of their plain
    code blocks and their inline code spans (comments after `#` dropped)."""
    lines = [line.split(" #")[0].strip() for lang, text in fenced() if not lang for line in text.splitlines()]
    for page in PAGES.values():
        lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", page, flags=re.S))
    commands = [c for c in lines if re.match(r"(\w+=\S+ )*(int8kv |python -m int8kv\.bench)", c)]
    return [c for c in commands if "<" not in c]  # `int8kv bench <name>`: a placeholder, not a command


class _Parsed(Exception):
    pass


def parse(argv: list[str], monkeypatch) -> None:
    """Parse a command line with the parser that would run it, and stop there (nothing is run)."""
    from int8kv.bench import BENCHMARKS
    from int8kv.cli import build_parser

    while argv and re.fullmatch(r"\w+=\S*", argv[0]):
        argv = argv[1:]  # an environment assignment before the command
    if argv[:3] == ["python", "-m", "int8kv.bench"]:
        name, options = argv[3], argv[4:]
    elif argv[:2] == ["python", "-m"] and argv[2].startswith("int8kv.bench."):
        name, options = argv[2], argv[3:]
    else:
        assert argv[0] == "int8kv", argv
        if argv[1:] == ["--version"]:
            with pytest.raises(SystemExit) as done:  # prints the version and exits 0
                build_parser().parse_known_args(argv[1:])
            assert done.value.code == 0
            return
        args, extra = build_parser().parse_known_args(argv[1:])
        if args.command != "bench":
            assert not extra, (argv, extra)
            return
        name, options = args.name, [*extra, *args.options]
    module = importlib.import_module(BENCHMARKS.get(name, name))
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    with monkeypatch.context() as patch, pytest.raises(_Parsed):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        module.main(options)


def test_every_command_line_in_the_docs_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output paths such as demo.json are checked against this folder
    commands = command_lines()
    assert len(commands) >= 25 and "python -m int8kv.bench plots" in commands
    for command in commands:
        parse(shlex.split(command), monkeypatch)


def test_a_stale_command_line_is_caught(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for stale in ("int8kv bench codec --plot x.png", "int8kv demo --bogus", "python -m int8kv.bench nosuch",
                  "int8kv bench nosuch", "int8kv serve --kv-fmt int8"):
        with pytest.raises((SystemExit, ValueError, ModuleNotFoundError, AssertionError)):
            parse(shlex.split(stale), monkeypatch)


def test_readme_has_the_two_setup_commands_and_ci_calls_the_test_one():
    assert "make demo" in README and "make test" in README
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert [line for line in ci if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]
