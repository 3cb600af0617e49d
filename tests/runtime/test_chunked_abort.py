"""Deferred chunked abort on one rank: an abort of a request between two chunks of its prefill
waits for the next step's plan and is applied first thing in that step's batch formation; the
run stays healthy, its outputs match a cache-disabled run that replays the same aborts, and
no page is left behind. ``abort-chunked-on-the-spot`` tears the request down where the abort
arrives instead, which a lone rank survives (it has no peer to disagree with)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faults.spec import parse_fault
from hicache_runtime.config import load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import RunSummary, run_single

#: A long prompt is 384 document tokens and a 12-token question: at 64 tokens a chunk, seven
#: chunks, so six boundaries between two of them.
CHUNK = 64
BOUNDARIES = range(6)


def _run(tmp_path: Path, faults: list[str], **overrides: object) -> tuple[RunSummary,
                                                                         list[dict[str, Any]]]:
    cfg = load_config({
        "workload.kind": "long_context", "workload.requests": 10,
        "scheduler.chunked_prefill_size": CHUNK,
        "faults": tuple(parse_fault(f) for f in faults),
        "observability.trace_path": tmp_path / "run.jsonl", **overrides})
    s = run_single(cfg, bundle_root=tmp_path / "bundles")
    events = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    return s, events


def _of(events: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (e for e in events if e["kind"] == kind)


def _assert_clean(s: RunSummary) -> None:
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True, s.mismatches
    assert s.leaks is not None
    assert s.leaks.complete
    assert s.leaks.leaked_pages == 0, s.leaks.describe()


@pytest.mark.parametrize("chunk", BOUNDARIES)
def test_an_abort_after_any_chunk_waits_for_the_next_plan(tmp_path: Path, chunk: int) -> None:
    s, events = _run(tmp_path, [f"chunked-abort:chunk={chunk}"])
    _assert_clean(s)
    fired = [(e["step"], e["attrs"]["rid"]) for e in _of(events, Ev.FAULT)]
    assert fired, "some prompt was long enough to reach this boundary"
    assert s.aborted >= len(fired)
    for step, rid in fired:
        got = [e for e in _of(events, Ev.ABORT_RECEIVED) if e["attrs"]["rid"] == rid]
        assert [(e["step"], e["attrs"]["source"], e["attrs"]["deferred"],
                 e["attrs"]["apply_step"]) for e in got] == [(step, "fault", True, step + 1)]
        plans = [e["step"] for e in _of(events, Ev.PLAN_ABORTS) if rid in e["attrs"]["rids"]]
        assert plans == [step + 1]
        applied = [e for e in _of(events, Ev.ABORT_APPLIED) if e["attrs"]["rid"] == rid]
        assert [(e["step"], e["attrs"]["where"], e["attrs"]["deferred"],
                 e["attrs"]["on_the_spot"]) for e in applied] == [
                     (step + 1, "chunked", True, False)]
        # torn down before the step's batch was formed: no chunk of it after the abort, and
        # exactly ``chunk + 1`` chunks of its prefill ran
        batches = [e for e in _of(events, Ev.BATCH) if rid in e["attrs"]["rids"]]
        assert max(e["step"] for e in batches) == step
        assert len(batches) == chunk + 1
        assert all(e["attrs"]["extend"][e["attrs"]["rids"].index(rid)] == CHUNK
                   for e in batches)


def test_client_aborts_of_chunked_requests_are_deferred_too(tmp_path: Path) -> None:
    """The workload's own client aborts (every request, a few steps after it arrived) take
    the same path: into the step's plan, and a chunked request torn down at the batch
    formation of that step."""
    s, events = _run(tmp_path, [], **{"workload.abort_fraction": 1.0})
    _assert_clean(s)
    received = {e["attrs"]["rid"]: e for e in _of(events, Ev.ABORT_RECEIVED)}
    assert {e["attrs"]["source"] for e in received.values()} == {"client"}
    chunked = [e for e in _of(events, Ev.ABORT_APPLIED) if e["attrs"]["where"] == "chunked"]
    assert chunked, "some abort reached a request in the middle of its prefill"
    for e in chunked:
        rid = e["attrs"]["rid"]
        assert e["attrs"]["deferred"]
        assert not e["attrs"]["on_the_spot"]
        assert e["step"] == received[rid]["step"] == received[rid]["attrs"]["apply_step"]
        assert not received[rid]["attrs"]["deferred"]  # it arrived at the top of its step
        assert all(b["step"] < e["step"] for b in _of(events, Ev.BATCH)
                   if rid in b["attrs"]["rids"])


def test_on_the_spot_tears_down_where_the_abort_arrives(tmp_path: Path) -> None:
    """The legacy path on a lone rank: the request goes in the middle of the step the fault
    fired in and no plan carries it. Nothing disagrees, so the run stays healthy: the
    divergence needs peers (``tests/multirank/test_chunked_abort.py``)."""
    s, events = _run(tmp_path, ["chunked-abort:chunk=2"],
                     legacy=frozenset({LegacySwitch.ABORT_CHUNKED_ON_THE_SPOT}))
    _assert_clean(s)
    fired = [(e["step"], e["attrs"]["rid"]) for e in _of(events, Ev.FAULT)]
    assert fired
    assert not list(_of(events, Ev.PLAN_ABORTS))
    for step, rid in fired:
        applied = [(e["step"], e["attrs"]["on_the_spot"]) for e in _of(events, Ev.ABORT_APPLIED)
                   if e["attrs"]["rid"] == rid]
        assert applied == [(step, True)]
