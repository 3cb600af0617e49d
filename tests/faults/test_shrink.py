"""The shrink search itself, against a known failure boundary (the real runs are in
test_campaign_run.py and tests/multirank/test_campaigns.py)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from faults.campaign.cells import DiagnosedRun
from faults.campaign.replay import ReplayCase, TrialRecord
from faults.campaign.shrink import reproduction, shrink
from faults.spec import parse_faults
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import FiredFaultRecord


def _case(requests: int, faults: list[str]) -> ReplayCase:
    cfg = load_config({"topology.tp": 2, "workload.requests": requests,
                       "faults": parse_faults(faults)})
    return ReplayCase(cfg=cfg, warm=False, signature="collective-order-deadlock",
                      outcome="hang", source="b")


def _judge(min_requests: int, needed: str):
    """A failure that needs at least ``min_requests`` and the fault kind ``needed``; faults
    fire on rank 1 at steps 5 and 9 (twice per run)."""
    runs: list[RuntimeConfig] = []

    def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
        runs.append(cfg)
        shows = cfg.workload.requests >= min_requests and any(
            f.kind == needed for f in cfg.faults)
        fired = [FiredFaultRecord(spec=f.compact(), kind=f.kind, point="p", rank=1,
                                  step=step, thread="t")
                 for f in cfg.faults for step in (5, 9)][: 2 * len(cfg.faults)]
        obs = DiagnosedRun(outcome="hang" if shows else "healthy",
                           output_match=None if shows else True, bundle="x" if shows else None,
                           error=None, faults_fired=len(fired), fired=fired,
                           signature="collective-order-deadlock" if shows else None)
        record = TrialRecord(change=change, requests=cfg.workload.requests,
                             faults=[f.compact() for f in cfg.faults], reproduced=shows,
                             observed=obs.observed, outcome=obs.outcome, wall_s=0.0,
                             bundle=obs.bundle, faults_fired=len(fired))
        return record, obs

    return trial, runs


@given(requests=st.integers(2, 200), boundary=st.integers(1, 200),
       budget=st.integers(1, 40))
def test_shrink_keeps_only_reproducing_cases_and_respects_the_budget(
        requests: int, boundary: int, budget: int) -> None:
    boundary = min(boundary, requests)
    case = _case(requests, ["host-alloc-fail:tp=1", "stage-lag:ms=5"])
    trial, runs = _judge(boundary, "host-alloc-fail")
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=budget)
    assert result.runs == len(runs) == len(result.trials)
    assert sum(not t.confirm for t in result.trials) <= max(budget, 1)
    # the final case is rerun on top of the budget; this failure is deterministic
    assert (result.confirm_runs, result.confirmed, result.flaky) == (3, 3, False)
    assert result.shrunk.requests >= boundary
    # what it reports reproduces: re-judge the final case
    final = _case(result.shrunk.requests, result.shrunk.faults)
    assert trial(final.cfg, "check")[0].reproduced
    if not result.budget_exhausted:
        assert result.shrunk.requests == boundary
        assert result.shrunk.faults == ["host-alloc-fail:tp=1,steps=5-9,count=1"]


def test_shrink_of_a_non_reproducing_replay_does_nothing() -> None:
    case = _case(10, ["host-alloc-fail:tp=1"])
    trial, _runs = _judge(50, "host-alloc-fail")
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=10)
    assert not result.reproduced
    assert result.runs == 1
    assert result.final_bundle is None
    assert result.shrunk == result.original


def test_pins_count_rank_and_steps() -> None:
    case = _case(8, ["stage-lag:ms=5"])
    trial, _ = _judge(1, "stage-lag")
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=40)
    assert result.shrunk.requests == 1
    # count=1 first; rank=1 (fired on one rank only); steps pinned to where it fired
    assert result.shrunk.faults == ["stage-lag:rank=1,steps=5-9,count=1,ms=5"]


def _result(cfg: RuntimeConfig, change: str, shows: bool) -> tuple[TrialRecord, DiagnosedRun]:
    """What a run of ``cfg`` reports when it did (``shows``) or did not fail the same way."""
    fired = [FiredFaultRecord(spec=f.compact(), kind=f.kind, point="p", rank=1, step=5,
                              thread="t") for f in cfg.faults]
    obs = DiagnosedRun(outcome="hang" if shows else "healthy",
                       output_match=None if shows else True, bundle=change if shows else None,
                       error=None, faults_fired=len(fired), fired=fired,
                       signature="collective-order-deadlock" if shows else None)
    return TrialRecord(change=change, requests=cfg.workload.requests,
                       faults=[f.compact() for f in cfg.faults], reproduced=shows,
                       observed=obs.observed, outcome=obs.outcome, wall_s=0.0,
                       bundle=obs.bundle, faults_fired=len(fired)), obs


def test_a_step_that_fails_only_once_in_two_runs_is_not_kept() -> None:
    # Fails every time from 40 requests; from 10 to 39 only on a count's first run (a
    # timing-dependent failure). Keeping a step on one failing run would end below 40.
    seen: Counter[int] = Counter()

    def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
        n = cfg.workload.requests
        seen[n] += 1
        return _result(cfg, change, n >= 40 or (n >= 10 and seen[n] == 1))

    case = _case(100, ["stage-lag:ms=5"])
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=60)
    assert result.shrunk.requests == 40
    once = [t for t in result.trials if 10 <= t.requests < 40 and t.reproduced]
    assert once, "the search never met a flaky candidate"
    assert not any(t.kept for t in once)
    kept = [t for t in result.trials if t.kept]
    assert all(t.reproduced for t in kept)
    assert (result.confirmed, result.confirm_runs, result.flaky) == (3, 3, False)
    assert result.final_bundle == kept[-1].bundle


def test_a_final_case_that_does_not_always_reproduce_is_reported_flaky() -> None:
    def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
        return _result(cfg, change, change != "confirm 2/4")

    case = _case(8, ["stage-lag:ms=5"])
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=4, confirm=4)
    assert result.budget_exhausted
    assert (result.confirmed, result.confirm_runs, result.flaky) == (3, 4, True)
    assert [t.change for t in result.trials if t.confirm] == [f"confirm {i}/4"
                                                               for i in range(1, 5)]
    assert reproduction(result) == "reproduced 3/4 confirmation runs"
    assert result.runs == 4 + 4


def test_no_confirmation_when_the_replay_did_not_reproduce() -> None:
    def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
        return _result(cfg, change, False)

    case = _case(8, ["stage-lag:ms=5"])
    first, obs = trial(case.cfg, "replay")
    result = shrink(case, first, obs, trial=trial, max_runs=4, confirm=3)
    assert (result.runs, result.confirm_runs, result.flaky) == (1, 0, False)
