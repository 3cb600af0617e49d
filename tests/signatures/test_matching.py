"""Scoring: structure is required, near misses explain themselves, negative facts subtract."""

from __future__ import annotations

from signatures.fact_names import Fact
from signatures.loader import load_catalog
from signatures.matching import (
    NEAR_MISS,
    Observation,
    ObservedException,
    ObservedStack,
    Witness,
    elsewhere,
    score_all,
    score_one,
)

W = Witness("seen", "x.log", 3, 1)


def _pop_empty(in_app: list[str]) -> ObservedException:
    return ObservedException("IndexError", "pop from empty list", in_app, W)


def test_message_alone_never_names_a_signature() -> None:
    catalog = load_catalog()
    obs = Observation(exceptions=[_pop_empty(["handler", "worker"])])
    s = score_one(catalog.get("write-ack-pop-empty"), catalog, obs)
    assert not s.named
    assert s.score >= NEAR_MISS
    assert "message alone" in s.because()
    # what is missing is structure: the drain's frame, or the controller failing in its own code
    assert "in-app frame" in s.because() or "mechanism controller" in s.because()


def test_message_and_in_app_drain_frame_name_it() -> None:
    catalog = load_catalog()
    obs = Observation(exceptions=[_pop_empty(["writing_check", "check_hicache_events"])])
    s = score_one(catalog.get("write-ack-pop-empty"), catalog, obs)
    assert s.named
    assert s.score >= 0.6
    frame_rule = next(r for r in s.rules if r.recogniser.startswith("in-app frame"))
    assert frame_rule.matched
    assert frame_rule.witnesses[0].file == "x.log"


def test_frames_of_a_peers_timeout_do_not_count_as_the_failing_stack() -> None:
    catalog = load_catalog()
    timeout = ObservedException("RuntimeError", "Timed out waiting 1000ms for recv operation",
                                ["writing_check"], W, secondary=True)
    s = score_one(catalog.get("write-ack-pop-empty"), catalog, Observation(exceptions=[timeout]))
    assert s.score == 0


def test_negative_fact_points_elsewhere() -> None:
    catalog = load_catalog()
    blocked = ObservedStack("blocked", ["writing_check"], W)
    base = Observation(stacks=[blocked], facts={Fact.BLOCKED_SITES_DIVERGE: [W], Fact.HANG: [W]})
    idle = Observation(stacks=[blocked], facts={**base.facts, Fact.ALL_RANKS_IDLE: [W]})
    sig = catalog.get("collective-order-deadlock")
    assert score_one(sig, catalog, base).named
    s = score_one(sig, catalog, idle)
    assert not s.named
    assert "point elsewhere" in s.because()


def test_scores_are_clamped_and_sorted_named_first() -> None:
    catalog = load_catalog()
    obs = Observation(facts={f: [W] for f in Fact}, legacy={"skip-empty-sync": W})
    scores = score_all(catalog, obs)
    assert all(0.0 <= s.score <= 1.0 for s in scores)
    named = [s.named for s in scores]
    assert named == sorted(named, reverse=True)


def test_log_pattern_needs_its_minimum_count() -> None:
    catalog = load_catalog()
    sig = catalog.get("prefetch-reservation-leak")
    few = Observation(log_hits={"prefetch-rate-limited": (2, [W])})
    many = Observation(log_hits={"prefetch-rate-limited": (5, [W])})
    assert not score_one(sig, catalog, few).named
    assert score_one(sig, catalog, many).named


def test_a_path_pattern_says_nothing_for_a_file_the_component_map_puts_elsewhere() -> None:
    """A storage signature's ``lmcache/v1/storage_backend/`` rule, on a stack whose only
    LMCache frame is the local CPU backend (the host memory tier in the component map)."""
    catalog = load_catalog()
    sig = catalog.get("storage-backend-failure")
    host = "/usr/lib/python3/dist-packages/lmcache/v1/storage_backend/local_cpu_backend.py"
    disk = "/usr/lib/python3/dist-packages/lmcache/v1/storage_backend/local_disk_backend.py"
    assert elsewhere(sig, host)
    assert not elsewhere(sig, disk)
    for path, counts in ((host, False), (disk, True)):
        exc = ObservedException("RuntimeError", "boom", ["calculate_chunk_budget"], W,
                                files=[path])
        s = score_one(sig, catalog, Observation(exceptions=[exc]))
        frame_rule = next(r for r in s.rules if r.recogniser.startswith("in-app frame"))
        assert frame_rule.matched is counts, path
