"""Socorro-style regression: re-diagnose every stored fixture, fail on any change of verdict.

Each case directory holds its artifacts and ``expected.json`` (status, exit code, every named
signature in order, missing ranks). After a deliberate catalog change, review the diff of::

    HICACHE_UPDATE_EXPECTED=1 python -m pytest tests/doctor/test_regression.py

which rewrites the expectations.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from tests.doctor.conftest import EXPECTED, case_inputs, fixture_cases

CASES = fixture_cases()
UPDATE = os.environ.get("HICACHE_UPDATE_EXPECTED") == "1"


def _observed(case: Path) -> dict[str, object]:
    d = diagnose(case_inputs(case))
    return {"status": d.status, "exit_code": d.exit_code,
            "verdicts": [v.signature for v in d.verdicts],
            "missing_ranks": d.missing_ranks,
            "unreadable": sorted(Path(i.path).name for i in d.inputs if i.status != "read")}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_verdict_unchanged(case: Path) -> None:
    observed = _observed(case)
    path = case / EXPECTED
    if UPDATE:
        path.write_text(json.dumps(observed, indent=2) + "\n")
    assert path.exists(), f"no {EXPECTED} in {case}; run with HICACHE_UPDATE_EXPECTED=1"
    assert observed == json.loads(path.read_text())


def test_every_signature_has_a_fixture_that_names_it_first() -> None:
    from signatures.loader import load_catalog

    firsts = set()
    for case in CASES:
        verdicts = json.loads((case / EXPECTED).read_text())["verdicts"]
        if verdicts:
            firsts.add(verdicts[0])
    assert firsts == {s.id for s in load_catalog().signatures}


@pytest.mark.parametrize("case", [c for c in CASES if c.parent.name not in ("mixed", "no-fit")],
                         ids=lambda c: f"{c.parent.name}/{c.name}")
def test_fixture_group_names_its_signature_with_evidence_lines(case: Path) -> None:
    """Each fixture under ``<signature id>/`` is diagnosed as that id, with cited evidence."""
    d = diagnose(case_inputs(case))
    assert d.verdicts
    assert d.verdicts[0].signature == case.parent.name
    assert any(e.file for e in d.verdicts[0].evidence)
