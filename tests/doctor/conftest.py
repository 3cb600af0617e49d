"""Fixture corpus helpers for the doctor tests."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
EXPECTED = "expected.json"


def fixture_cases() -> list[Path]:
    """Every case directory: ``<group>/<case>/`` (the tools directory is not a case)."""
    return sorted(p for p in FIXTURES.glob("*/*") if p.is_dir() and p.parent.name != "tools")


def case_inputs(case: Path) -> list[str]:
    """The case's artifacts, without its stored expectation."""
    return sorted(str(p) for p in case.rglob("*") if p.is_file() and p.name != EXPECTED)


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES
