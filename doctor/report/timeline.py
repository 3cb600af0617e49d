"""The incident page's timeline: each rank's traced run on one clock.

From every rank's timed trace events (``RankEvidence.timeline``) it builds one lane per rank:
the collectives it was in (entry to exit; one never exited is where it was stuck), the window
each fault acted in and its firings, step starts, transfers, aborts, storage errors and checks,
where its evidence ends and in what state, and when it took the first divergent decision. The
clock is the runtime's monotonic one, which the ranks of one machine share; times are ms since
the earliest event of any rank. Sizes are bounded: a long run keeps its open and longest
collectives and its last ones, evenly thinned step marks, and at most ``MAX_MARKS`` marks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from doctor.model.builder import Evidence
from doctor.model.evidence import TimedEvent
from doctor.model.findings import Divergence, RankRow
from doctor.report.model import Timeline, TimelineLane, TimelineMark, TimelineSpan
from hicache_runtime.contracts.events import Ev

MAX_SPANS = 240
MAX_MARKS = 240
MAX_STEP_MARKS = 40
LONGEST_KEPT = 60
"""Of a lane's closed collectives, the longest this many are kept (then the last ones)."""

Clock = Callable[[int], float]
"""A trace time (ns) as ms since the timeline's origin."""

_MARK_KIND = {
    Ev.FAULT: "fault", Ev.REQ_ABORT: "abort", Ev.BACKUP_SUBMIT: "transfer",
    Ev.BACKUP_ACK: "transfer", Ev.PREFETCH_SUBMIT: "transfer", Ev.PREFETCH_SETTLE: "transfer",
    Ev.STORAGE: "storage",
    Ev.INTEGRITY: "check", Ev.CONSENSUS: "check", Ev.WORKER_DIED: "abort",
    Ev.PP_SEND: "transfer", Ev.PP_RECV: "transfer",
}


def build_timeline(ev: Evidence, rows: list[RankRow],
                   first: Divergence | None) -> Timeline | None:
    """The timeline of the ranks that left timed trace events; None when none did."""
    traced = {r.rank: list(r.timeline) for r in ev.ranks.values() if len(r.timeline)}
    if not traced:
        return None
    t0 = min(e.t_ns for events in traced.values() for e in events)

    def ms(t_ns: int) -> float:
        return round((t_ns - t0) / 1e6, 3)

    by_rank = {row.rank: row for row in rows}
    lanes = []
    for rank, events in sorted(traced.items()):
        events.sort(key=lambda e: e.t_ns)
        row = by_rank.get(rank)
        lane = TimelineLane(rank=rank, role=row.role if row else "",
                            state=str(row.state) if row else "", end_ms=ms(events[-1].t_ns))
        lane.spans = _collectives(events, ms) + _fault_windows(events, ms, lane.end_ms)
        lane.marks = _marks(events, ms)
        if first is not None and rank in first.steps:
            lane.divergence_ms = _at_step(events, first.steps[rank], ms)
        lanes.append(lane)
    return Timeline(end_ms=max(lane.end_ms for lane in lanes) or 1.0, lanes=lanes,
                    divergence=first.label if first is not None else "")


def _collectives(events: list[TimedEvent], ms: Clock) -> list[TimelineSpan]:
    open_: dict[str, TimedEvent] = {}
    closed: list[TimelineSpan] = []
    for e in events:
        if e.kind == Ev.COLLECTIVE_ENTER:
            open_[e.key] = e
        elif e.kind == Ev.COLLECTIVE_EXIT and e.key in open_:
            start = open_.pop(e.key)
            state = e.label.rsplit(" ", 1)[-1]
            closed.append(TimelineSpan(
                kind="collective", start_ms=ms(start.t_ns), end_ms=ms(e.t_ns), state=state,
                label=start.label + ("" if state == "completed" else f" ({state})")))
    stuck = [TimelineSpan(kind="collective", start_ms=ms(e.t_ns), end_ms=None,
                          label=e.label + " (never exited)") for e in open_.values()]
    room = max(0, MAX_SPANS - len(stuck))
    by_length = sorted(closed, key=lambda s: (s.end_ms or 0) - s.start_ms, reverse=True)
    keep = {id(s) for s in by_length[:min(LONGEST_KEPT, room)]}
    latest = room - len(keep)
    keep |= {id(s) for s in closed[-latest:]} if latest > 0 else set()
    return [s for s in closed if id(s) in keep] + stuck[:MAX_SPANS]


def _fault_windows(events: list[TimedEvent], ms: Clock,
                   lane_end: float) -> list[TimelineSpan]:
    """Per fault spec: from its first firing to the end of the step of its last one."""
    fired: dict[str, list[TimedEvent]] = defaultdict(list)
    for e in events:
        if e.kind == Ev.FAULT:
            fired[e.label].append(e)
    out = []
    for spec, hits in fired.items():
        last = hits[-1]
        nxt = next((e.t_ns for e in events if e.kind == Ev.BATCH and e.t_ns > last.t_ns
                    and e.step > last.step), None)
        out.append(TimelineSpan(kind="fault-window", start_ms=ms(hits[0].t_ns),
                                end_ms=ms(nxt) if nxt is not None else lane_end,
                                label=f"{spec}: {len(hits)} firing(s), steps "
                                      f"{hits[0].step}-{last.step}"))
    return out


def _marks(events: list[TimedEvent], ms: Clock) -> list[TimelineMark]:
    steps = [e for e in events if e.kind == Ev.BATCH]
    every = max(1, -(-len(steps) // MAX_STEP_MARKS))
    out = [TimelineMark(kind="step", at_ms=ms(e.t_ns), label=e.label)
           for e in steps[::every]]
    others = [TimelineMark(kind=_MARK_KIND[e.kind], at_ms=ms(e.t_ns), label=e.label)
              for e in events if e.kind in _MARK_KIND]
    # faults and failures first, transfers fill what room is left (the latest ones)
    vital = [m for m in others if m.kind != "transfer"]
    transfers = [m for m in others if m.kind == "transfer"]
    room = max(0, MAX_MARKS - len(out) - len(vital))
    return out + vital[-(MAX_MARKS - len(out)):] + (transfers[-room:] if room else [])


def _at_step(events: list[TimedEvent], step: int, ms: Clock) -> float | None:
    at = next((e.t_ns for e in events if e.kind == Ev.BATCH and e.step == step), None)
    if at is None:
        at = next((e.t_ns for e in events if e.step >= step), None)
    return ms(at) if at is not None else None
