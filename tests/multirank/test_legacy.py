"""Legacy switches restore the pre-fix protocols, and each fails the way production did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome, load_manifest
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.parametrize(("legacy", "site"), [
    # 0.5.13 (counts decided on PP0): the skipping rank's loading check pairs with its peer's
    # writing check, so the peer is left waiting in its loading check
    ({LegacySwitch.SKIP_EMPTY_SYNC}, "_classic_"),
    # 0.5.5 (loads drained locally): the peer waits in its writing check, as py-spy showed
    ({LegacySwitch.SKIP_EMPTY_SYNC, LegacySwitch.LOCAL_ACK_DRAIN}, "_classic_writing_check"),
], ids=["chained", "with-local-ack-drain"])
def test_skip_empty_sync_deadlocks_at_different_collective_sites(
        bundle_root: Path, legacy: set[LegacySwitch], site: str) -> None:
    cfg = mr_config(**{"topology.tp": 2, "legacy": frozenset(legacy),
                       "faults": (parse_fault("host-alloc-fail:tp=1"),)})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HANG, s.error
    assert s.bundle is not None
    assert "Timed out waiting" in (s.error or "")
    bundle = Path(s.bundle)
    m = load_manifest(bundle)
    sites = set()
    for entry in m.ranks:
        records = json.loads((bundle / (entry.files.flight_recorder or "")).read_text())
        stuck = [r for r in records if r["state"] != "completed" and r["op"] != "isend"]
        assert stuck, f"rank {entry.rank} is blocked in a collective"
        sites.add((stuck[-1]["group"], stuck[-1]["site"]))
    assert len(sites) == 2, f"ranks blocked at different sites: {sites}"
    assert any(site in where for _, where in sites), sites


def test_skip_empty_sync_with_chained_counts_pops_from_an_empty_ack_queue(
        bundle_root: Path) -> None:
    """0.5.13: PP0's write and load counts go down the pipeline one message per check. PP1's
    host allocations fail, so its in-flight set stays empty and it skips its writing check;
    its loading check then reads PP0's write count, larger than its own load ack queue."""
    cfg = mr_config(**{"topology.pp": 2, "workload.requests": 48, "cache.device_tokens": 2048,
                       "legacy": frozenset({LegacySwitch.SKIP_EMPTY_SYNC}),
                       "faults": (parse_fault("host-alloc-fail:pp=1"),)})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH, s.error
    assert "rank 1" in (s.error or "")
    assert "IndexError: pop from empty list" in (s.error or "")
    bundle = Path(s.bundle or "")
    tb = (bundle / "rank1" / "traceback.txt").read_text()
    assert tb.rstrip().endswith("IndexError: pop from empty list")
    assert "in _classic_loading_check" in tb
    assert "in pop_ack" in tb
    assert "acks.pop(0)" in tb
    events = [json.loads(x) for x in (bundle / "rank1" / "events.jsonl").read_text().splitlines()]
    votes = [e["attrs"] for e in events if e["kind"] == "sync.vote"
             and e["attrs"].get("site") in ("writing_check", "loading_check")]
    assert votes
    assert all(v["site"] == "loading_check" for v in votes), \
        "PP1 never ran a writing check: its in-flight set stayed empty"
    assert votes[-1]["agreed"] > 0, "the count that overran its queue came from PP0"
    assert [e for e in events if e["kind"] == "l2.write.skip"]
    from doctor.diagnose import diagnose

    assert diagnose([bundle]).verdicts[0].signature == "write-ack-pop-empty"


def test_local_ack_drain_breaks_the_downstream_batch(bundle_root: Path) -> None:
    cfg = mr_config(**{"topology.pp": 2, "workload.requests": 48, "cache.device_tokens": 256,
                       "legacy": frozenset({LegacySwitch.LOCAL_ACK_DRAIN}),
                       "faults": (parse_fault("dma-lag:pp=1,ms=30"),)})
    s = run(cfg, bundle_root=bundle_root)
    bundle = Path(s.bundle or "")
    assert load_manifest(bundle).legacy == ["local-ack-drain"]
    from doctor.diagnose import diagnose

    d = diagnose([bundle])
    # The stages' views of a batch diverge at the drain; what follows depends on timing. PP1
    # runs a batch of its own that disagrees with the one PP0 sent (its reshape fails), or,
    # when its view is empty, runs none where PP0 sent one, and the two wait for each other
    # until gloo times them out (tests/doctor/test_real_bundles.py keeps such a run).
    if s.outcome is RunOutcome.HANG:
        assert "message-skipped" in d.fingerprint.facts, s.error
        assert d.verdicts[0].signature == "prefix-length-mismatch"
        return
    assert s.outcome is RunOutcome.CRASH, s.error
    assert d.verdicts[0].signature in ("prefix-length-mismatch", "write-ack-pop-empty")
    err = s.error or ""
    assert "rank 1" in err
    assert "pop from empty list" in err or "shape" in err
    events = [json.loads(x) for x in (bundle / "rank1" / "events.jsonl").read_text().splitlines()]
    recv = [e["attrs"] for e in events if e["kind"] == "pp.recv"]
    assert any(r["sender_rids"] != r["local_rids"] or r["sender_tokens"] != r["local_tokens"]
               for r in recv), "the stage's own batch disagreed with what PP0 sent"


def test_fixed_protocols_survive_the_same_faults(bundle_root: Path, tmp_path: Path) -> None:
    """The proposed protocols (every fix plus the host-allocation vote) survive the faults of
    every switch at once; a release's rank-local allocation does not survive the first of them
    (``test_profiles.py``)."""
    faults = ("host-alloc-fail:tp=1,p=0.3;dma-lag:pp=1,ms=30;"
              "storage-shortfall:rank=3,mode=short,pages=2;mid-prefetch-abort:batch=1")
    from faults.spec import parse_faults

    cfg = mr_config(**{"profile": "proposed",
                       "topology.tp": 2, "topology.pp": 2, "workload.requests": 32,
                       "cache.device_tokens": 256, "storage.backend": "file",
                       "storage.path": tmp_path / "l3", "storage.io_batch_pages": 2,
                       "faults": tuple(parse_faults([faults])),
                       "observability.consensus_check": True})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.faults_fired > 0


def test_local_prefetch_progress_keeps_each_stages_tp_votes(bundle_root: Path,
                                                            tmp_path: Path) -> None:
    """Pre-#27010 the hit length, the terminate decision and the settled progress were voted
    over each stage's TP ranks (only stages never agreed), so under TP alone one rank's short
    L3 hit is every TP rank's: no rank-dependent batch, no gloo size mismatch."""
    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 48, "cache.host_tokens": 768,
                       "storage.backend": "file", "storage.path": tmp_path / "l3",
                       "legacy": frozenset({LegacySwitch.LOCAL_PREFETCH_PROGRESS}),
                       "faults": (parse_fault("storage-shortfall:rank=1,mode=short,pages=3"),),
                       "observability.trace_path": tmp_path / "run.jsonl"})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    hits = {}
    for rank in (0, 1):
        lines = (tmp_path / f"run.rank{rank}.jsonl").read_text().splitlines()
        hits[rank] = [e["attrs"] for e in map(json.loads, lines)
                      if e["kind"] == "sync.vote" and e["attrs"]["site"] == "prefetch_hit"]
    assert hits[0], "prefetches were queried"
    assert all(v.get("stage_local") for r in hits for v in hits[r]), "the stage's own TP vote"
    assert [v["agreed"] for v in hits[0]] == [v["agreed"] for v in hits[1]]
    assert any(a["local"] != b["local"] for a, b in zip(hits[0], hits[1], strict=True)), \
        "rank 1's short hits were outvoted by the MIN, not absent"


@pytest.mark.parametrize("fault", ["dma-lag:rank=1,hold=3", None], ids=["lag", "no-fault"])
def test_wallclock_lru_diverges_through_stamps_taken_when_a_ranks_own_copy_finishes(
        bundle_root: Path, fault: str | None) -> None:
    """The same tree operations in the same order are ordered alike by any monotonic clock, so
    without a fault the wall clock changes nothing. With rank 1 seeing its copies finished
    3 steps late, the stamps each rank takes when it finds its own copies finished land later
    on rank 1 than nodes both ranks touched meanwhile: the ranks evict different victims. The
    hold is in steps, so the same decision diverges however loaded the machine is."""
    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 48,
                       "cache.device_tokens": 1024, "cache.host_tokens": 512,
                       "legacy": frozenset({LegacySwitch.WALLCLOCK_LRU}),
                       "faults": (parse_fault(fault),) if fault else (),
                       "observability.consensus_check": True})
    s = run(cfg, bundle_root=bundle_root)
    if fault is None:
        assert s.outcome is RunOutcome.HEALTHY, s.error
        assert s.output_match is True
        return
    assert s.outcome is RunOutcome.CRASH, s.error
    error = s.error or ""
    # Every step waits until every decision so far was compared (ConsensusChecker.verify):
    # the divergent eviction is named before a batch it changed can reach a collective (where
    # gloo would abort a rank on the mismatched sizes instead).
    assert "RankDivergence" in error, error
    assert "tree.evict" in error
    from doctor.diagnose import diagnose

    assert diagnose([Path(s.bundle or "")]).verdicts[0].signature == "lru-clock-divergence"


def _events(bundle: Path, kind: str) -> list[dict]:
    out = []
    for path in sorted(bundle.glob("rank*/events.jsonl")):
        out += [e["attrs"] for e in map(json.loads, path.read_text().splitlines())
                if e["kind"] == kind]
    return out


def test_abort_frees_in_flight_is_a_use_after_free_not_a_double_free(bundle_root: Path,
                                                                      tmp_path: Path) -> None:
    """Pre-#31296 the abort gave the prefetch's host pages back while the IO thread still
    wrote them: they went to other nodes' host copies, the late writes landed on top, and the
    outputs that loaded those copies are wrong. No bookkeeping check fires: the abort path
    frees each page once, and the op's own end frees nothing it already gave back. 96 requests,
    as the switch's registry recipe."""
    cfg = mr_config(**{"topology.tp": 2, "workload.requests": 96, "cache.host_tokens": 768,
                       "storage.backend": "file", "storage.path": tmp_path / "l3",
                       "legacy": frozenset({LegacySwitch.ABORT_FREES_IN_FLIGHT}),
                       "faults": (parse_fault("mid-prefetch-abort:batch=0"),)})
    s = run(cfg, bundle_root=bundle_root)
    # Each late batch lands as a load-back reads its pages, or never (kv/late_writes.py)
    landed = {r: (c.l3.late_writes_posted, c.l3.late_writes_read)
            for r, c in s.cache_stats.ranks.items() if c.l3 is not None}
    assert s.outcome is RunOutcome.WRONG_OUTPUT, (s.error, f"late writes (posted, read) "
                                                           f"per rank: {landed}")
    assert s.output_match is False
    bundle = Path(s.bundle or "")
    late = _events(bundle, "l3.prefetch.late_write")
    assert any(e["reused"] for e in late), "late writes into pages handed out again"
    for entry in sorted(bundle.glob("rank*")):
        text = "".join(p.read_text() for p in entry.glob("*.txt"))
        assert "Double-free" not in text
        assert "Double-alloc" not in text
    from doctor.diagnose import diagnose

    d = diagnose([bundle])
    assert d.verdicts[0].signature == "prefetch-abort-use-after-free"
