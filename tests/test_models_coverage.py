"""Int8KvCache over every decoder-only architecture of the installed transformers (tests/models_coverage.py).

Fails on any crash (an error that is not a typed refusal) or wrong output (no error, but tokens or logits off,
the int8kv kernels not called, or a refusal that changed the model), and checks that docs/models.md is what the
run finds (regenerate it with ``python tests/models_coverage.py``).
"""

from __future__ import annotations

import pytest
from models_coverage import DOC, render, run_all


@pytest.fixture(scope="module")
def outcomes():
    return list(run_all())


def test_no_crash_and_no_wrong_output(outcomes):
    bad = [o for o in outcomes if o.kind in ("crash", "wrong")]
    assert not bad, "\n".join(f"{o.model_type}: {o.kind}: {o.detail}" for o in bad)


def test_refusals_name_the_missing_feature(outcomes):
    refused = [o for o in outcomes if o.kind == "refused"]
    vague = [o for o in refused if not any(w in o.detail for w in ("implement", "cannot", "not", "only"))]
    assert not vague, vague
    works = [o for o in outcomes if o.kind == "works"]
    assert len(works) >= 0.75 * (len(works) + len(refused)), (len(works), len(refused))


def test_docs_models_page_is_what_the_run_finds(outcomes):
    if any(o.kind == "skipped" for o in outcomes):
        pytest.skip("a model ran over its time on this machine: the page cannot be compared")
    assert DOC.read_text() == render(outcomes), "docs/models.md is stale: run python tests/models_coverage.py"
