"""Per-rank state from stacks and exceptions: the rank table and the blocked call sites.

For each rank the doctor picks the thread that matters: the thread that crashed (fatal signal),
else the failing exception (an in-app exception beats the communication errors it causes on
peers), else a thread blocked inside a collective (the scheduler's first), else the main thread.
Blocked threads are grouped by role (scheduler vs prefetch/storage threads) and call site:
two call sites within one role is the shape of a collective-order deadlock.
"""

from __future__ import annotations

import re
from collections import defaultdict

from doctor.builder import Evidence
from doctor.evidence import ExceptionRecord, Frame, RankEvidence, ThreadStack
from doctor.frames import FrameClassifier
from doctor.report import BlockedSite, EvidenceItem, RankRow

_COMM_ERROR = re.compile(r"Timed out waiting|Connection (closed|reset) by peer|NCCL|"
                         r"DistBackendError|DistNetworkError|ChildFailedError|SignalException|"
                         r"ProcessGroup|gloo|Socket Timeout|StepStalled|no scheduler progress")


def is_comm_error(e: ExceptionRecord) -> bool:
    """An error that reports a peer's problem (timeouts, lost connections, torchrun's wrapper)."""
    return bool(_COMM_ERROR.search(e.type) or _COMM_ERROR.search(e.message))


def failing_exception(ev: RankEvidence, frames: FrameClassifier) -> ExceptionRecord | None:
    """The exception that best explains this rank's failure (the last in-app one wins)."""
    excs = list(ev.exceptions)
    own = [e for e in excs if not is_comm_error(e)]
    with_app = [e for e in own if frames.in_app_frames(e.frames)]
    for pool in (with_app, own, excs):
        if pool:
            return pool[-1]
    return None


def site_label(f: Frame | None) -> str | None:
    """``func (file.py:line)`` with the bare function name, so py-spy's ``Class.method`` and
    faulthandler's ``method`` label the same site identically."""
    if f is None:
        return None
    base = f.file.rsplit("/", 1)[-1]
    func = f.func.rsplit(".", 1)[-1] if "<" not in f.func else f.func
    return f"{func} ({base}:{f.line})" if f.line is not None else f"{func} ({base})"


def blocked_threads(ev: RankEvidence, frames: FrameClassifier) -> list[ThreadStack]:
    """Threads inside a collective. Without thread dumps for the rank, the traceback of a
    collective that timed out or lost its peer stands in: it shows where the rank waited."""
    dumped = [t for t in ev.threads if frames.state(t) == "blocked"]
    if dumped or list(ev.threads):
        return dumped
    for e in reversed(list(ev.exceptions)):
        if is_comm_error(e) and frames.collective_index(e.frames) is not None:
            return [ThreadStack(name="(traceback)", tid="-", frames=e.frames, source=e.source,
                                origin="traceback")]
    return []


def rank_rows(evidence: Evidence, frames: FrameClassifier) -> list[RankRow]:
    rows = [_row(ev, frames) for ev in evidence.ranks.values()]
    present = set(evidence.ranks)
    for r in sorted(evidence.expected_ranks - present):
        rows.append(RankRow(rank=r, role=_role_for(r, evidence), state="missing"))
    return sorted(rows, key=lambda row: row.rank)


def _row(ev: RankEvidence, frames: FrameClassifier) -> RankRow:
    row = RankRow(rank=ev.rank, role=ev.role, state="unknown", sources=sorted(ev.kinds),
                  last_seq=_last_seq(ev))
    crashed = [t for t in ev.threads if t.fatal]
    exc = failing_exception(ev, frames)
    blocked = blocked_threads(ev, frames)
    if crashed:
        t = crashed[0]
        row.state, row.thread, row.error = "crashed", t.name or t.tid, f"Fatal: {t.fatal}"
        row.frame = site_label(frames.innermost_in_app(t.frames) or (t.frames or [None])[0])
    elif exc is not None and not is_comm_error(exc):
        row.state, row.error = "crashed", f"{exc.short_type}: {exc.message}"[:200]
        row.frame = site_label(frames.innermost_in_app(exc.frames))
    elif blocked:
        t = sorted(blocked, key=lambda t: frames.role(t) != "main")[0]
        row.state, row.thread = "blocked", t.name or t.tid
        row.frame = site_label(frames.innermost_in_app(t.frames))
        row.site = site_label(frames.call_site(t.frames))
        if t.origin == "traceback" and exc is not None:
            row.error = f"{exc.short_type}: {exc.message}"[:200]
    elif exc is not None:
        row.state, row.error = "failed", f"{exc.short_type}: {exc.message}"[:200]
        row.frame = site_label(frames.innermost_in_app(exc.frames))
    elif ev.threads:
        main = [t for t in ev.threads if frames.role(t) == "main"] or list(ev.threads)
        row.thread = main[0].name or main[0].tid
        row.state = frames.state(main[0])
        row.frame = site_label(frames.innermost_in_app(main[0].frames))
    _exit_state(ev, row)
    return row


def _exit_state(ev: RankEvidence, row: RankRow) -> None:
    codes = [x for x in ev.exits if x.exit_code not in (None, 0)]
    if not codes:
        return
    x = sorted(codes, key=lambda x: not x.root_cause)[0]
    what = f"exit {x.exit_code}" + (f" ({x.signal})" if x.signal else "")
    if row.state in ("unknown", "idle", "active"):
        row.state = "exited"
    row.error = f"{row.error}; {what}" if row.error else what


def _last_seq(ev: RankEvidence) -> dict[str, str]:
    out: dict[str, str] = {}
    for group, status in ev.last_seq.items():
        enq, done = status.get("last_enqueued"), status.get("last_completed")
        out[group] = f"enqueued {enq} / completed {done}"
    for group, ring in ev.collectives.items():
        if ring and group not in out and f"pg{group}" not in out:
            last = ring[-1]
            out[group] = f"last {last.op} #{last.seq} ({last.state})"
    hits = ev.hits.get("nccl-watchdog-timeout")
    if hits:
        h = list(hits.kept)[-1]
        out.setdefault("nccl", f"timed out at SeqNum {h.groups.get('seq')} "
                               f"({h.groups.get('op')})")
    return out


def _role_for(rank: int, evidence: Evidence) -> str:
    tp = evidence.topology.tp
    if not tp:
        return "-"
    return f"TP{rank % tp} PP{rank // tp}"


def blocked_sites(evidence: Evidence, frames: FrameClassifier) -> list[BlockedSite]:
    """Ranks grouped by (thread role, call site) of their threads inside collectives."""
    groups: dict[tuple[str, str, str], dict[int, EvidenceItem]] = defaultdict(dict)
    for ev in evidence.ranks.values():
        for t in blocked_threads(ev, frames):
            idx = frames.collective_index(t.frames)
            op = t.frames[idx].func if idx is not None else "?"
            site = site_label(frames.call_site(t.frames)) or "(no in-app caller)"
            groups[(frames.role(t), site, op)].setdefault(ev.rank, EvidenceItem(
                text=f"rank {ev.rank} thread {t.name or t.tid}: {op} from {site}",
                file=t.source.file, line=t.source.line, rank=ev.rank))
    return [BlockedSite(role=k[0], site=k[1], op=k[2], ranks=sorted(v),
                        evidence=[v[r] for r in sorted(v)][:4])
            for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1])))]
