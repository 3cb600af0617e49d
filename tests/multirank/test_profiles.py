"""Release profiles on real rank processes: a release's rank-local host allocation parts the
ranks where the proposed vote keeps them together, and the release matrix says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.campaign.plan import CampaignSpec
from faults.campaign.releases import markdown, run_release_matrix
from faults.campaign.reports import junit_xml

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SPEC = CampaignSpec.model_validate({
    "name": "host-alloc",
    "defaults": {"workload.requests": 24, "cache.device_tokens": 512,
                 "cache.host_tokens": 1024, "observability.protocol_timeout_s": 4.0,
                 "observability.watchdog_timeout_s": 12.0},
    "cells": [{"tp": 2, "faults": ["host-alloc-fail:tp=1"], "expect": "healthy"},
              {"tp": 2, "legacy": ["skip-empty-sync"], "faults": ["host-alloc-fail:tp=1"],
               "expect": "collective-order-deadlock"}],
})


def test_release_matrix_of_a_failed_host_allocation_on_one_rank(tmp_path: Path) -> None:
    """TP1's host allocations fail. 0.5.23 allocates per rank (``_execute_kv_backup``
    L1737-1762): TP0 backs a node up, TP1 does not, their trees part and their next batches
    differ, so the ranks meet different collectives. Proposed (#31425) votes: both skip the
    backup and stay healthy. The legacy cell is not the matrix's: the profile decides
    switches."""
    result = run_release_matrix(SPEC, ["sglang-0.5.23", "proposed"],
                                bundle_root=tmp_path / "bundles")
    by = {c.column: c for c in result.cells}
    assert [c.id for c in result.cells] == ["sglang-0.5.23/tp2/fixed/host-alloc-fail:tp=1",
                                            "proposed/tp2/fixed/host-alloc-fail:tp=1"]
    assert by["proposed"].passed, by["proposed"].detail
    assert by["proposed"].output_match is True
    release = by["sglang-0.5.23"]
    assert not release.passed
    assert release.faults_fired > 0
    assert release.verdict is not None, release.detail
    assert release.bundle is not None
    assert Path(release.bundle).is_relative_to(tmp_path / "bundles" / "sglang-0.5.23")
    assert result.reproduces() == {release.verdict: ["sglang-0.5.23"]}
    page = markdown(result)
    assert "| `tp2 host-alloc-fail:tp=1` | " in page
    assert f"`{release.verdict}`: `sglang-0.5.23`" in page
    assert "<testcase" in junit_xml(result.as_campaign())
