"""Shared test setup: Hypothesis profiles, stable terminal output, small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Verbosity, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("debug", max_examples=10, deadline=None, verbosity=Verbosity.verbose)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _stable_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_WIDTH", "120")
    monkeypatch.setenv("NO_COLOR", "1")


@pytest.fixture
def bundle_root(tmp_path: Path) -> Path:
    path = tmp_path / "bundles"
    path.mkdir()
    return path
