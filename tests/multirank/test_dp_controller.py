"""The DP controller with real rank processes: requests spread over the groups, a burst does not
pile onto one group, control messages and aborts reach each group's entry rank only (its peers
get them through the group's own step exchange), an external routing goes straight through,
and a failure in one group leaves one bundle holding every group's ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from doctor.diagnose import diagnose
from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome, load_manifest
from hicache_runtime.contracts.events import Ev
from hicache_runtime.kv.request import Req
from hicache_runtime.launch.dp_controller import launch_dp
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _routes(trace: Path) -> list[dict[str, Any]]:
    return [e["attrs"] for e in _events(trace.with_name("t.controller.jsonl"), Ev.DP_ROUTE)]


def test_hicache_run_dp2_is_healthy_and_spreads_requests_over_both_groups(
        tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    res = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "run", "--dp", "2", "--tp", "1", "--pp", "1",
         "--requests", "16", "--json", "--trace", str(trace),
         "--bundle-dir", str(tmp_path / "bundles")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    assert summary["outcome"] == "healthy"
    assert summary["output_match"] is True
    assert summary["topology"] == {"tp": 1, "pp": 1, "dp": 2}
    assert summary["completed"] == 16
    assert set(summary["cache_stats"]["ranks"]) == {"0", "1"}
    routes = _routes(trace)
    assert sorted(r["rid"] for r in routes) == sorted({r["rid"] for r in routes})  # once each
    assert len(routes) == 16
    by_group = Counter(r["group"] for r in routes)
    assert by_group == {0: 8, 1: 8}  # round robin
    for g in (0, 1):
        got = [e["attrs"] for e in _events(tmp_path / f"t.dp{g}.jsonl", Ev.DP_RECEIVE)]
        assert sorted(a["rid"] for a in got if a["what"] == "request") == sorted(
            r["rid"] for r in routes if r["group"] == g)
        assert [a["what"] for a in got][-1] == "end"
        assert {e["attrs"]["rid"] for e in _events(tmp_path / f"t.dp{g}.jsonl", Ev.REQ_FINISH)} \
            == {r["rid"] for r in routes if r["group"] == g}


def _bursts(routes: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Routing decisions cut where the router re-read the board: inside a burst each decision
    saw the previous one's loads plus its own dispatch (the speculative +1)."""
    out: list[list[dict[str, Any]]] = []
    for r in routes:
        if out:
            prev = out[-1][-1]
            expect = list(prev["loads"])
            expect[prev["group"]] += 1
            if r["loads"] == expect:
                out[-1].append(r)
                continue
        out.append([r])
    return out


def test_a_burst_under_shortest_queue_spreads_over_every_group(tmp_path: Path) -> None:
    """Sessions start six at once, a burst every 10 steps, faster than the board is re-read:
    only the speculative count keeps a burst off the group that looked emptiest."""
    trace = tmp_path / "t.jsonl"
    # Requests of 32 tokens each: no group finishes one while a burst is being routed, so a
    # queue that looks shorter is shorter because of the routing, not because work drained
    # (with 8-token requests a group slowed less than the controller finished one mid-burst,
    # and the burst rightly went on to it: 4 of 6).
    cfg = mr_config(**{"topology.dp": 3, "topology.dp_policy": "shortest-queue",
                       "workload.requests": 30, "workload.burst_sessions": 6,
                       "workload.max_new_tokens": 32,
                       "workload.arrival_gap_steps": 10, "observability.trace_path": trace})
    res = launch_dp(cfg, bundle_root=tmp_path / "bundles")
    try:
        assert res.outcome is RunOutcome.HEALTHY, res.error
    finally:
        res.cleanup()
    routes = _routes(trace)
    assert len(routes) == 30
    assert all(r["reason"] == "shortest-queue" for r in routes)
    bursts = _bursts(routes)
    # The first burst meets every group ready and empty: it is spread, not piled onto one
    # group. (How many of its decisions fall between two board reads depends on how fast the
    # controller runs: on a loaded machine 20 ms pass inside one burst.)
    assert max(Counter(r["group"] for r in routes[:6]).values()) <= 3, routes[:6]
    for burst in bursts:
        seen = burst[0]["loads"]
        after = list(burst[-1]["loads"])
        after[burst[-1]["group"]] += 1
        for r in burst:  # each dispatch to a shortest queue as the router saw them...
            assert r["loads"][r["group"]] == min(r["loads"]), burst
        # ...so a burst levels the queues instead of piling onto one
        assert max(after) - min(after) <= max(1, max(seen) - min(seen)), burst
    served = Counter(r["group"] for r in routes)
    assert min(served.get(g, 0) for g in range(3)) >= 4, served


def test_aborts_and_control_messages_reach_each_group_s_entry_rank_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    cfg = mr_config(**{"topology.dp": 2, "topology.tp": 2, "workload.requests": 16,
                       "workload.abort_fraction": 0.4, "observability.trace_path": trace})
    summary = run(cfg, bundle_root=tmp_path / "bundles")
    assert summary.outcome is RunOutcome.HEALTHY, summary.error
    assert summary.output_match is True  # the reference replays the aborts, in one group
    assert summary.aborted > 0
    controls = [e["attrs"] for e in _events(tmp_path / "t.controller.jsonl", Ev.DP_CONTROL)]
    aborts = [c for c in controls if c["what"] == "abort"]
    assert aborts
    assert all(c["to"] == [0, 2] and c["kind"] == "control" for c in controls)
    assert [c["what"] for c in controls].count("end") == 1
    owner = {r["rid"]: r["group"] for r in _routes(trace)}
    applied = 0
    for g in (0, 1):
        entry = tmp_path / f"t.dp{g}.rank0.jsonl"
        peer = tmp_path / f"t.dp{g}.rank1.jsonl"
        got = [e["attrs"] for e in _events(entry, Ev.DP_RECEIVE) if e["attrs"]["what"] == "abort"]
        assert sorted(a["rid"] for a in got) == sorted(c["rid"] for c in aborts)
        for a in got:  # only the group that holds a request applies its abort (if unfinished)
            assert not a["held"] or owner[a["rid"]] == g
        held = {a["rid"] for a in got if a["held"]}
        assert not _events(peer, Ev.DP_RECEIVE)  # the controller never talks to a peer...
        planned = {rid for e in _events(peer, Ev.PLAN_ABORTS) for rid in e["attrs"]["rids"]}
        assert planned == held  # ...which gets the aborts from its entry rank's exchange
        applied += len(held)
    assert applied > 0


def test_an_external_routing_goes_straight_through(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    cfg = mr_config(**{"topology.dp": 2, "topology.dp_policy": "shortest-queue",
                       "workload.requests": 16, "observability.trace_path": trace})

    def router(req: Req) -> int | None:
        return 1 if req.rid.startswith("doc") else None

    res = launch_dp(cfg, bundle_root=tmp_path / "bundles", external_router=router)
    try:
        assert res.outcome is RunOutcome.HEALTHY, res.error
    finally:
        res.cleanup()
    routes = _routes(trace)
    pinned = [r for r in routes if r["rid"].startswith("doc")]
    assert pinned
    assert all((r["group"], r["reason"]) == (1, "routed") for r in pinned)
    assert all(r["reason"] == "shortest-queue" for r in routes if r not in pinned)
    got = {e["attrs"]["rid"]: e["attrs"]["reason"]
           for e in _events(tmp_path / "t.dp1.jsonl", Ev.DP_RECEIVE)
           if e["attrs"]["what"] == "request"}
    assert all(got[r["rid"]] == "routed" for r in pinned)


def test_a_failure_in_one_group_dumps_every_group_into_one_bundle(tmp_path: Path) -> None:
    """Every request goes to group 0, whose rank crashes at its first forward; group 1 runs no
    forward, so it fails only because the controller broadcast the dump request."""
    cfg = mr_config(**{"topology.dp": 2, "workload.requests": 8,
                       "faults": (parse_fault("crash:point=model.forward,count=1"),)})
    res = launch_dp(cfg, bundle_root=tmp_path / "bundles", external_router=lambda req: 0)
    try:
        assert res.outcome is RunOutcome.CRASH
        assert res.error is not None
        assert "DP0 TP0 PP0" in res.error
        assert res.bundle is not None
        bundle = res.bundle
    finally:
        res.cleanup()
    m = load_manifest(bundle)
    assert m.topology == {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}
    assert [(e.rank, e.dp_rank) for e in m.ranks] == [(0, 0), (1, 1)]
    assert m.ranks[0].error is not None
    assert "InjectedFault" in m.ranks[0].error
    assert m.ranks[1].files.state == "rank1/state.json"  # it dumped on the broadcast
    state = json.loads((bundle / "rank1" / "state.json").read_text())
    assert (state["rank"], state["dp_rank"]) == (1, 1)
    events = [json.loads(x) for x in (bundle / "rank0" / "events.jsonl").read_text().splitlines()]
    assert {(e["rank"], e["dp"]) for e in events} == {(0, 0)}
    dumps = [e["attrs"] for e in _events(bundle / "controller" / "events.jsonl", Ev.DP_CONTROL)
             if e["attrs"]["what"] == "dump"]
    assert dumps
    assert dumps[0]["kind"] == "global"
    assert dumps[0]["to"] == [0, 1]
    assert [f.rank for f in m.faults_fired] == [0]
    d = diagnose([str(bundle)])
    assert all(i.status == "read" for i in d.inputs), d.inputs
    assert d.first_divergence is None  # two groups' different requests are no divergence
    crashed = [row for row in d.ranks if row.state == "crashed"]
    assert [row.rank for row in crashed] == [0]
