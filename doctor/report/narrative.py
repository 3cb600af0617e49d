"""Plain-words observations: what the doctor sees, whether or not a signature fits.

When nothing in the catalog fits, the report must still say what it does see — a hang with
every rank idle, a configuration error at start-up, a device-side fault, a frozen process —
instead of forcing the nearest signature.
"""

from __future__ import annotations

from doctor.facts.factset import FactSet
from doctor.facts.injected import INJECTED_EXCEPTION, injected_failures
from doctor.model.builder import Evidence
from doctor.model.evidence import InputStatus
from doctor.model.findings import BlockedSite, CollectiveFinding, Divergence, RankCondition, RankRow
from hicache_runtime.contracts.bundle import RunOutcome
from signatures.fact_names import Fact


def observations(ev: Evidence, facts: FactSet, rows: list[RankRow], sites: list[BlockedSite],
                 findings: list[CollectiveFinding], first: Divergence | None) -> list[str]:
    out = _outcome(ev, first) + _outside_the_catalog(ev, facts)
    for r in [r for r in rows if r.state == RankCondition.CRASHED][:4]:
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
    out += _timeouts(ev, facts)
    if not out:
        out += _unranked_stacks(ev) or _error_lines(ev)
    if not out and not ev.ranks and not ev.unranked.exceptions and not ev.unranked.hits \
            and any(i.status == InputStatus.READ for i in ev.inputs):
        out.append("The inputs hold no failure evidence the doctor recognises.")
    return out


def _timeouts(ev: Evidence, facts: FactSet) -> list[str]:
    """Watchdogs and collective timeouts, said plainly: where each reporting rank waited."""
    out: list[str] = []
    waits = []
    for r in ev.all_ranks():
        for h in list(r.hits.get("nccl-watchdog-timeout", _NONE).kept)[:1]:
            who = f"rank {r.rank}" if r.rank >= 0 else "a rank"
            waits.append(f"{who} in SeqNum {h.groups.get('seq')} ({h.groups.get('op')})")
    if waits:
        same = Fact.SAME_COLLECTIVE_EVERYWHERE in facts
        out.append("NCCL collective timeouts: " + "; ".join(waits[:6])
                   + (" — every reporting rank waits in the same collective, so none took "
                      "another path: look for a rank that is slow or gone (still loading, "
                      "dead node, network)." if same else "."))
    for r in ev.all_ranks():
        for h in list(r.hits.get("scheduler-watchdog", _NONE).kept)[:1]:
            out.append(f"The scheduler watchdog fired ({h.text[:120]}): a step made no progress "
                       "for the whole timeout; the stacks of every rank at that moment tell "
                       "where it stood.")
            return out
    return out


def _unranked_stacks(ev: Evidence) -> list[str]:
    """Stacks of unknown rank (a pasted py-spy or faulthandler dump): where the busy threads
    are. An idle storage thread only says that HiCache was on."""
    busy = [t for t in ev.unranked.threads if t.idle is not True and t.frames]
    parts = []
    for t in busy[:3]:
        app = [f for f in t.frames if f.line is not None] or t.frames
        parts.append(f"{t.name or 'a thread'} in {app[0].func} ({app[0].file.rsplit('/', 1)[-1]}"
                     + (f":{app[0].line}" if app[0].line else "") + ")")
    return ["Stacks without a rank: " + "; ".join(parts) + ". None of them is inside a "
            "collective that another stack contradicts."] if parts else []


def _error_lines(ev: Evidence) -> list[str]:
    """When nothing else is recognised: the first lines the loggers marked as errors."""
    lines = [(text, src) for r in ev.all_ranks() for text, src in list(r.errors)[:2]]
    return ["Error lines in the inputs: " + " | ".join(f"{t[:160]} ({s})" for t, s in lines[:2])
            ] if lines else []


class _None:
    kept: tuple[()] = ()


_NONE = _None()


def _outcome(ev: Evidence, first: Divergence | None) -> list[str]:
    """What the run's own record says happened: a wrong output, or no failure at all."""
    if ev.outcome == RunOutcome.HEALTHY and not ev.mismatches:
        return ["The bundle records a healthy run: every rank finished and the outputs matched "
                "the cache-disabled reference. There is nothing to diagnose."]
    if ev.outcome != RunOutcome.WRONG_OUTPUT and not ev.mismatches:
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
    """Failures the fault injector caused on purpose (``--fault crash|hang|rank-kill:...``)."""
    fired = injected_failures(ev)
    if fired:
        what = "; ".join(f.describe() for f in fired[:3])
    else:
        what = next((f"rank {r.rank} raised an injected fault, {e.text}" if r.rank >= 0
                     else f"a rank raised an injected fault, {e.text}"
                     for r in ev.all_ranks() for e in r.exceptions
                     if e.short_type == INJECTED_EXCEPTION), "")
    if not what:
        return []
    faults = f" (the run's --fault {', '.join(ev.faults)})" if ev.faults else ""
    return [f"{what[0].upper()}{what[1:]}{faults}: the test harness made it fail on purpose. "
            "This is not a cache protocol bug; whatever the other ranks show follows from it."]


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
