"""Deferred chunked abort across ranks: an abort that arrives on rank 0 between two chunks of a
prefill rides the next step's plan, and every rank tears the request down at the same step,
whichever chunk boundary it came at; ``abort-chunked-on-the-spot`` tears it down on rank 0
alone, and the ranks' batches part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

#: 384 document tokens and a 12-token question at 64 tokens a chunk: seven chunks, six
#: boundaries. Document ``k``'s questions are aborted at boundary ``k``, so one run covers
#: every boundary (and, under PP, both micro-batch slots).
CHUNK = 64
EVERY_BOUNDARY = tuple(f"chunked-abort:rid=doc{k}-*,chunk={k}" for k in range(6))


def _config(tmp_path: Path, faults: tuple[str, ...], **overrides: object) -> Any:
    return mr_config(**{
        "workload.kind": "long_context", "workload.requests": 16,
        "cache.device_tokens": 1024, "scheduler.chunked_prefill_size": CHUNK,
        "faults": tuple(parse_fault(f) for f in faults),
        "observability.trace_path": tmp_path / "run.jsonl", **overrides})


def _events(tmp_path: Path, rank: int) -> list[dict[str, Any]]:
    text = (tmp_path / f"run.rank{rank}.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


@pytest.mark.parametrize("topology", [{"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}],
                         ids=["tp2", "pp2", "tp2pp2"])
def test_every_chunk_boundary_aborts_alike_on_every_rank(
        tmp_path: Path, bundle_root: Path, topology: dict[str, int]) -> None:
    cfg = _config(tmp_path, EVERY_BOUNDARY,
                  **{f"topology.{k}": v for k, v in topology.items()})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True, s.mismatches
    assert s.leaks is not None
    assert s.leaks.complete
    assert s.leaks.leaked_pages == 0, s.leaks.describe()

    ranks = [_events(tmp_path, r) for r in range(cfg.topology.world_size)]
    fired = {e["attrs"]["rid"]: e for e in ranks[0] if e["kind"] == Ev.FAULT}
    assert {rid.split("-")[0] for rid in fired} == {f"doc{k}" for k in range(6)}
    applied = [{e["attrs"]["rid"]: (e["step"], e["attrs"]["where"]) for e in events
                if e["kind"] == Ev.ABORT_APPLIED} for events in ranks]
    assert all(a == applied[0] for a in applied), "every rank aborts at the same step"
    for rid, fault in fired.items():
        # after the chunk the fault followed: from the next step's plan on, a chunk that was
        # already in the pipeline (PP) is finished when its result comes back
        step, where = applied[0][rid]
        assert step > fault["step"]
        # under PP the request's last chunk may be in the pipeline when the plan comes: it
        # is finished when that chunk returns, a running request by then
        assert where == "chunked" or cfg.topology.pp > 1
        plans = [e["step"] for e in ranks[-1] if e["kind"] == Ev.PLAN_ABORTS
                 and rid in e["attrs"]["rids"]]
        assert plans == [fault["step"] + 1], "the last stage got it in the same plan"
    for events in ranks:
        assert not [e for e in events if e["kind"] == Ev.ABORT_APPLIED
                    and e["attrs"]["on_the_spot"]]


def test_on_the_spot_under_pp_breaks_the_next_stage(tmp_path: Path,
                                                    bundle_root: Path) -> None:
    """PP0 drops the request after its first chunk, in the middle of its step, and tells no
    one; PP1 keeps it (its chunk, its pages). From there the stages form different batches
    (PP0's budget has the request's pages back, PP1's does not), and PP1 cannot view the
    hidden states PP0 sent for its own batch."""
    cfg = _config(tmp_path, ("chunked-abort:chunk=0",), **{
        "topology.pp": 2, "workload.kind": "mixed", "workload.requests": 48,
        "cache.device_tokens": 512, "scheduler.chunked_prefill_size": 256,
        "legacy": frozenset({LegacySwitch.ABORT_CHUNKED_ON_THE_SPOT})})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH, s.error
    assert "rank 1 (TP0 PP1)" in (s.error or "")
    assert "is invalid for input of size" in (s.error or "")
    pp0, pp1 = _events(tmp_path, 0), _events(tmp_path, 1)
    spot = [e for e in pp0 if e["kind"] == Ev.ABORT_APPLIED and e["attrs"]["on_the_spot"]]
    assert spot, "PP0 tore the request down where the abort arrived"
    rid, at = spot[0]["attrs"]["rid"], spot[0]["step"]
    assert not [e for e in pp1 if e["kind"] == Ev.ABORT_APPLIED and e["attrs"]["rid"] == rid]
    assert not [e for e in pp0 + pp1 if e["kind"] == Ev.PLAN_ABORTS
                and rid in e["attrs"]["rids"]], "no plan carried it"
    batches = [{e["step"]: e["attrs"]["rids"] for e in events if e["kind"] == Ev.BATCH}
               for events in (pp0, pp1)]
    assert all(batches[0].get(st) == rids for st, rids in batches[1].items() if st < at)
    # From the abort on the stages part: PP1 forms a batch PP0 did not, or dies on the first
    # hidden states of PP0's new batch before it records its own (its last event is then of
    # the step before).
    parted = [st for st, rids in batches[1].items() if st >= at and batches[0].get(st) != rids]
    assert parted or max(e["step"] for e in pp1) >= at - 1
    # The stages disagree on the batch: the doctor names that, not the evictions that differ
    # after the one-sided abort gave PP0 the request's pages back.
    from doctor.diagnose import diagnose

    assert diagnose([Path(s.bundle or "")]).verdicts[0].signature == "prefix-length-mismatch"
