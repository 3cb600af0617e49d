"""Plain-words observations: what the doctor sees, whether or not a signature fits.

When nothing in the catalog fits, the report must still say what it does see — a hang with
every rank idle, a configuration error at start-up, a device-side fault, a frozen process —
instead of forcing the nearest signature.
"""

from __future__ import annotations

from doctor.facts.factset import FactSet
from doctor.ranks.builder import Evidence
from doctor.report.model import BlockedSite, CollectiveFinding, Divergence, RankRow
from signatures.facts import Fact


def observations(ev: Evidence, facts: FactSet, rows: list[RankRow], sites: list[BlockedSite],
                 findings: list[CollectiveFinding], first: Divergence | None) -> list[str]:
    out = _outcome(ev, first) + _outside_the_catalog(ev, facts)
    for r in [r for r in rows if r.state == "crashed"][:4]:
        out.append(f"Rank {r.rank} ({r.role}) crashed: {r.error}"
                   + (f" at {r.frame}" if r.frame else "") + ".")
    if Fact.PEER_EXITED_FIRST in facts:
        out.append("The other ranks' timeouts, lost connections and blocked collectives follow "
                   "from that failure: " + facts[Fact.PEER_EXITED_FIRST][0].text + ".")
    for e in list(ev.unranked.exceptions)[-2:]:
        out.append(f"An exception from an unknown rank: {e.text}"[:300]
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


def _outcome(ev: Evidence, first: Divergence | None) -> list[str]:
    """What the run's own record says happened: a wrong output, or no failure at all."""
    if ev.outcome == "healthy" and not ev.mismatches:
        return ["The bundle records a healthy run: every rank finished and the outputs matched "
                "the cache-disabled reference. There is nothing to diagnose."]
    if ev.outcome != "wrong-output" and not ev.mismatches:
        return []
    text = (f"Wrong output: the run finished, but {ev.mismatches} request(s) differ from the "
            "cache-disabled reference")
    if ev.mismatch_examples:
        text += " (" + "; ".join(_mismatch(m) for m in ev.mismatch_examples[:2]) + ")"
    out = [text + "."]
    traced = [r for r in ev.ranks.values() if "trace" in r.kinds]
    if first is None and len(traced) >= 2:
        out.append("No decision differs between the ranks' traces: the ranks agreed with each "
                   "other, so the wrong tokens come from something every rank did alike (a "
                   "corrupted copy or page, stale KV reused, a numeric difference), not from a "
                   "cross-rank divergence.")
    return out


def _mismatch(m: dict[str, object]) -> str:
    if m.get("note"):
        return str(m["note"])
    return (f"{m.get('rid', '?')} from token {m.get('index', '?')}: expected "
            f"{m.get('expected', '?')}, got {m.get('got', '?')}")


def _injected(ev: Evidence) -> list[str]:
    """Exceptions the fault injector raised on purpose (``--fault crash:...``)."""
    out: list[str] = []
    for r in ev.all_ranks():
        for e in r.exceptions:
            if e.short_type == "InjectedFault":
                who = f"Rank {r.rank}" if r.rank >= 0 else "A rank"
                faults = f" (the run's --fault {', '.join(ev.faults)})" if ev.faults else ""
                out.append(f"{who} raised an injected fault, {e.text}"
                           f"{faults}: the test harness made it fail on purpose. This is not a "
                           "cache protocol bug; whatever the other ranks show follows from it.")
                return out
    return out


def _outside_the_catalog(ev: Evidence, facts: FactSet) -> list[str]:
    """What explains a failure that no signature covers."""
    out: list[str] = _injected(ev)
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
