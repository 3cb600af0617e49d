"""The first divergent decision: the earliest decision on which ranks that must agree differ.

Decisions come from the runtime's traces (see :data:`doctor.read.trace.DECISIONS`). The k-th
decision of one kind about one subject (a vote site, a request id, or the step's batch) is
compared across every rank that recorded at least k of them; step counters differ between
pipeline stages, so the occurrence index aligns them, not the step. Of all mismatches the one
that happened first is the first divergence; later ones are usually its consequences. "First"
is the smallest step at which a rank made its side of the mismatch; within one step, the order
in which that rank recorded the two decisions (its trace is in emission order) decides.
"""

from __future__ import annotations

import functools

from doctor.model.builder import Evidence
from doctor.model.evidence import Decision
from doctor.model.findings import Divergence, EvidenceItem
from doctor.read.trace import REQUEST_KEYED
from hicache_runtime.contracts.events import Ev

#: Which fact a divergence of each kind supports (read by :mod:`doctor.facts.derive`).
DRAIN_KINDS = (Ev.WRITE_DRAIN, Ev.LOAD_DRAIN)
PREFIX_KINDS = (Ev.REQ_ADMIT, Ev.MATCH, Ev.PREFETCH_HIT, Ev.PREFETCH_SETTLE, Ev.BATCH,
                Ev.PREFETCH_PARTIAL)
EVICT_KINDS = (Ev.EVICT, Ev.EVICT_HOST)


def all_divergences(evidence: Evidence) -> list[Divergence]:
    """The first mismatch of every (kind, key), earliest first."""
    keys: set[tuple[str, str]] = set()
    for ev in evidence.ranks.values():
        keys |= set(ev.decisions)
    found: list[_Found] = []
    for kind, key in sorted(keys):
        for per_rank in _by_dp_group(evidence, _comparable(evidence, kind, key)):
            if len(per_rank) < 2:
                continue
            hit = _first_mismatch(kind, key, per_rank)
            if hit is not None:
                found.append(hit)
    return [f[0] for f in sorted(found, key=functools.cmp_to_key(_earlier))]


def _by_dp_group(evidence: Evidence, per_rank: dict[int, list[Decision]]
                 ) -> list[dict[int, list[Decision]]]:
    """Ranks that must agree are those of one DP group: each group runs its own requests."""
    groups: dict[int | None, dict[int, list[Decision]]] = {}
    for r, seq in per_rank.items():
        groups.setdefault(evidence.ranks[r].dp, {})[r] = seq
    return list(groups.values())


def _comparable(evidence: Evidence, kind: str, key: str) -> dict[int, list[Decision]]:
    """Each rank's decisions of (kind, key) that can be lined up by occurrence.

    Event rings that lost the run's start (the first traced step is above 1) at different
    steps lost a different number of decisions on each rank. A request's decisions still line
    up on the ranks whose trace holds its arrival; other decisions are cut to the steps every
    rank still holds in full (from the step after the latest start: the first step may be
    partial)."""
    per_rank = {ev.rank: ev.decisions[(kind, key)] for ev in evidence.ranks.values()
                if (kind, key) in ev.decisions}
    starts = {r: evidence.ranks[r].trace_start or 0 for r in per_rank}
    # complete traces, or windows that start at the same step (a trace started mid-run on
    # every rank) line up as they are
    if all(s <= 1 for s in starts.values()) or len(set(starts.values())) == 1:
        return per_rank
    if kind in REQUEST_KEYED:
        return {r: seq for r, seq in per_rank.items()
                if starts[r] <= 1 or key in evidence.ranks[r].arrived}
    common = max(starts.values()) + 1
    return {r: [d for d in seq if d.step >= common] for r, seq in per_rank.items()}


_Found = tuple[Divergence, dict[int, Decision]]
"""A divergence and, per rank, the decision it compared."""


def _earlier(a: _Found, b: _Found) -> int:
    """Order two divergences in time (see the module docstring); ties keep occurrence order."""
    sa, sb = min(d.step for d in a[1].values()), min(d.step for d in b[1].values())
    if sa != sb:
        return -1 if sa < sb else 1
    first_a = {r for r, d in a[1].items() if d.step == sa}
    first_b = {r for r, d in b[1].items() if d.step == sb}
    for r in sorted(first_a & first_b):
        da, db = a[1][r], b[1][r]
        if da.source.file == db.source.file and da.source.line and db.source.line \
                and da.source.line != db.source.line:
            return -1 if da.source.line < db.source.line else 1
    ka, kb = (a[0].index, a[0].kind, a[0].key), (b[0].index, b[0].kind, b[0].key)
    return (ka > kb) - (ka < kb)


def _first_mismatch(kind: str, key: str, per_rank: dict[int, list[Decision]]) -> _Found | None:
    if any(not v for v in per_rank.values()):
        return None
    depth = min(len(v) for v in per_rank.values())
    for i in range(depth):
        values = {r: seq[i].value for r, seq in per_rank.items()}
        if len(set(values.values())) > 1:
            at = {r: seq[i] for r, seq in per_rank.items()}
            return _divergence(kind, key, i, at), at
    return None


def _divergence(kind: str, key: str, index: int, at: dict[int, Decision]) -> Divergence:
    counts: dict[str, int] = {}
    for d in at.values():
        counts[d.value] = counts.get(d.value, 0) + 1
    majority = max(counts, key=lambda v: (counts[v], v))
    odd = sorted(r for r, d in at.items() if d.value != majority)
    return Divergence(
        kind=kind, key=key, index=index, steps={r: d.step for r, d in at.items()},
        values={r: d.value for r, d in at.items()},
        ranks=odd if len(odd) < len(at) else sorted(at),
        evidence=[EvidenceItem(text=f"rank {r} step {d.step}: {kind} {key + ' ' if key else ''}"
                                    f"{d.value}",
                               file=d.source.file, line=d.source.line, rank=r)
                  for r, d in sorted(at.items())][:6])
