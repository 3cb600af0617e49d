"""Reducing resolved evidence to the :class:`signatures.matching.Observation` the catalog scores.

Exceptions keep their in-app function names (innermost first); stacks are the failing stacks
(exceptions, threads that died of a signal) and the stacks of threads blocked in collectives;
log hits are counted over all ranks; facts and legacy switches come with their witnesses.
Every function and file on a stack that is not idle (and every source location a log line
names) is kept too, for the catalog's upstream markers: a storage thread idle in
``backup_thread_func`` only says that HiCache was on, so idle stacks do not count.
"""

from __future__ import annotations

from doctor.facts.factset import FactSet
from doctor.model.builder import Evidence
from doctor.model.evidence import ExceptionRecord, RankEvidence, ThreadState
from doctor.model.frames import FrameClassifier
from doctor.ranks.table import blocked_threads, is_comm_error, site_label
from signatures.matching import (
    MechanismHit,
    Observation,
    ObservedException,
    ObservedStack,
    StackKind,
    Witness,
)


def build_observation(ev: Evidence, frames: FrameClassifier, facts: FactSet,
                      mechs: list[MechanismHit]) -> Observation:
    """The observation the catalog scores, from the resolved evidence, its facts and the
    mechanisms the upstream index read (:mod:`doctor.facts.upstream`)."""
    obs = Observation(facts=dict(facts))
    for r in ev.all_ranks():
        _rank(r, frames, obs)
    for switch, src in ev.legacy.items():
        obs.legacy[switch] = Witness(f"the run had legacy switch {switch} on", src.file,
                                     src.line)
    obs.mechanisms = list(mechs)
    obs.single_line = statements(ev) <= 1
    return obs


def statements(ev: Evidence) -> int:
    """How many separate places of the inputs state a failure: distinct lines (failure lines,
    exception lines, lines that matched a catalog pattern), an exception's stack besides its
    line, each stack dump and exit, and any recorded collectives, events or bundle outcome.
    One is a single line: it cannot carry a certain verdict."""
    n = 1 if ev.outcome is not None or ev.legacy else 0
    places: set[tuple[str, int | None]] = set()
    for r in ev.all_ranks():
        places |= {(fl.source.file, fl.source.line) for fl in r.failure_lines.values()}
        places |= {(e.source.file, e.source.line) for e in r.exceptions}
        places |= {(h.source.file, h.source.line) for pid, stats in r.hits.items()
                   if not pid.startswith(("memory-", "prefetch-start")) for h in stats.kept}
        n += len(r.threads) + len(r.exits)
        n += sum(1 for e in r.exceptions if e.frames and not e.truncated)
        n += (1 if r.collectives else 0) + (1 if len(r.events) else 0)
        if n + len(places) > 1:
            return n + len(places)
    return n + len(places)


MAX_NAMES = 4096


def _names(r: RankEvidence, frames: FrameClassifier, obs: Observation) -> None:
    """Functions and files of every stack that is not idle, and the log lines' sources."""
    stacks = [(e.frames, e.source, f"rank {r.rank} exception {e.text}"[:200])
              for e in r.exceptions]
    stacks += [(t.frames, t.source, f"rank {r.rank} thread {t.name or t.tid}")
               for t in r.threads if frames.state(t) != ThreadState.IDLE]
    for stack, src, what in stacks:
        for f in stack:
            if len(obs.functions) < MAX_NAMES and f.func not in obs.functions:
                obs.functions[f.func] = Witness(f"on the stack of {what}", src.file, src.line,
                                                r.rank)
            if len(obs.files) < MAX_NAMES and f.file not in obs.files:
                obs.files[f.file] = Witness(f"on the stack of {what}", src.file, src.line,
                                            r.rank)
    for site, src in r.sites.items():
        if len(obs.files) < MAX_NAMES and site not in obs.files:
            obs.files[site] = Witness(f"rank {r.rank} log line from {site}", src.file,
                                      src.line, r.rank)


def _rank(r: RankEvidence, frames: FrameClassifier, obs: Observation) -> None:
    _names(r, frames, obs)
    for e in r.exceptions:
        app = frames.in_app_frames(e.frames)
        funcs, files = [f.func for f in app], [f.file for f in app]
        wit = _exc_witness(e, r.rank, frames)
        secondary = is_comm_error(e)
        obs.exceptions.append(ObservedException(e.type, e.message, funcs, wit, secondary, files,
                                                e.truncated))
        if funcs and not secondary:
            obs.stacks.append(ObservedStack(StackKind.EXCEPTION, funcs, wit, files))
    for t in r.threads:
        if t.fatal:
            app = [f for f in t.frames if frames.in_app(f)]
            obs.stacks.append(ObservedStack(StackKind.EXCEPTION, [f.func for f in app], Witness(
                f"rank {r.rank} thread {t.name or t.tid}: Fatal Python error: {t.fatal}",
                t.source.file, t.source.line, r.rank), [f.file for f in app]))
    for t in blocked_threads(r, frames):
        app = frames.in_app_frames(t.frames)
        funcs = [f.func for f in app]
        site = site_label(frames.call_site(t.frames))
        obs.stacks.append(ObservedStack(StackKind.BLOCKED, funcs, Witness(
            f"rank {r.rank} thread {t.name or t.tid} blocked in a collective from {site}",
            t.source.file, t.source.line, r.rank), [f.file for f in app]))
    for pid, stats in r.hits.items():
        count, wits = obs.log_hits.get(pid, (0, []))
        wits = wits + [Witness(h.text, h.source.file, h.source.line, r.rank)
                       for h in stats.kept][: max(0, 6 - len(wits))]
        obs.log_hits[pid] = (count + stats.count, wits)


def _exc_witness(e: ExceptionRecord, rank: int, frames: FrameClassifier) -> Witness:
    where = site_label(frames.innermost_caller(e.frames))
    text = f"{e.text}" + (f" at {where}" if where else "")
    who = f"rank {rank}: " if rank >= 0 else ""
    return Witness(who + text, e.source.file, e.source.line, rank)
