"""The pytest plugin, in real inner pytest runs (``pytester``): campaign cells as test items
(selected with -k, stopped with -x, reported in pytest's JUnit, spread over pytest-xdist
workers) and the ``hicache_run`` fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

SPEC = {
    "name": "tiny",
    "defaults": {"workload.requests": 6, "cache.device_tokens": 256, "cache.host_tokens": 512},
    "cells": [{"tp": 1, "faults": ["dma-lag:ms=5"], "expect": "healthy"},
              {"tp": 1, "faults": ["stage-lag:ms=2"], "expect": "healthy"},
              # an injected crash is no known signature: a cell that expects healthy fails
              {"tp": 1, "faults": ["crash:point=scheduler.step,step=2"], "expect": "healthy"}],
}


def _spec(pytester: pytest.Pytester) -> str:
    path = pytester.path / "tiny.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def test_cells_are_test_items(pytester: pytest.Pytester) -> None:
    spec = _spec(pytester)
    junit = pytester.path / "out.xml"
    result = pytester.runpytest("--hicache-campaign", spec, f"--junitxml={junit}",
                                "--hicache-bundle-dir", str(pytester.path / "bundles"))
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "campaign cell tp1/fixed/crash:steps=2-2,point=scheduler.step" in out
    assert "expected: healthy" in out
    assert "bundle: " in out
    xml = junit.read_text()
    assert 'name="tp1/fixed/dma-lag:ms=5"' in xml
    assert xml.count("<testcase") == 3


def test_k_selects_and_x_stops(pytester: pytest.Pytester) -> None:
    spec = _spec(pytester)
    picked = pytester.runpytest("--hicache-campaign", spec, "-k", "dma-lag")
    picked.assert_outcomes(passed=1, deselected=2)
    # the failing cell first: -x stops the session there, the healthy cells never run
    crash_first = pytester.path / "crash-first.json"
    crash_first.write_text(json.dumps({**SPEC, "cells": SPEC["cells"][::-1]}))
    stopped = pytester.runpytest("--hicache-campaign", str(crash_first), "-x")
    stopped.assert_outcomes(failed=1)
    assert "stopping after 1 failures" in stopped.stdout.str()
    # no --hicache-bundle-dir: the bundle is under pytest's base temporary directory (the
    # inner session's sits in this session's), which pytest cleans, not a /tmp/hicache-*
    bundle = Path(next(line.split("bundle: ", 1)[1].strip()
                       for line in stopped.stdout.lines if "  bundle: " in line))
    assert bundle.is_relative_to(pytester.path.parent), bundle
    assert bundle.parent.name.startswith("hicache-bundles"), bundle


def test_cells_spread_over_xdist_workers(pytester: pytest.Pytester) -> None:
    spec = _spec(pytester)
    result = pytester.runpytest_subprocess("--hicache-campaign", spec, "-n", "2",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)


def test_the_hicache_run_fixture_returns_the_typed_summary(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_run="""
        def test_a_run(hicache_run):
            s = hicache_run({"workload.requests": 4, "cache.device_tokens": 256},
                            faults=["dma-lag:ms=5"])
            assert s.outcome.value == "healthy", s.error
            assert s.output_match is True
            assert s.faults_fired > 0
    """)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.multiproc
def test_the_readme_example_runs_as_a_team_would_copy_it(pytester: pytest.Pytester) -> None:
    """The README's example test file, copied as it stands (two pipeline ranks, a slow
    stage, on the 0.5.23 profile)."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                  if "def test_" in b and "hicache_run" in b]
    assert example.startswith("# tests/test_hicache.py")
    pytester.makepyfile(test_hicache=example)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
