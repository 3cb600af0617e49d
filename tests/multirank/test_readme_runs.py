"""The README's multi-rank ``hicache run`` lines, run as written in a shell (each in a folder
of its own, as a reader would): four ranks with the consensus check, four ranks on a file
store (run twice: the second run reads what the first stored), an injected crash that leaves
a bundle, and two DP groups under the controller."""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest

from hicache_runtime.contracts.bundle import load_manifest
from tests.readme_blocks import readme_line, run_line

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _summary(proc: CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    summary: dict[str, Any] = json.loads(proc.stdout)
    assert summary["outcome"] == "healthy", summary.get("error")
    assert summary["output_match"] is True, summary.get("mismatches", [])[:2]
    return summary


def test_four_ranks_with_the_consensus_check(tmp_path: Path) -> None:
    proc = run_line(readme_line("hicache run --tp 2 --pp 2 --requests 48 --consensus-check"),
               tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    text = " ".join(proc.stdout.split())
    assert "outcome │ healthy" in text or "outcome healthy" in text, proc.stdout
    assert "tp=2 pp=2" in text
    assert "48 completed, 0 aborted of 48" in text
    assert "identical to the cache-disabled run" in text
    assert not (tmp_path / "hicache-bundles").exists()


def test_four_ranks_on_a_file_store_read_it_back_on_the_next_run(tmp_path: Path) -> None:
    """Run twice in one folder: the first run fills ./l3 with what L2 could not hold, the
    second (new processes, empty L1 and L2) hits it; both give the cache-disabled outputs."""
    line = readme_line("hicache run --tp 2 --pp 2 --storage file")
    first = _summary(run_line(line, tmp_path))
    assert first["topology"] == {"tp": 2, "pp": 2}
    assert first["cached_tokens"]["device"] > 0
    assert first["cached_tokens"]["host"] > 0
    assert list((tmp_path / "l3").rglob("*")), "the first run stored pages"
    again = _summary(run_line(line, tmp_path))
    assert again["cached_tokens"]["storage"] > 0, again["cached_tokens"]


def test_an_injected_crash_leaves_a_bundle_of_every_rank(tmp_path: Path) -> None:
    proc = run_line(readme_line("hicache run --fault crash:rank=1"), tmp_path)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    text = " ".join(proc.stdout.split())
    assert "outcome crash" in text, proc.stdout
    assert "(fired 1x)" in text, proc.stdout
    (bundle,) = (tmp_path / "hicache-bundles").iterdir()
    manifest = load_manifest(bundle)
    (fault,) = manifest.faults
    assert fault.startswith("crash:"), fault
    assert [(f.rank, f.step, f.fatal) for f in manifest.faults_fired] == [(1, 20, True)]
    assert {r.rank for r in manifest.ranks} == {0, 1}


def test_two_dp_groups_under_the_controller(tmp_path: Path) -> None:
    summary = _summary(run_line(readme_line("hicache run --dp 2 --tp 2"), tmp_path))
    assert summary["topology"] == {"tp": 2, "pp": 1, "dp": 2}
    assert summary["completed"] == summary["requests"] > 0
    assert set(summary["cache_stats"]["ranks"]) == {"0", "1", "2", "3"}
