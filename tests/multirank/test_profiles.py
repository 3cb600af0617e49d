"""Release profiles on real rank processes: a release's rank-local host allocation parts the
ranks where the proposed vote keeps them together, and the release matrix says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_runtime.contracts.profiles import PROFILES
from tests.readme_blocks import narrowed, readme_line, run_line

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]



def test_release_matrix_of_a_failed_host_allocation_on_one_rank(tmp_path: Path) -> None:
    """The README's release-matrix line, narrowed to the cell where TP1's host allocations
    fail. Every release allocates per rank (0.5.23: ``_execute_kv_backup`` L1737-1762): TP0
    backs a node up, TP1 does not, their trees part and their next batches differ, so the
    ranks meet different collectives. Proposed (#31425) votes: both skip the backup and stay
    healthy. The legacy twin is not the matrix's: the profile decides switches."""
    line = narrowed(readme_line("hicache campaign --profiles"), "tp2/*/host-alloc-fail:tp=1")
    proc = run_line(line + " --json", tmp_path, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads(proc.stdout)
    releases = [p for p in PROFILES if p != "proposed"]
    assert [c["id"] for c in result["cells"]] == \
        [f"{p}/tp2/fixed/host-alloc-fail:tp=1" for p in (*releases, "proposed")]
    by = {c["column"]: c for c in result["cells"]}
    assert by["proposed"]["passed"], by["proposed"]["detail"]
    assert by["proposed"]["output_match"] is True
    for name in releases:
        release = by[name]
        assert not release["passed"], name
        assert release["faults_fired"] > 0, name
        assert release["verdict"] is not None, release["detail"]
        assert (tmp_path / release["bundle"]).parent == tmp_path / "hicache-bundles" / name
    assert sorted(p for ps in result["reproduces"].values() for p in ps) == sorted(releases)
    page = (tmp_path / "releases.md").read_text()
    assert "| `tp2 host-alloc-fail:tp=1` | " in page
    for verdict, names in result["reproduces"].items():
        assert f"`{verdict}`: " + ", ".join(f"`{n}`" for n in names) in page


def test_the_readme_run_on_a_release_profile_parts_the_ranks(tmp_path: Path) -> None:
    """The README's run on 0.5.13 with TP1's host allocations failing: the ranks part and the
    run ends with a bundle (the doctor names it in the matrix above)."""
    proc = run_line(readme_line("hicache run --tp 2 --profile"), tmp_path)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    text = " ".join(proc.stdout.split())
    assert "outcome hang" in text or "outcome crash" in text, proc.stdout
    assert "host-alloc-fail:tp=1" in text
    assert "Traceback" not in proc.stderr
    (bundle,) = (tmp_path / "hicache-bundles").iterdir()
    assert (bundle / "manifest.json").is_file()


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
