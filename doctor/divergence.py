"""The first divergent decision: the earliest decision on which ranks that must agree differ.

Decisions come from the runtime's traces (see :data:`doctor.parse_trace.DECISIONS`). The k-th
decision of one kind about one subject (a vote site, a request id, or the step's batch) is
compared across every rank that recorded at least k of them; step counters differ between
pipeline stages, so the occurrence index aligns them, not the step. Of all mismatches the one
with the smallest step (then index) is the first divergence; later ones are usually its
consequences.
"""

from __future__ import annotations

from doctor.builder import Evidence
from doctor.evidence import Decision
from doctor.report import Divergence, EvidenceItem

#: Which fact a divergence of each kind supports (read by :mod:`doctor.facts`).
DRAIN_KINDS = ("l2.write.drain", "l2.load.drain")
PREFIX_KINDS = ("req.admit", "tree.match", "l3.prefetch.hit", "l3.prefetch.settle",
                "sched.batch")
EVICT_KINDS = ("tree.evict", "tree.evict_host")


def all_divergences(evidence: Evidence) -> list[Divergence]:
    """The first mismatch of every (kind, key), earliest first."""
    keys: set[tuple[str, str]] = set()
    for ev in evidence.ranks.values():
        keys |= set(ev.decisions)
    found: list[tuple[int, int, Divergence]] = []
    for kind, key in sorted(keys):
        per_rank = {ev.rank: ev.decisions[(kind, key)] for ev in evidence.ranks.values()
                    if (kind, key) in ev.decisions}
        if len(per_rank) < 2:
            continue
        d = _first_mismatch(kind, key, per_rank)
        if d is not None:
            found.append((min(d.steps.values()), d.index, d))
    return [d for _, _, d in sorted(found, key=lambda x: (x[0], x[1], x[2].kind))]


def _first_mismatch(kind: str, key: str, per_rank: dict[int, list[Decision]]
                    ) -> Divergence | None:
    depth = min(len(v) for v in per_rank.values())
    for i in range(depth):
        values = {r: seq[i].value for r, seq in per_rank.items()}
        if len(set(values.values())) > 1:
            return _divergence(kind, key, i, {r: seq[i] for r, seq in per_rank.items()})
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
