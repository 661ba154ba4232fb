"""Int8KvCache over every decoder-only architecture of the installed transformers (tests/models_coverage.py).

One test per model type (so the suite's workers share them): it fails on a crash (an error that is not a typed
refusal) or wrong output (no error, but tokens or logits off, the int8kv kernels not called, or a refusal that
changed the model), in the drop-in or, for a type the drop-in runs, in the engine; on a refusal that does not
name what is missing; and, on the transformers version the page was measured on (its header says which), when
docs/models.md does not list the type as the run finds it (regenerate the page with
``python tests/models_coverage.py``). On another version (one the ``hf`` extra admits, e.g. the previous minor
release) model types, attention code and refusals differ from the page's, so its rows are not compared there: the
crash / wrong / refusal checks still run on every type that version has.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import transformers
from models_coverage import DOC, candidate_types, outcome, page_rows, page_version, render, warm_up
from packaging.requirements import Requirement
from packaging.version import Version

PAGE = DOC.read_text()
ROWS = page_rows(PAGE)
PAGE_VERSION = page_version(PAGE)
ON_PAGE_VERSION = transformers.__version__ == PAGE_VERSION


@pytest.fixture(scope="module")
def warm():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...: pytest-xdist's worker name
    warm_up(reverse=int(worker[2:] or 0) % 2 == 1)


@pytest.mark.parametrize("model_type", candidate_types())
def test_model_type(warm, model_type):
    found = outcome(model_type)
    if found is not None and found.kind == "skipped":
        pytest.skip(found.detail)
    assert found is None or found.kind not in ("crash", "wrong"), f"{found.kind}: {found.detail}"
    refusals = [] if found is None else [found.detail] if found.kind == "refused" else (
        [found.engine] if found.kind == "works" and found.engine != "works" else [])  # fmt: skip
    for refusal in refusals:  # the drop-in's or the engine's: it says what is missing
        assert any(w in refusal for w in ("implement", "cannot", "not", "only")), refusal
    if not ON_PAGE_VERSION:
        return  # the page lists what its own transformers version gives: other versions differ (ergo, falcon, ...)
    listed = ROWS.get(model_type)
    if found is None:
        assert listed is None, f"docs/models.md lists {model_type} ({listed}) but it is not built here"
    else:
        # The row render() writes for it, exactly: run `python tests/models_coverage.py` if this fails.
        assert listed == page_rows(render([found])).get(model_type), f"docs/models.md is stale for {model_type}"


def test_page_counts_its_rows_and_most_types_work():
    kinds = [kind for kind, _ in ROWS.values()]
    counts = dict(re.findall(r"^\| (works|refused|no attention|crash|wrong|skipped) \| (\d+) \|$", PAGE, re.M))
    assert {k: int(v) for k, v in counts.items()} == {k: kinds.count(k) for k in set(kinds)}
    assert "crash" not in counts and "wrong" not in counts
    assert kinds.count("works") >= 0.75 * (kinds.count("works") + kinds.count("refused"))
    if ON_PAGE_VERSION:
        assert set(ROWS) <= set(candidate_types())


def test_page_was_measured_on_the_newest_transformers_the_hf_extra_admits():
    """The ``hf`` extra's transformers bound admits the page's version and no later minor release: a release
    nobody measured is not installed by ``pip install int8kv[hf]``."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extra = re.search(r"^hf = \[(.*)\]$", pyproject, re.M)
    assert extra is not None
    wanted = [Requirement(r) for r in re.findall(r'"([^"]+)"', extra.group(1))]
    spec = next(r.specifier for r in wanted if r.name == "transformers")
    measured = Version(PAGE_VERSION)
    assert measured in spec, (PAGE_VERSION, str(spec))
    assert Version(f"{measured.major}.{measured.minor + 1}.0") not in spec, (PAGE_VERSION, str(spec))
