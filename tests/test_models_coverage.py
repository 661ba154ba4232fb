"""Int8KvCache over every decoder-only architecture of the installed transformers (tests/models_coverage.py).

One test per model type (so the suite's workers share them): it fails on a crash (an error that is not a typed
refusal) or wrong output (no error, but tokens or logits off, the int8kv kernels not called, or a refusal that
changed the model), in the drop-in or, for a type the drop-in runs, in the engine; on a refusal that does not
name what is missing; and when docs/models.md does not list the type as the run finds it (regenerate the page
with ``python tests/models_coverage.py``).
"""

from __future__ import annotations

import os
import re

import pytest
from models_coverage import DOC, candidate_types, outcome, page_rows, render, warm_up

PAGE = DOC.read_text()
ROWS = page_rows(PAGE)


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
    assert set(ROWS) <= set(candidate_types())
