"""``abort-frees-in-flight`` on one rank: a use-after-free that corrupts KV, never a double
free in the abort path's own accounting."""

from __future__ import annotations

import json
from pathlib import Path

from faults.spec import parse_fault
from hicache_runtime.config import load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import run_single


def test_abort_frees_in_flight_writes_late_and_frees_each_page_once(tmp_path: Path) -> None:
    """Every prefetch is aborted at its first batch: the abort frees its pages and the batch
    still lands in them once they were handed out again. Whether a corrupted copy is read
    back depends on the workload (the multi-rank campaign cell shows the wrong output); what
    never happens is a bookkeeping failure: the op's end must not free the pages the abort
    already freed (that was a deterministic ``DoubleFree`` in the scheduler)."""
    cfg = load_config({
        "workload.requests": 64, "cache.device_tokens": 512, "cache.host_tokens": 768,
        "storage.backend": "file", "storage.path": tmp_path / "l3",
        "legacy": frozenset({LegacySwitch.ABORT_FREES_IN_FLIGHT}),
        "faults": (parse_fault("mid-prefetch-abort:batch=0"),),
        "observability.trace_path": tmp_path / "run.jsonl",
        "observability.watchdog_timeout_s": 30.0})
    s = run_single(cfg, bundle_root=tmp_path / "bundles")
    assert s.outcome in (RunOutcome.HEALTHY, RunOutcome.WRONG_OUTPUT), s.error
    events = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    late = [e["attrs"] for e in events if e["kind"] == "l3.prefetch.late_write"]
    assert late, "the batch in flight at the abort still landed"
    assert any(e["reused"] for e in late), "into pages the pool had handed out again"
    aborted = {e["attrs"]["rid"] for e in events if e["kind"] == "req.abort"}
    assert {e["rid"] for e in late} <= aborted
    # the run drained: the integrity check (free + tree + in flight == capacity) passed
    assert any(e["kind"] == "check.integrity" and e["attrs"].get("at") == "drain"
               for e in events)


def test_an_abort_for_a_later_batch_waits_for_an_op_that_reaches_it(tmp_path: Path) -> None:
    """``mid-prefetch-abort:batch=1`` fires only at the second batch of an op: an op of one
    batch passes its point without spending the fault or counting as a firing (the run
    summary said "fired 1x" of an abort that never happened, and the fault was spent before
    an op of two batches came). With four pages per batch, every firing is followed by the
    abort of the op it fired in, at the batch it names."""
    cfg = load_config({
        "workload.requests": 48, "cache.device_tokens": 512, "cache.host_tokens": 768,
        "storage.backend": "file", "storage.path": tmp_path / "l3",
        "storage.io_batch_pages": 4,
        "faults": (parse_fault("mid-prefetch-abort:batch=1"),),
        "observability.trace_path": tmp_path / "run.jsonl",
        "observability.watchdog_timeout_s": 30.0})
    s = run_single(cfg, bundle_root=tmp_path / "bundles")
    assert s.outcome == RunOutcome.HEALTHY, s.error
    events = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    fired = [e["attrs"]["rid"] for e in events if e["kind"] == "fault.fired"]
    assert fired, "some op reached its second batch"
    assert s.faults_fired == len(fired)
    hits = {e["attrs"]["rid"]: e["attrs"]["agreed"] for e in events
            if e["kind"] == "l3.prefetch.hit"}
    short = [rid for rid, pages in hits.items() if 0 < pages <= 4]
    assert short, "the workload has ops of one batch too"
    assert not set(short) & set(fired), "an op of one batch never takes a batch=1 abort"
    assert all(hits[rid] > 4 for rid in fired)
    aborted = {e["attrs"]["rid"] for e in events if e["kind"] == "req.abort"}
    assert set(fired) <= aborted
