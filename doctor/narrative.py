"""Plain-words observations: what the doctor sees, whether or not a signature fits.

When nothing in the catalog fits, the report must still say what it does see — a hang with
every rank idle, a configuration error at start-up, a device-side fault, a frozen process —
instead of forcing the nearest signature.
"""

from __future__ import annotations

from doctor.builder import Evidence
from doctor.factset import FactSet
from doctor.report import BlockedSite, CollectiveFinding, Divergence, RankRow
from signatures.facts import Fact


def observations(ev: Evidence, facts: FactSet, rows: list[RankRow], sites: list[BlockedSite],
                 findings: list[CollectiveFinding], first: Divergence | None) -> list[str]:
    out = _outside_the_catalog(ev, facts)
    for r in [r for r in rows if r.state == "crashed"][:4]:
        out.append(f"Rank {r.rank} ({r.role}) crashed: {r.error}"
                   + (f" at {r.frame}" if r.frame else "") + ".")
    for e in list(ev.unranked.exceptions)[-2:]:
        out.append(f"An exception from an unknown rank: {e.short_type}: {e.message}"[:300]
                   + f" ({e.source}).")
    if sites:
        parts = [f"ranks {s.ranks} ({s.role}) in {s.op} from {s.site}" for s in sites]
        out.append("Blocked in collectives: " + "; ".join(parts) + ".")
    for f in findings[:3]:
        out.append(f"Collectives, group {f.group}: {f.kind}: {f.detail}.")
    if first is not None:
        vals = ", ".join(f"rank {r}: {v}" for r, v in sorted(first.values.items()))
        out.append(f"First divergent decision: {first.label} (occurrence "
                   f"#{first.index}, steps {first.steps}): {vals}.")
    if Fact.OOM_KILLED in facts:
        out.append("A rank was killed by SIGKILL (exit -9), usually the kernel OOM killer.")
    if not out and not ev.ranks and not ev.unranked.exceptions and not ev.unranked.hits:
        out.append("The inputs hold no failure evidence the doctor recognises.")
    return out


def _outside_the_catalog(ev: Evidence, facts: FactSet) -> list[str]:
    """What explains a failure that no signature covers."""
    out: list[str] = []
    if Fact.ALL_RANKS_IDLE in facts:
        out.append("A hang with every rank idle: no rank is inside a collective or busy, every "
                   "thread waits for work. The stall is outside the ranks (front-end, client, "
                   "a queue nobody feeds) or the dumps were taken after it cleared.")
    if Fact.DEVICE_FAULT in facts:
        out.append("A device-side fault: " + facts[Fact.DEVICE_FAULT][0].text.rstrip(".")
                   + ". This is a GPU/driver problem (check dmesg for Xid, nvidia-smi), not a "
                   "cache protocol bug.")
    if Fact.STARTUP_CONFIG_ERROR in facts:
        out.append("A configuration error at start-up: "
                   + facts[Fact.STARTUP_CONFIG_ERROR][0].text.rstrip(".")
                   + ". The job never served; fix the arguments and restart.")
    if _frozen(ev):
        out.append("No collective was ever in flight (last enqueued NCCL work -1 on every rank): "
                   "a frozen process (stalled filesystem, compile skew), not a communication hang.")
    return out


def _frozen(ev: Evidence) -> bool:
    values = []
    for r in ev.ranks.values():
        stats = r.hits.get("nccl-last-enqueued")
        if stats:
            values += [h.groups.get("enqueued") for h in stats.kept]
    return bool(values) and all(v == "-1" for v in values)
