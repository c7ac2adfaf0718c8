"""docs/reliability.md cannot drift from the fault registry or from the recorded run."""

from __future__ import annotations

import json
import os

import pytest
import render_doc
from faults import _ALL, FAULTS, RESULTS_ENV


def test_registry_ids_are_unique_and_counts_sane() -> None:
    assert len(FAULTS) == len(_ALL)
    assert {f.area for f in _ALL} == set(range(1, 12))  # every area of issue 7 has a row
    assert all(0 < f.trials_short <= f.trials_full for f in _ALL)


@pytest.mark.skipif(bool(os.environ.get(RESULTS_ENV)), reason="this run is recording new results; render_doc.py checks them after it")
def test_doc_table_matches_registry_and_recorded_results() -> None:
    results = json.loads(render_doc.RESULTS.read_text())
    assert render_doc.problems(results) == [], "run `make reliability-doc`"
    doc = render_doc.DOC.read_text()
    assert render_doc.splice(doc, render_doc.render(results)) == doc, (
        "docs/reliability.md is stale: run `python tests/reliability/render_doc.py` (or `make reliability-doc`)"
    )
