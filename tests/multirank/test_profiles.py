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


def _prefetch_events(path: Path) -> dict[str, int]:
    import json

    seen: dict[str, int] = {}
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "l3.prefetch.partial":
            seen["partial"] = seen.get("partial", 0) + 1
        elif e["kind"] == "l3.prefetch.revoke" and e["attrs"]["reason"] == "host_full":
            seen["host_full"] = seen.get("host_full", 0) + 1
    return seen


@pytest.mark.parametrize("profile", ["sglang-0.5.23", "proposed"])
def test_a_prefetch_into_a_full_l2_takes_the_prefix_that_fits_on_a_release(
        tmp_path: Path, profile: str) -> None:
    """0.5.23 (``allocate_storage_hit`` L796-829): a prefetch whose agreed hit does not fit
    in L2 takes the page-aligned prefix that does, per rank; the ranks' pools are alike, so
    they take the same length and the run stays healthy. Proposed takes all or nothing."""
    from hicache_runtime.contracts.bundle import RunOutcome
    from hicache_runtime.launch.run import run
    from tests.multirank.conftest import mr_config

    cfg = mr_config(**{"profile": profile, "topology.tp": 2, "workload.requests": 48,
                       "cache.device_tokens": 256, "cache.host_tokens": 384,
                       "storage.backend": "file", "storage.path": tmp_path / "l3",
                       "observability.trace_path": tmp_path / "t.jsonl"})
    warm = run(cfg.with_overrides(**{"observability.trace_path": None}), compare=False,
               bundle_root=tmp_path / "b")
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    s = run(cfg, bundle_root=tmp_path / "b")
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    seen = [_prefetch_events(tmp_path / f"t.rank{r}.jsonl") for r in (0, 1)]
    assert seen[0] == seen[1], "both ranks decide alike"
    if profile == "proposed":
        assert "partial" not in seen[0]
        assert seen[0].get("host_full", 0) > 0
    else:
        assert seen[0].get("partial", 0) > 0, seen[0]


def test_ranks_evict_alike_by_hit_counts(tmp_path: Path) -> None:
    """slru orders leaves by hit counts, which ``write_through_selective`` also reads: two TP
    ranks under a small L1 and L2 evict the same leaves in both tiers (the consensus check
    compares every eviction), and outputs match the cache-disabled run."""
    import json

    from hicache_runtime.contracts.bundle import RunOutcome
    from hicache_runtime.contracts.events import Ev
    from hicache_runtime.launch.run import run
    from tests.multirank.conftest import mr_config

    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 32,
                       "cache.device_tokens": 256, "cache.host_tokens": 384,
                       "cache.write_policy": "write_through_selective",
                       "cache.eviction_policy": "slru",
                       "observability.consensus_check": True,
                       "observability.trace_path": tmp_path / "t.jsonl"})
    s = run(cfg, bundle_root=tmp_path / "b")
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    victims = []
    for r in (0, 1):
        kinds = (Ev.EVICT, Ev.EVICT_HOST)
        victims.append([(e["kind"], e["attrs"]["victims"])
                        for e in map(json.loads, (tmp_path / f"t.rank{r}.jsonl").open())
                        if e["kind"] in kinds])
    assert victims[0] == victims[1]
    assert {k for k, v in victims[0] if v} == {Ev.EVICT, Ev.EVICT_HOST}  # both tiers
