"""A rank's :class:`~hicache_runtime.contracts.rank_result.RankResult`, taken from its runtime.

The one place a rank's counters are assembled (:func:`rank_stats`) and its end of run is
described: a rank process writes it to its run directory, a single-rank run builds it in
process; ``run.py`` summarises both the same way.
"""

from __future__ import annotations

from typing import Any

from hicache_runtime.contracts.bundle import FiredFaultRecord, RunOutcome
from hicache_runtime.contracts.rank_result import RankResult, RequestResult
from hicache_runtime.engine.rank import RankRuntime
from hicache_runtime.kv.request import Req


def rank_stats(rt: RankRuntime) -> dict[str, Any]:
    """A rank's raw cache counters (what ``RankCacheStats`` reads)."""
    stats = rt.cache.counters()
    l3 = rt.cache.parts().l3
    if l3 is not None:
        stats["l3"] = {**l3.stats, "backend": l3.workers.backend.stats().as_dict()}
    return stats


def rank_result(rt: RankRuntime, outcome: RunOutcome, error: str | None,
                reqs: dict[str, Req], steps: int, wall_s: float | None,
                drain: dict[str, int] | None) -> RankResult:
    """``rt``'s end of run. ``reqs``: the requests as the loop left them (none when it did not
    finish); ``drain``: the page accounting, when the rank got through its drain (or failed
    the drain's own check), so what it still held is what the run left behind."""
    fired = [FiredFaultRecord(**f.as_dict()) for f in rt.faults.fired] if rt.faults else []
    return RankResult(
        rank=rt.rank.rank, tp_rank=rt.rank.tp_rank, pp_rank=rt.rank.pp_rank,
        outcome=outcome, error=error, steps=steps, wall_s=wall_s,
        requests={rid: RequestResult(input_ids=r.input_ids, output_ids=r.output_ids,
                                     status=r.status.value, abort_reason=r.abort_reason,
                                     cached=r.cached) for rid, r in reqs.items()},
        stats=rank_stats(rt), faults_fired=fired, drain=drain)
