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

from doctor.model.builder import Evidence
from doctor.model.evidence import ExceptionRecord, Frame, RankEvidence, ThreadStack, ThreadState
from doctor.model.findings import BlockedSite, EvidenceItem, RankCondition, RankRow
from doctor.model.frames import FrameClassifier
from doctor.ranks.exits import describe, stopped_after_dump

MAX_MISSING_ROWS = 32
_COMM_ERROR = re.compile(r"Timed out waiting|Connection (closed|reset) by peer|NCCL|"
                         r"DistBackendError|DistNetworkError|ChildFailedError|SignalException|"
                         r"ProcessGroup|gloo|Socket Timeout|StepStalled|no scheduler progress")
#: Communication errors that are this rank's own failure: the collective itself mismatched.
_OWN_COMM_ERROR = re.compile(r"Received data size doesn't match|op\.preamble\.length <= "
                             r"op\.nbytes|Detected mismatch between collectives")


def is_comm_error(e: ExceptionRecord) -> bool:
    """An error that reports a peer's problem (timeouts, lost connections, torchrun's wrapper).
    A size mismatch inside a collective is not one: it is the failure itself."""
    text = f"{e.type}: {e.message}"
    return bool(_COMM_ERROR.search(text)) and not _OWN_COMM_ERROR.search(text)


def failing_exception(ev: RankEvidence, frames: FrameClassifier) -> ExceptionRecord | None:
    """The exception that best explains this rank's failure (the last in-app one wins)."""
    excs = [e for e in ev.exceptions if not e.truncated] or list(ev.exceptions)
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
    """Threads inside a collective. When no dumped thread is inside one (no dumps, or dumps
    taken after the timeout unwound the stack), the traceback of a collective that timed out
    or lost its peer stands in: it shows where the rank waited."""
    dumped = [t for t in ev.threads if frames.state(t) == ThreadState.BLOCKED]
    # py-spy is taken by the launcher at about the same moment on every rank; a rank's own
    # faulthandler dump may come seconds later, after the rank moved on
    pyspy = [t for t in dumped if t.origin == "pyspy"]
    if dumped:
        return pyspy or dumped
    excs = list(ev.exceptions)
    for i in range(len(excs) - 1, -1, -1):
        e = excs[i]
        if is_comm_error(e) and frames.collective_index(e.frames) is not None:
            outer = excs[i + 1] if i + 1 < len(excs) else None
            return [ThreadStack(name="(traceback)", tid="-", frames=_joined(e, outer),
                                source=e.source, origin="traceback")]
    return []


def _joined(inner: ExceptionRecord, outer: ExceptionRecord | None) -> list[Frame]:
    """The inner exception's frames, continued outwards by the exception raised while handling
    it: a timeout caught inside torch and turned into another error shows only torch frames,
    and the outer traceback holds the callers from the frame that caught it onwards."""
    if outer is None or outer.chain not in ("context", "cause") or not inner.frames:
        return inner.frames
    catcher = inner.frames[-1]
    for i, f in enumerate(outer.frames):
        if f.func == catcher.func and f.file == catcher.file:
            return inner.frames + outer.frames[i + 1:]
    return inner.frames


def mark_progress(evidence: Evidence, frames: FrameClassifier) -> None:
    """A live capture samples every rank more than once (``ThreadStack.moved``). A main thread
    caught inside a collective and elsewhere a moment later saw a collective complete, and a
    collective completes on every rank of its group or on none: so the other ranks' main
    threads caught inside collectives are running too, even when their samples landed on the
    same call again (a loop over layers enters one all_reduce line many times a second)."""
    main = [t for ev in evidence.all_ranks() for t in ev.threads
            if t.origin == "pyspy" and frames.role(t) == "main"
            and frames.collective_index(t.frames) is not None]
    if any(t.moved for t in main):
        for t in main:
            t.moved = True


def rank_rows(evidence: Evidence, frames: FrameClassifier) -> list[RankRow]:
    rows = [_row(ev, frames) for ev in evidence.ranks.values()]
    present = set(evidence.ranks)
    # one row per missing rank up to a few; the report lists all of them as ranges
    for r in sorted(evidence.expected_ranks - present)[:MAX_MISSING_ROWS]:
        rows.append(RankRow(rank=r, role=_role_for(r, evidence), state=RankCondition.MISSING))
    return sorted(rows, key=lambda row: row.rank)


def _row(ev: RankEvidence, frames: FrameClassifier) -> RankRow:
    row = RankRow(rank=ev.rank, role=ev.role, state=RankCondition.UNKNOWN, sources=sorted(ev.kinds),
                  last_seq=_last_seq(ev))
    crashed = [t for t in ev.threads if t.fatal]
    exc = failing_exception(ev, frames)
    blocked = blocked_threads(ev, frames)
    if crashed:
        _crashed_row(row, crashed[0], exc, blocked, frames)
    elif exc is not None and not is_comm_error(exc):
        row.state, row.error = RankCondition.CRASHED, f"{exc.text}"[:200]
        row.frame = site_label(frames.innermost_caller(exc.frames))
        if not exc.frames and blocked:  # a C++ exception: where its Python thread waited
            row.site = site_label(frames.call_site(blocked[0].frames))
    elif blocked:
        t = sorted(blocked, key=lambda t: frames.role(t) != "main")[0]
        row.state, row.thread = RankCondition.BLOCKED, t.name or t.tid
        row.frame = site_label(frames.innermost_caller(t.frames))
        row.site = site_label(frames.call_site(t.frames))
        if t.origin == "traceback" and exc is not None:
            row.error = f"{exc.text}"[:200]
    elif exc is not None:
        row.state, row.error = RankCondition.FAILED, f"{exc.text}"[:200]
        row.frame = site_label(frames.innermost_caller(exc.frames))
    elif ev.threads:
        main = [t for t in ev.threads if frames.role(t) == "main"] or list(ev.threads)
        row.thread = main[0].name or main[0].tid
        row.state = RankCondition(frames.state(main[0]))
        row.frame = site_label(frames.innermost_caller(main[0].frames))
    _exit_state(ev, row)
    return row


def _crashed_row(row: RankRow, t: ThreadStack, exc: ExceptionRecord | None,
                 blocked: list[ThreadStack], frames: FrameClassifier) -> None:
    """A thread died of a fatal signal. When it has no Python frames (a C++ abort on a gloo
    thread), the Python thread that was inside a collective says where the rank was, and a
    frameless C++ exception (``terminate called ... what():``) says why."""
    row.state, row.thread, row.error = RankCondition.CRASHED, t.name or t.tid, f"Fatal: {t.fatal}"
    row.frame = site_label(frames.innermost_caller(t.frames)
                           or (t.frames[0] if t.frames else None))
    if t.frames:
        return
    if blocked:
        inside = sorted(blocked, key=lambda b: frames.role(b) != "main")[0]
        row.thread = inside.name or inside.tid
        row.site = site_label(frames.call_site(inside.frames))
        row.frame = row.frame or row.site
    if exc is not None and not exc.frames:
        row.error = f"Fatal: {t.fatal} after {exc.text}"[:200]


#: States in which nothing on the rank's stacks says it failed: its exit code has the last word.
_NO_FAILURE_SEEN = (RankCondition.UNKNOWN, RankCondition.IDLE, RankCondition.ACTIVE)


def _exit_state(ev: RankEvidence, row: RankRow) -> None:
    codes = [x for x in ev.exits if x.exit_code not in (None, 0)]
    if not codes:
        if any(x.exit_code == 0 for x in ev.exits) and row.state in _NO_FAILURE_SEEN:
            # a rank that returned normally: its dump threads say nothing about a failure
            row.state, row.frame, row.thread = RankCondition.FINISHED, None, None
        return
    x = sorted(codes, key=lambda x: not x.root_cause)[0]
    what = describe(x)
    if row.state in _NO_FAILURE_SEEN and not stopped_after_dump(x):
        row.state = RankCondition.EXITED
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
